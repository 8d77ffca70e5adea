"""specd.workers.spec."""
