"""Unit tests: one component each, on hand-built inputs or the embedded fixture."""
