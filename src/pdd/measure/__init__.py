"""What a run of the system is measured on and by, measured or simulated.

The vocabulary `pdd bench` (real deployments) and `pdd sim` (the simulator)
share, and nothing that drives either: the workload sent (`workload`,
`agentic`, `trace`; built from the same command-line flags by `flags`), the
per-request record (`records`), the arithmetic of a summary (`metrics`: the
SLA, goodput, BCR), the files both write and read (`files`: workload.json,
records.jsonl, summary JSON), the side-by-side tables and the report's
reference figures (`report`) and the figures (`plots`). No sockets, no
processes, no event loop: `pdd.bench` adds the HTTP client and the runner of
real deployments, `pdd.sim` the simulated cluster.
"""
