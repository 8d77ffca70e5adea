"""specd.ipc."""
