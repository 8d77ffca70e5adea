"""Model code: architecture configs read from a model directory, the causal-LM shell and the
blocks of each family, layers, MoE, INT4, the loader, and the registry (`registry.py`)."""
