"""Benchmarks: the offline throughput and latency runs, the serving load, rooflines."""
