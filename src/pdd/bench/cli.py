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
from pathlib import Path

from pdd.measure import agentic
from pdd.measure.flags import add_workload_arguments, build_workload, sla_from_args

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
    parser.add_argument("--out", default="results/bench", help="output folder")
    add_workload_arguments(parser, quick_help="small workload: four modes in a few minutes on a CPU")
    parser.add_argument("--ablation", action="append", default=[], metavar="[BASE:]NAME",
                        help="no-drc | one-shot | catch-up | no-filter, on the pdd config")
    parser.add_argument("--baseline", default=None, help="mode to compare the others with")
    parser.add_argument("--wan-mbps", type=float, default=None, metavar="MBPS",
                        help="override every deployment's WAN line rate (sweeps)")
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


def size_for_cpu(args: argparse.Namespace, flags: frozenset[str]) -> None:
    """`--preset wan-bound` as sized for this host's CPU (`agentic.CPU_SIZINGS`),
    unless the run sets its own line or scale; says so on stderr."""
    if args.workload != "agentic" or args.wan_mbps is not None or getattr(args, "length_scale", None) is not None:
        return
    sized = agentic.sized_for_cpu(getattr(args, "preset", None), flags)
    if sized is None:
        return
    args.preset, args.wan_mbps, flag = sized
    print(f"pdd bench: --preset wan-bound on this CPU ({flag}) is the regime as sized for it: --preset "
          f"{args.preset} --wan-mbps {args.wan_mbps:g} (README, 'The WAN-bound regime'; "
          f"--preset wan-bound-epyc keeps the AMD EPYC's sizing)", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    delegate = getattr(args, "_bench_delegate", None)
    if delegate is not None:
        return int(delegate(args) or 0)

    from pdd.bench import runner
    from pdd.measure import report

    size_for_cpu(args, agentic.cpu_flags())
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
    summary = runner.run_bench(modes, workload, Path(args.out), sla_from_args(args),
                               client=client, factory=factory, baseline=args.baseline,
                               plots=not args.no_plots, warmup=args.warmup)
    print()
    report.print_table(summary)
    print(f"\nwrote {args.out}/summary.json, report.md, figures and <mode>/records.jsonl")
    failed = [m for m, s in summary["modes"].items() if "error" in s]
    return 1 if failed else 0
