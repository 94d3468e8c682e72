"""Helpers shared by tests and benchmarks (tiny checkpoints); not used by the server itself."""
