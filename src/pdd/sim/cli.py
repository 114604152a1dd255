"""`pdd sim -c FILE [-c FILE ...] [--out DIR]`: simulate deployments side by side.

Also `pdd sim --calibrate STEPS.jsonl --model M --hardware H`: fit the cost
model to an engine's step log and print the coefficients.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", action="append", type=Path, default=[],
                   help="scenario TOML (repeat to put modes side by side)")
    p.add_argument("--out", type=Path, default=None, help="write summary.json here")
    p.add_argument("--records", action="store_true", help="also write records-<mode>.jsonl")
    p.add_argument("--duration", type=float, default=None,
                   help="override workload.duration_s (quick looks)")
    p.add_argument("--calibrate", type=Path, default=None, metavar="STEPS_JSONL",
                   help="fit the cost model to step records instead of simulating")
    p.add_argument("--model", default="smollm2-135m", help="model preset for --calibrate")
    p.add_argument("--hardware", default="cpu", help="hardware profile for --calibrate")
    p.add_argument("--chips", type=int, default=1, help="chips per instance for --calibrate")


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    if args.calibrate is not None:
        from pdd.sim.cost_model import CostModel, calibrate
        from pdd.sim.hardware import get_profile
        from pdd.sim.model_shape import get_model

        recs = [json.loads(l) for l in args.calibrate.read_text().splitlines() if l.strip()]
        base = CostModel(get_model(args.model), get_profile(args.hardware), args.chips)
        cal = calibrate(recs, base)
        m = cal.model
        print(json.dumps({"num_records": cal.num_records, "rmse_s": cal.rmse_s, "r2": cal.r2,
                          "mfu": m.mfu, "mbu": m.mbu, "overhead_s": m.overhead_s,
                          "per_seq_s": m.per_seq_s}, indent=2))
        return 0

    from pdd.sim.runner import simulate
    from pdd.sim.scenario import load

    if not args.config:
        print("pdd sim: give at least one -c FILE")
        return 2
    scenario = load(args.config)
    if args.duration is not None:
        scenario = dataclasses.replace(
            scenario, workload=dataclasses.replace(scenario.workload, duration_s=args.duration),
            settings=dataclasses.replace(scenario.settings,
                                         warmup_s=min(scenario.settings.warmup_s, args.duration / 4)))
    summary = simulate(scenario, args.out, args.records)
    print(f"{'mode':<14}{'reqs':>7}{'fail':>6}{'TTFT p50':>10}{'p90':>8}{'p99':>8}"
          f"{'TPOT p50':>10}{'SLA%':>7}{'goodput':>9}{'$/h':>8}{'BCR':>9}{'RLD%':>6}")
    for name, m in summary["modes"].items():
        print(f"{name:<14}{m['num_requests']:>7}{m['num_failed']:>6}"
              f"{m['ttft_s']['p50']:>10.2f}{m['ttft_s']['p90']:>8.2f}{m['ttft_s']['p99']:>8.2f}"
              f"{m['tpot_s']['p50'] * 1e3:>8.1f}ms{m['sla_attainment'] * 100:>6.1f}"
              f"{m['goodput_rps']:>9.3f}{m['cost_per_hour']:>8.1f}{m['bcr'] * 1e3:>9.3f}"
              f"{m['rld_token_share'] * 100:>6.1f}")
    print(f"wall {summary['wall_s']:.1f}s, simulated {summary['simulated_s']:.0f}s"
          + (f", wrote {args.out / 'summary.json'}" if args.out else ""))
    return 0
