"""`pdd sim`: the cluster simulator.

    pdd sim -c examples/sim/report-88a.toml -c examples/sim/report-pdd.toml --out DIR
        simulator scenarios (GPU profiles, report scale), modes side by side
    pdd sim -c examples/pdd.toml --workload agentic --quick --out DIR [--calibration CAL]
        runtime deployment files on this CPU, on the very workload `pdd bench`
        would send (same flags, defaults and seed); same summary.json schema
    pdd sim --calibrate results/quick [more steps.jsonl or dirs] [--out cal.json]
        fit the CPU profile to the engine steps a bench run saved
    pdd sim --validate results/quick [--closed-loop]
        replay a bench run (its requests when the run sent them), write
        results/quick/validation.json, print errors
    pdd sim report --out results/sim-report [--quick]
        the report's figures (PNG) and report.md
    pdd sim sweep -c ... --preset wan-bound --rates 25,50,100,200,400 [--real RUN ...]
        TTFT p50/p90 of the modes against the WAN rate (pdd.sim.wan_sweep)
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from pdd.measure.flags import add_workload_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__.splitlines()[0]
    p.add_argument("command", nargs="?", choices=["report", "sweep"], default=None,
                   help="report: draw the report's figures from simulator sweeps; "
                        "sweep: TTFT against the WAN rate (simulated, plus --real bench runs)")
    p.add_argument("--rates", default="25,50,100,200,400", help="sweep: WAN rates in Mbit/s")
    p.add_argument("--real", type=Path, nargs="+", default=None, metavar="RUN",
                   help="sweep: bench run folders to mark on the same axes")
    p.add_argument("-c", "--config", action="append", type=Path, default=[],
                   help="scenario TOML or runtime deployment TOML (repeat for modes side by side)")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder (summary.json ...); with --calibrate, a .json file")
    p.add_argument("--records", action="store_true", help="scenarios: also write records-<mode>.jsonl")
    p.add_argument("--event-log", type=Path, default=None, metavar="FILE",
                   help="write every simulated event to FILE, one JSON line each "
                        "(t, kind, type, mode, the record's fields): diff two runs")
    p.add_argument("--duration", type=float, default=None,
                   help="scenarios: override workload.duration_s (quick looks)")
    p.add_argument("--calibrate", nargs="+", type=Path, default=None, metavar="STEPS",
                   help="fit the CPU profile to steps.jsonl files or bench result folders")
    p.add_argument("--calibration", type=Path, default=None, metavar="CAL_JSON",
                   help="runtime files / --validate: CPU profile fitted by --calibrate")
    p.add_argument("--validate", type=Path, nargs="+", default=None, metavar="RUN",
                   help="replay the bench run RUN (results/<name>) and write validation.json; "
                        "several runs of one workload: also their summary")
    p.add_argument("--run-speeds", action="store_true",
                   help="--validate with --calibration: keep its fits, but measure each instance's speed "
                        "on the replayed run's own engine steps (this machine's speed drifts by the hour)")
    p.add_argument("--closed-loop", action="store_true",
                   help="--validate: close each session's loop on the simulated times (a turn due think "
                        "time after its predecessor's simulated end) instead of sending every request "
                        "when the run sent it")
    p.add_argument("--model", default="smollm2-135m", help="model preset for --calibrate")
    p.add_argument("--hardware", default="cpu", help="hardware profile for --calibrate")
    p.add_argument("--no-plots", action="store_true")
    add_workload_and_wan_arguments(p)

    r = p.add_argument_group("runtime overheads (runtime files, --validate)")
    r.add_argument("--token-overhead-ms", type=float, default=None,
                   help="per streamed token, instance -> router -> client")
    r.add_argument("--request-overhead-ms", type=float, default=None,
                   help="router work before a request reaches P")
    r.add_argument("--loopback-mbps", type=float, default=None, help="local KV link")
    r.add_argument("--no-stream-kv", action="store_true",
                   help="P sends KV after the whole prefill (runs recorded before it streamed)")
    r.add_argument("--no-layer-stream", action="store_true",
                   help="P streams a chunk's KV only once the chunk is computed, not layer by layer "
                        "(runs recorded before it did)")
    r.add_argument("--no-jitter", action="store_true",
                   help="step times exactly as fitted, without the measured scatter")
    r.add_argument("--no-line-buffer", action="store_true",
                   help="a transfer a user waits on takes the WAN at once, not after the bytes "
                        "already in the line's buffer (and a yielding copy's sockets)")
    r.add_argument("--jitter-seed", type=int, default=0, help="seed of the step-time jitter")
    r.add_argument("--seeds", type=int, default=5,
                   help="--validate: jitter seeds to simulate; the median is the prediction")


def add_workload_and_wan_arguments(p: argparse.ArgumentParser) -> None:
    """`pdd bench`'s workload flags (`pdd.measure.flags`: same names and
    defaults) and its --wan-mbps."""
    add_workload_arguments(p, quick_help="the quick bench workload (pdd sim report: shorter sweeps)")
    p.add_argument("--wan-mbps", type=float, default=None, metavar="MBPS",
                   help="runtime files: override every deployment's WAN line rate")
    p.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="runtime files: route N short requests before the run, as `pdd bench --warmup` "
                        "sends them (the relay budgets count them)")


def _options(args):
    import dataclasses

    from pdd.sim.deployment import RuntimeOptions

    o = RuntimeOptions()
    if args.token_overhead_ms is not None:
        o = dataclasses.replace(o, token_s=args.token_overhead_ms / 1e3)
    if args.request_overhead_ms is not None:
        o = dataclasses.replace(o, request_s=args.request_overhead_ms / 1e3)
    if args.loopback_mbps is not None:
        o = dataclasses.replace(o, loopback_gbps=args.loopback_mbps / 1e3)
    return dataclasses.replace(o, step_jitter=not args.no_jitter, seed=args.jitter_seed,
                               line_buffer=not args.no_line_buffer,
                               stream_kv=not args.no_stream_kv,
                               stream_kv_layers=not (args.no_stream_kv or args.no_layer_stream))


def _calibration(args):
    from pdd.sim.calibration import CpuCalibration

    return CpuCalibration.read(args.calibration) if args.calibration else None


def run(args: argparse.Namespace) -> int:
    if args.command == "report":
        from pdd.sim.report import run_report

        return run_report(args.out or Path("results/sim-report"), quick=args.quick)
    if args.command == "sweep":
        from pdd.sim.wan_sweep import run_sweep

        return run_sweep(args)
    if args.calibrate is not None:
        return _run_calibrate(args)
    if args.validate is not None:
        from pdd.sim.validate import print_summary, print_table, summarize, validate

        if args.seeds < 1:
            print("pdd sim: --seeds must be >= 1")
            return 2
        done = []
        for run_dir in args.validate:
            v = validate(run_dir, _calibration(args), _options(args), seeds=args.seeds,
                         run_speeds=args.run_speeds,
                         arrivals="closed-loop" if args.closed_loop else "recorded")
            print(f"== {run_dir}")
            print_table(v)
            print(f"wrote {run_dir / 'validation.json'}")
            done.append(v)
        if len(done) > 1:
            print_summary(summarize(done))
        return 0
    if not args.config:
        print("pdd sim: give at least one -c FILE (or --calibrate / --validate / report)")
        return 2
    from pdd.sim.runtime import is_runtime_file

    kinds = {is_runtime_file(c) for c in args.config}
    if len(kinds) > 1:
        print("pdd sim: do not mix deployment files and simulator scenarios in one run")
        return 2
    return _run_runtime(args) if kinds == {True} else _run_scenarios(args)


def _run_calibrate(args) -> int:
    import json

    from pdd.sim.calibration import fit
    from pdd.sim.deployment import calibration_model

    cal = fit(args.calibrate, calibration_model(args.model, args.calibrate), args.hardware)
    print(json.dumps(cal.to_dict(), indent=2))
    if args.out is not None:
        path = args.out if args.out.suffix == ".json" else args.out / "calibration.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        cal.save(path)
        print(f"wrote {path}")
    return 0


def _run_runtime(args) -> int:
    from pdd.measure import report
    from pdd.measure.flags import build_workload, sla_from_args
    from pdd.sim.runtime import RuntimeMode, simulate_deployments

    names = [c.stem for c in args.config]
    if len(set(names)) != len(names):
        print(f"pdd sim: two deployment files share a file stem: {names}")
        return 2
    wl = build_workload(args)
    sla = sla_from_args(args)
    from pdd.deploy.spec import link_overrides

    modes = [RuntimeMode(c.stem, str(c), link_overrides(args.wan_mbps)) for c in args.config]
    with _event_log(args) as log:
        summary = simulate_deployments(modes, wl, sla, args.out, _calibration(args), _options(args),
                                       plots=not args.no_plots, event_log=log, warmup=args.warmup)
    report.print_table(summary)
    print(f"wall {summary['wall_s']:.2f}s, simulated {summary['simulated_s']:.1f}s"
          + (f", wrote {args.out / 'summary.json'}" if args.out else ""))
    return 0


def _run_scenarios(args) -> int:
    import dataclasses

    from pdd.sim.runner import simulate
    from pdd.sim.scenario import load

    scenario = load(args.config)
    if args.duration is not None:
        scenario = dataclasses.replace(
            scenario, workload=dataclasses.replace(scenario.workload, duration_s=args.duration),
            settings=dataclasses.replace(scenario.settings,
                                         warmup_s=min(scenario.settings.warmup_s, args.duration / 4)))
    with _event_log(args) as log:
        summary = simulate(scenario, args.out, args.records, event_log=log)
    print_scenario_table(summary)
    print(f"wall {summary['wall_s']:.1f}s, simulated {summary['simulated_s']:.0f}s"
          + (f", wrote {args.out / 'summary.json'}" if args.out else ""))
    return 0


@contextlib.contextmanager
def _event_log(args):
    """The run's `EventLog` on --event-log FILE, or None."""
    if args.event_log is None:
        yield None
        return
    from pdd.sim.events import EventLog

    args.event_log.parent.mkdir(parents=True, exist_ok=True)
    with open(args.event_log, "w") as f:
        yield EventLog(f)
    print(f"wrote {args.event_log}")


def print_scenario_table(summary: dict) -> None:
    print(f"{'mode':<14}{'reqs':>7}{'fail':>6}{'TTFT p50':>10}{'p90':>8}{'p99':>8}"
          f"{'TPOT p50':>10}{'SLA%':>7}{'goodput':>9}{'$/h':>8}{'BCR':>9}{'RLD%':>6}")
    for name, m in summary["modes"].items():
        print(f"{name:<14}{m['num_requests']:>7}{m['num_failed']:>6}"
              f"{m['ttft_s']['p50']:>10.2f}{m['ttft_s']['p90']:>8.2f}{m['ttft_s']['p99']:>8.2f}"
              f"{m['tpot_s']['p50'] * 1e3:>8.1f}ms{m['sla_attainment'] * 100:>6.1f}"
              f"{m['goodput_rps']:>9.3f}{m['cost_per_hour']:>8.1f}{m['bcr'] * 1e3:>9.3f}"
              f"{m['rld_token_share'] * 100:>6.1f}")
