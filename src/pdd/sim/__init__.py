"""Discrete-event cluster simulator and capacity planner.

It shares `pdd.policy` with the real router (routing, pipeline, filter,
handoff), models steps with a roofline cost model calibrated on measured
engine steps, and writes the same `RequestRecord` / summary.json as
`pdd bench`. It reads its own scenario files (GPU profiles, report scale) and
the runtime's deployment files (this CPU), replays bench runs to measure its
own error, and draws the report's figures. Entry points: `pdd sim`
(cli.py: scenarios, runtime files, --calibrate, --validate, report) and
`pdd plan` (plan_cli.py). See docs/SIMULATOR.md.
"""
