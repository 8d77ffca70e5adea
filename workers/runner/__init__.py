"""The model runner and everything it owns on the device: step inputs, attention metadata,
the paged KV cache, host copies, sampling, and the backends that run a forward (eager, CPU,
captured graphs)."""
