"""Discrete-event cluster simulator and capacity planner.

It shares `pdd.policy` with the real router (routing, pipeline, filter,
handoff), models steps with a roofline cost model calibrated on measured
engine steps, and writes the same `RequestRecord` / summary.json as
`pdd bench`. Entry points: `pdd sim` (cli.py) and `pdd plan` (plan_cli.py).
"""
