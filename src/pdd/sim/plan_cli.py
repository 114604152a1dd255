"""`pdd plan`: capacity planning by simulation.

Sweeps the instance counts of one mode's pools over a grid, simulates each
deployment on the scenario's workload, and ranks them by BCR among those
meeting a minimum SLA attainment:

    pdd plan -c examples/sim/report-pdd.toml --mode pdd \\
        --vary prefill=8:12:2 --vary main=6:10:2 --duration 900 --out results/plan
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", action="append", type=Path, required=True)
    p.add_argument("--mode", default=None, help="mode to vary (default: the first)")
    p.add_argument("--vary", action="append", default=[], metavar="ROLE=LO:HI[:STEP]",
                   help="instance counts to try for the pool of ROLE")
    p.add_argument("--duration", type=float, default=None, help="override workload.duration_s")
    p.add_argument("--min-sla", type=float, default=0.9, help="minimum SLA attainment")
    p.add_argument("--out", type=Path, default=None, help="write plan.json here")


def parse_vary(items: list[str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for item in items:
        role, _, spec = item.partition("=")
        parts = [int(x) for x in spec.split(":")]
        if len(parts) == 1:
            parts = [parts[0], parts[0]]
        lo, hi, step = parts[0], parts[1], parts[2] if len(parts) > 2 else 1
        if lo < 0 or hi < lo or step < 1:
            raise ValueError(f"--vary {item}: need 0 <= LO <= HI and STEP >= 1")
        out[role] = list(range(lo, hi + 1, step))
    return out


def candidates(mode, grid: dict[str, list[int]]):
    """Every ModeSpec of the grid, named after its counts."""
    import dataclasses
    import itertools

    roles = sorted(grid)
    known = {p.role.value for p in mode.pools}
    for r in roles:
        if r not in known:
            raise ValueError(f"mode {mode.name} has no {r!r} pool (has {sorted(known)})")
    for counts in itertools.product(*(grid[r] for r in roles)):
        by_role = dict(zip(roles, counts))
        pools = tuple(dataclasses.replace(p, count=by_role.get(p.role.value, p.count))
                      for p in mode.pools)
        name = mode.name + "".join(f"-{r[0]}{c}" for r, c in by_role.items())
        yield dataclasses.replace(mode, name=name, pools=pools)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from pdd.sim.runner import _finite, run_mode
    from pdd.sim.scenario import load

    sc = load(args.config)
    if args.duration is not None:
        sc = dataclasses.replace(
            sc, workload=dataclasses.replace(sc.workload, duration_s=args.duration),
            settings=dataclasses.replace(sc.settings,
                                         warmup_s=min(sc.settings.warmup_s, args.duration / 4)))
    mode = next((m for m in sc.modes if m.name == args.mode), None) if args.mode else sc.modes[0]
    if mode is None:
        print(f"pdd plan: no mode {args.mode!r}")
        return 2
    rows = []
    for cand in candidates(mode, parse_vary(args.vary)):
        entry, _, _ = run_mode(sc, cand)
        rows.append({"name": cand.name, "chips": cand.num_chips(),
                     "cost_per_hour": entry["cost_per_hour"], "bcr": entry["bcr"],
                     "goodput_rps": entry["goodput_rps"],
                     "sla_attainment": entry["sla_attainment"],
                     "ttft_p90_s": entry["ttft_s"]["p90"], "tpot_p90_s": entry["tpot_s"]["p90"]})
        r = rows[-1]
        print(f"{r['name']:<28} ${r['cost_per_hour']:>7.1f}/h  SLA {r['sla_attainment']:6.1%}  "
              f"goodput {r['goodput_rps']:6.2f}/s  BCR {r['bcr'] * 1e3:7.2f}e-3")
    ok = [r for r in rows if r["sla_attainment"] >= args.min_sla]
    best = max(ok, key=lambda r: r["bcr"]) if ok else None
    print(f"best (SLA >= {args.min_sla:.0%}): {best['name'] if best else 'none'}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan.json").write_text(
            json.dumps(_finite({"candidates": rows, "best": best}), indent=2) + "\n")
    return 0
