"""Integration tests: the engine, the daemon and the tools end to end. Their shared helpers
live beside them: daemon_harness, heldout, scenario, ct_asymmetric."""
