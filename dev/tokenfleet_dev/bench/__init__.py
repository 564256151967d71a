"""Benchmarks that run on the embedded local control plane."""
