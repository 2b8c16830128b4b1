"""Helpers for tests and benchmarks that need real external processes (pool servers)."""
