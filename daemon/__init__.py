"""specd.daemon."""
