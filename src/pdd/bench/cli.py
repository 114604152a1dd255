"""`pdd bench`: deployments side by side on one workload, or `pdd bench engine`.

    pdd bench -c examples/pd-wan.toml -c examples/pdd.toml --workload agentic \\
        --num-requests 40 --seed 0 --out results/agentic [--quick] \\
        [--sla-ttft 3 --sla-tpot 0.25] [--ablation no-drc --ablation one-shot]
    pdd bench ... --workload trace:/work/shared/traces/mooncake_conversation.jsonl
    pdd bench engine --out results/engine.json     # -> pdd.engine.bench

Every deployment runs the same workload (same seed, same token ids), one
after another; outputs land in --out: summary.json, <mode>/records.jsonl,
PNG figures and report.md. The table is printed at the end.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import replace
from pathlib import Path

from pdd.bench import agentic

DEFAULT_SLA_TTFT_S = 3.0
DEFAULT_SLA_TPOT_S = 0.25


DELEGATES = {"engine": "pdd.engine.bench", "handoff": "pdd.bench.handoff"}


class _DelegateParser(argparse.ArgumentParser):
    """Parses `pdd bench engine|handoff ...` with that module's own arguments,
    importing it only when its subcommand is used."""

    def parse_known_args(self, args=None, namespace=None):
        module = importlib.import_module(DELEGATES[self.prog.split()[-1]])
        real = argparse.ArgumentParser(prog=self.prog, description=self.description)
        module.add_arguments(real)
        ns, rest = real.parse_known_args(args, namespace)
        ns._bench_delegate = module.run
        return ns, rest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.splitlines()[0]
    sub = parser.add_subparsers(dest="bench_command", metavar="[engine|handoff]",
                                parser_class=_DelegateParser)
    sub.add_parser("engine", help="engine micro-benchmark (pdd.engine.bench)",
                   description="engine micro-benchmark", add_help=False)
    sub.add_parser("handoff", help="100-token handoff: extend recompute vs KV over the WAN",
                   description="handoff micro-benchmark", add_help=False)

    parser.add_argument("-c", "--config", action="append", default=[], metavar="TOML",
                        help="deployment file; repeat to compare modes (run in order)")
    parser.add_argument("--workload", default="agentic", help="agentic | trace:PATH")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/bench", help="output folder")
    parser.add_argument("--quick", action="store_true",
                        help="small workload: four modes in a few minutes on a CPU")
    parser.add_argument("--preset", choices=tuple(agentic.PRESETS), default=None,
                        help="agentic workload preset (--quick = --preset quick; validate: "
                             "42 requests, steadier percentiles for pdd sim --validate)")
    parser.add_argument("--sla-ttft", type=float, default=DEFAULT_SLA_TTFT_S, metavar="S")
    parser.add_argument("--sla-tpot", type=float, default=DEFAULT_SLA_TPOT_S, metavar="S")
    parser.add_argument("--ablation", action="append", default=[], metavar="[BASE:]NAME",
                        help="no-drc | one-shot | catch-up | no-filter, on the pdd config")
    parser.add_argument("--baseline", default=None, help="mode to compare the others with")
    parser.add_argument("--wan-mbps", type=float, default=None, metavar="MBPS",
                        help="override every deployment's WAN line rate (sweeps)")
    g = parser.add_argument_group("workload shape")
    g.add_argument("--vocab-size", type=int, default=49152, help="token ids stay below this")
    g.add_argument("--block-size", type=int, default=16, help="for the theoretical hit rates")
    g.add_argument("--arrival-rate", type=float, default=None,
                   help="agentic: session starts/s; trace: Poisson requests/s instead of timestamps")
    g.add_argument("--open-loop", action="store_true",
                   help="agentic: send turns on a timetable instead of after the previous answer")
    g.add_argument("--turn-interval", type=float, default=None, metavar="S",
                   help="agentic: spacing of a session's turns (open loop: the timetable; "
                        "with --arrival-rate, sets the offered load)")
    g.add_argument("--time-scale", type=float, default=None, help="trace: stretch time by this")
    g.add_argument("--length-scale", type=float, default=None, help="trace: 512-token block -> 512 x this")
    g.add_argument("--max-input-tokens", type=int, default=None)
    g.add_argument("--max-output-tokens", type=int, default=None)
    g.add_argument("--start-index", type=int, default=0, help="trace: skip this many rows")
    c = parser.add_argument_group("client")
    c.add_argument("--max-concurrency", type=int, default=64)
    c.add_argument("--request-timeout", type=float, default=300.0, metavar="S")
    c.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="per mode (default: none, 600 with --quick)")
    c.add_argument("--warmup", type=int, default=1, help="unrelated requests before each mode")
    c.add_argument("--model", default=None, help="model name sent to the router")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--dry-run", action="store_true",
                        help="only build the workload and print its description")
    parser.add_argument("--fake", action="store_true",
                        help="self-test: a fake streaming server instead of each deployment")


def build_workload(args: argparse.Namespace):
    """The Workload that --workload, --quick and the shape options describe."""
    from pdd.bench import trace
    from pdd.bench.workload import validate_token_ids, with_poisson_arrivals

    if args.workload == "agentic":
        preset = getattr(args, "preset", None) or ("quick" if args.quick else "full")
        cfg = agentic.PRESETS[preset]
        cfg = replace(cfg, seed=args.seed, vocab_size=args.vocab_size,
                      closed_loop=cfg.closed_loop and not args.open_loop)
        if args.num_requests is not None:
            cfg = replace(cfg, num_requests=args.num_requests)
        if args.arrival_rate is not None:
            cfg = replace(cfg, session_rate_per_s=args.arrival_rate)
        if getattr(args, "turn_interval", None) is not None:
            if args.turn_interval <= 0:
                raise SystemExit("--turn-interval must be > 0")
            cfg = replace(cfg, turn_interval_s=args.turn_interval)
        wl = agentic.generate(cfg, block_size=args.block_size)
    elif args.workload.startswith("trace:"):
        # Quick: 16-token blocks, short outputs; else 32-token blocks, 10x slower time.
        quick = {"time_scale": 1.0, "length_scale": 1 / 32, "max_input_tokens": 1024,
                 "max_output_tokens": 32, "num_requests": 12}
        full = {"time_scale": 10.0, "length_scale": 1 / 16, "max_input_tokens": 2048,
                "max_output_tokens": 64, "num_requests": 200}
        kw = dict(quick if args.quick else full)
        for key in ("time_scale", "length_scale", "max_input_tokens", "max_output_tokens",
                    "num_requests"):
            if getattr(args, key) is not None:
                kw[key] = getattr(args, key)
        cfg = trace.TraceConfig(path=args.workload[len("trace:"):], start_index=args.start_index,
                                vocab_size=args.vocab_size, seed=args.seed, **kw)
        wl = trace.load(cfg, block_size=args.block_size)
        if args.arrival_rate is not None:
            wl = with_poisson_arrivals(wl, args.arrival_rate, args.seed)
    else:
        raise SystemExit(f"unknown --workload {args.workload!r} (agentic | trace:PATH)")
    validate_token_ids(wl.requests, args.vocab_size)
    return wl


def run(args: argparse.Namespace) -> int:
    delegate = getattr(args, "_bench_delegate", None)
    if delegate is not None:
        return int(delegate(args) or 0)

    from pdd.bench import report, runner
    from pdd.bench.metrics import Sla

    workload = build_workload(args)
    if args.dry_run:
        print(json.dumps(workload.describe(), indent=2))
        return 0
    if not args.config:
        print("pdd bench: give at least one deployment file (-c)", file=sys.stderr)
        return 2
    modes = runner.plan_modes(args.config, args.ablation, args.wan_mbps)
    factory = None
    if args.fake:
        from pdd.bench.fake_server import FakeBehaviour, FakeDeployment
        factory = FakeDeployment.factory(FakeBehaviour(token_delay_s=0.01, block_size=args.block_size))
    client = {"model": args.model, "max_concurrency": args.max_concurrency,
              "request_timeout_s": args.request_timeout,
              "total_timeout_s": args.time_limit or (600.0 if args.quick else None)}
    summary = runner.run_bench(modes, workload, Path(args.out), Sla(args.sla_ttft, args.sla_tpot),
                               client=client, factory=factory, baseline=args.baseline,
                               plots=not args.no_plots, warmup=args.warmup)
    print()
    report.print_table(summary)
    print(f"\nwrote {args.out}/summary.json, report.md, figures and <mode>/records.jsonl")
    failed = [m for m, s in summary["modes"].items() if "error" in s]
    return 1 if failed else 0
