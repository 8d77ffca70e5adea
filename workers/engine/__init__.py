"""The engine: `EngineCore` (schedule, run, update), the scheduler and its KV block
bookkeeping, sequences and batches, failure isolation, warm-up, and the in-process API."""
