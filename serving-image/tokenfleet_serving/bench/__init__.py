"""Benchmarks (entry points, not timed tests)."""
