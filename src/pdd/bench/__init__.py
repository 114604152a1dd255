"""Benchmark real deployments: the streaming HTTP client, the runner that starts
each deployment and sends it a workload, `pdd bench` (its CLI), a fake server
for self-tests and the handoff micro-benchmark. The workloads, records,
metrics and reports it shares with the simulator live in `pdd.measure`."""
