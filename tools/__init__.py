"""specd's tools: fixture and draft-head trainers, quantization, benchmarks, device checks.

A package so that the tools import each other, and the tests import them, by their full
names (`tools.workload`, `tools.quantize`). Run one from the repository root as
`python -m tools.NAME`; none is installed with specd.
"""
