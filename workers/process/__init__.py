"""The scheduler process: its entry point and engine loop, the link's IO threads, the
start-up stage watch, and dying with the parent."""
