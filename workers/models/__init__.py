"""specd.workers.models."""
