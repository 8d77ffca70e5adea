"""Deployment planning (`specctl plan`): what one GPU holds for a model directory and a
layout, and whether it fits."""
