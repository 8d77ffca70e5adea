"""specd.workers."""
