"""specd.kernels."""
