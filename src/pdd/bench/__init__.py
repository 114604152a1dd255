"""Benchmark harness: workloads, a streaming client, metrics and reports."""
