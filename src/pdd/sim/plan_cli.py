"""`pdd plan`: capacity planning by simulation.

Searches instance counts per role (--vary), hardware per role (--hardware,
scenarios only) and WAN lines (--wan-gbps), simulates every candidate on
the workload with the SLA targets, prints the top candidates by BCR among
those meeting the SLA, and writes plan.json plus the winner:

    pdd plan -c examples/sim/report-pdd.toml --vary prefill=8:12:2 --vary main=6:10:2 \\
        --hardware main=gpu_b,h200 --wan-gbps 50:2 --wan-gbps 100:4 \\
        --sla-ttft 6 --sla-tpot 0.08 --duration 900 --out results/plan
      -> results/plan/winner.toml, a simulator scenario (GPU profiles)
    pdd plan -c examples/pdd.toml --workload agentic --quick \\
        --vary prefill=1:2 --vary main=1:2 --out results/plan-cpu
      -> results/plan-cpu/winner.toml, a deployment file for `pdd up` (this CPU)
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.splitlines()[0]
    p.add_argument("-c", "--config", action="append", type=Path, required=True,
                   help="simulator scenario TOML(s), or one runtime deployment TOML")
    p.add_argument("--mode", default=None, help="scenario mode to vary (default: the first)")
    p.add_argument("--vary", action="append", default=[], metavar="ROLE=LO:HI[:STEP]",
                   help="instance counts to try for ROLE")
    p.add_argument("--hardware", action="append", default=[], metavar="ROLE=HW[,HW...]",
                   help="scenarios: hardware profiles to try for ROLE's pool")
    p.add_argument("--wan-gbps", action="append", default=[], metavar="GBPS[:PRICE_PER_HOUR]",
                   help="WAN lines to try (price: keep the file's when omitted)")
    p.add_argument("--min-sla", type=float, default=0.9, help="minimum SLA attainment")
    p.add_argument("--duration", type=float, default=None, help="scenarios: workload.duration_s")
    p.add_argument("--top", type=int, default=5, help="candidates to print")
    p.add_argument("--calibration", type=Path, default=None, help="runtime files: CPU calibration")
    p.add_argument("--out", type=Path, default=None, help="write plan.json and winner.toml here")
    from pdd.sim.cli import add_workload_and_wan_arguments

    add_workload_and_wan_arguments(p)


def parse_vary(items: list[str]) -> dict[str, list[int]]:
    from pdd.sim.plan import parse_range, parse_role_values

    return parse_role_values(items, parse_range)


def candidates(mode, grid: dict[str, list[int]]):
    """Every ModeSpec of a count grid (kept for callers of the first version)."""
    from pdd.sim.plan import scenario_candidates

    return scenario_candidates(mode, grid, {}, [])


def run(args: argparse.Namespace) -> int:
    from pdd.sim.plan import parse_role_values, parse_wan
    from pdd.sim.runtime import is_runtime_file

    counts = parse_vary(args.vary)
    hardware = parse_role_values(args.hardware, lambda s: [x for x in s.split(",") if x])
    wans = parse_wan(args.wan_gbps)
    if len(args.config) == 1 and is_runtime_file(args.config[0]):
        if hardware:
            print("pdd plan: --hardware applies to simulator scenarios; a deployment file runs on this CPU")
            return 2
        rows, winner_text, kind = _plan_runtime(args, counts, wans)
    else:
        rows, winner_text, kind = _plan_scenario(args, counts, hardware, wans)
    if rows is None:
        return 2
    _report(args, rows, winner_text, kind)
    return 0


def _scenario(args):
    import dataclasses

    from pdd.measure.metrics import Sla
    from pdd.sim.scenario import load

    sc = load(args.config)
    if args.duration is not None:
        sc = dataclasses.replace(
            sc, workload=dataclasses.replace(sc.workload, duration_s=args.duration),
            settings=dataclasses.replace(sc.settings,
                                         warmup_s=min(sc.settings.warmup_s, args.duration / 4)))
    if args.sla_ttft is not None or args.sla_tpot is not None:
        sc = dataclasses.replace(sc, sla=Sla(args.sla_ttft or sc.sla.ttft_s, args.sla_tpot or sc.sla.tpot_s))
    return sc


def _plan_scenario(args, counts, hardware, wans):
    from pdd.sim.plan import MAX_CANDIDATES, row, scenario_candidates, scenario_doc
    from pdd.sim.runner import run_mode
    from pdd.sim.toml_out import dumps

    sc = _scenario(args)
    mode = next((m for m in sc.modes if m.name == args.mode), None) if args.mode else sc.modes[0]
    if mode is None:
        print(f"pdd plan: no mode {args.mode!r}")
        return None, None, None
    cands = list(scenario_candidates(mode, counts, hardware, wans))
    if len(cands) > MAX_CANDIDATES:
        print(f"pdd plan: {len(cands)} candidates; narrow the grid (at most {MAX_CANDIDATES})")
        return None, None, None
    rows, by_name = [], {}
    for cand in cands:
        entry, _, _ = run_mode(sc, cand)
        rows.append(row(cand.name, entry, cand.num_chips()))
        by_name[cand.name] = cand
        _progress(rows[-1])
    best = _best(rows, args.min_sla)
    text = None
    if best is not None:
        text = dumps(scenario_doc(sc, by_name[best["name"]]), header=(
            f"pdd plan winner: {best['name']} (BCR {best['bcr']:.4g}, SLA {best['sla_attainment']:.1%})\n"
            f"a simulator scenario: pdd sim -c winner.toml"))
    return rows, text, "simulator scenario (GPU profiles): pdd sim -c winner.toml"


def _plan_runtime(args, counts, wans):
    from pdd.deploy.spec import load_spec, parse_spec
    from pdd.measure.flags import build_workload, sla_from_args
    from pdd.sim.calibration import CpuCalibration
    from pdd.sim.plan import MAX_CANDIDATES, deployment_doc, row, runtime_candidates
    from pdd.sim.runtime import run_runtime_spec
    from pdd.sim.toml_out import dumps

    spec = load_spec(args.config[0])
    wl = build_workload(args)
    sla = sla_from_args(args)
    cal = CpuCalibration.read(args.calibration) if args.calibration else None
    cands = list(runtime_candidates(spec, counts, wans))
    if len(cands) > MAX_CANDIDATES:
        print(f"pdd plan: {len(cands)} candidates; narrow the grid (at most {MAX_CANDIDATES})")
        return None, None, None
    rows, by_name = [], {}
    for name, cand in cands:
        entry, _, _ = run_runtime_spec(cand, name, wl, sla, cal)
        rows.append(row(name, entry, {i.role.value: len(cand.by_role(i.role)) for i in cand.instances}))
        by_name[name] = cand
        _progress(rows[-1])
    best = _best(rows, args.min_sla)
    text = None
    if best is not None:
        doc = deployment_doc(by_name[best["name"]])
        text = dumps(doc, header=(
            f"pdd plan winner: {best['name']} (BCR {best['bcr']:.4g}, SLA {best['sla_attainment']:.1%})\n"
            f"a deployment file for this CPU: pdd up -c winner.toml"), inline=("engine",))
        import tomllib

        parse_spec(tomllib.loads(text))      # the winner must be a valid deployment file
    return rows, text, "deployment file (this CPU, pdd.deploy.spec): pdd up -c winner.toml"


def _best(rows: list[dict], min_sla: float) -> dict | None:
    ok = [r for r in rows if r["sla_attainment"] >= min_sla]
    return max(ok, key=lambda r: (r["bcr"], r["name"])) if ok else None


def _progress(r: dict) -> None:
    print(f"  {r['name']:<36} ${r['cost_per_hour']:>8.2f}/h  SLA {r['sla_attainment']:6.1%}  "
          f"goodput {r['goodput_rps']:7.3f}/s  BCR {r['bcr']:.4g}", flush=True)


def _report(args, rows: list[dict], winner_text: str | None, kind: str) -> None:
    from pdd.measure.files import write_json
    from pdd.sim.plan import rank

    ranked = rank(rows, args.min_sla)
    best = _best(rows, args.min_sla)
    print(f"\ntop {min(args.top, len(ranked))} of {len(rows)} (SLA attainment >= {args.min_sla:.0%} first, by BCR):")
    for r in ranked[: args.top]:
        mark = "*" if best is not None and r["name"] == best["name"] else " "
        print(f" {mark} {r['name']:<36} BCR {r['bcr']:.4g}  SLA {r['sla_attainment']:6.1%}  "
              f"${r['cost_per_hour']:.2f}/h  TTFT p90 {r['ttft_p90_s']:.2f}s  TPOT p90 "
              f"{r['tpot_p90_s'] * 1e3:.1f}ms")
    print(f"best (SLA >= {args.min_sla:.0%}): {best['name'] if best else 'none'}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "plan.json", {"candidates": rows, "ranked": [r["name"] for r in ranked],
                                            "best": best, "winner_kind": kind if best else None})
        if winner_text is not None:
            (args.out / "winner.toml").write_text(winner_text)
            print(f"wrote {args.out / 'winner.toml'}: a {kind}")
