"""The workload and SLA flags of `pdd bench`, `pdd sim`, `pdd sim sweep` and
`pdd plan`: one set of names and defaults, so that the simulator runs on the
very workload (same seed, same token ids) that `pdd bench` would send.

    add_workload_arguments(parser)   # --workload, --quick, --preset, --seed, shape, --sla-*
    build_workload(args)             # -> Workload
    sla_from_args(args)              # -> Sla (the defaults where no flag was given)

--sla-ttft / --sla-tpot default to None, so a caller can tell "not given"
(`pdd plan` keeps a scenario's own SLA then) from a value.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from pdd.measure import agentic
from pdd.measure.metrics import DEFAULT_SLA_TPOT_S, DEFAULT_SLA_TTFT_S, Sla
from pdd.measure.workload import Workload, validate_token_ids, with_poisson_arrivals


def add_workload_arguments(p: argparse.ArgumentParser,
                           quick_help: str = "the quick workload (fewer, shorter requests)") -> None:
    w = p.add_argument_group("workload (as `pdd bench` sends it)")
    w.add_argument("--workload", default="agentic", help="agentic | trace:PATH")
    w.add_argument("--quick", action="store_true", help=quick_help)
    w.add_argument("--preset", choices=tuple(agentic.PRESETS), default=None,
                   help="agentic workload preset (--quick = --preset quick; validate: "
                        "42 requests, steadier percentiles for pdd sim --validate)")
    w.add_argument("--num-requests", type=int, default=None)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--sla-ttft", type=float, default=None, metavar="S",
                   help=f"TTFT bound of the SLA (default {DEFAULT_SLA_TTFT_S})")
    w.add_argument("--sla-tpot", type=float, default=None, metavar="S",
                   help=f"TPOT bound of the SLA (default {DEFAULT_SLA_TPOT_S})")
    g = p.add_argument_group("workload shape")
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
    g.add_argument("--length-scale", type=float, default=None,
                   help="trace: 512-token block -> 512 x this; agentic: every token count of the "
                        "preset x this (AgenticConfig.scaled: an engine this many times as fast per token)")
    g.add_argument("--max-input-tokens", type=int, default=None)
    g.add_argument("--max-output-tokens", type=int, default=None)
    g.add_argument("--start-index", type=int, default=0, help="trace: skip this many rows")


def sla_from_args(args: argparse.Namespace) -> Sla:
    return Sla(DEFAULT_SLA_TTFT_S if args.sla_ttft is None else args.sla_ttft,
               DEFAULT_SLA_TPOT_S if args.sla_tpot is None else args.sla_tpot)


def build_workload(args: argparse.Namespace) -> Workload:
    """The Workload that --workload, --quick and the shape options describe."""
    from pdd.measure import trace

    if args.workload == "agentic":
        preset = getattr(args, "preset", None) or ("quick" if args.quick else "full")
        cfg = agentic.PRESETS[preset]
        cfg = replace(cfg, seed=args.seed, vocab_size=args.vocab_size,
                      closed_loop=cfg.closed_loop and not args.open_loop)
        if args.num_requests is not None:
            cfg = replace(cfg, num_requests=args.num_requests)
        if args.arrival_rate is not None:
            cfg = replace(cfg, session_rate_per_s=args.arrival_rate)
        if getattr(args, "length_scale", None) is not None:
            if not args.length_scale > 0:
                raise SystemExit("--length-scale must be > 0")
            cfg = cfg.scaled(args.length_scale)
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
