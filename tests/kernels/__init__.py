"""Kernel tests: the Triton kernels against their pure-torch references (interpreted on the
CPU), compiled for sm_90, and on a GPU."""
