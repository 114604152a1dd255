"""`pdd wan`: run the WAN emulator relay (and its control API) on its own.

    pdd wan --listen 7001:127.0.0.1:8001 [--listen ...] [--listen-back ...]
            --rate-mbps 400 --latency-ms 20 --jitter-ms 5
            --control-port 7100 --secret-file deploy.secret [--name wan0]

Prints one JSON line `{"event": "ready", ...}` (bound ports) on stdout once
listening, then runs until SIGTERM/SIGINT and shuts down cleanly.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdd.wan.shaper import DEFAULT_BURST_BYTES, DEFAULT_JITTER_S, DEFAULT_LATENCY_S, DEFAULT_RATE_MBPS, MBIT_BYTES_S


def parse_listen(spec: str) -> tuple[int, str, int]:
    """"LISTEN_PORT:TARGET_HOST:TARGET_PORT" (the host may be an IPv6 literal)."""
    parts = spec.split(":")
    if len(parts) < 3:
        raise argparse.ArgumentTypeError(f"expected PORT:HOST:PORT, got {spec!r}")
    try:
        return int(parts[0]), ":".join(parts[1:-1]).strip("[]"), int(parts[-1])
    except ValueError:
        raise argparse.ArgumentTypeError(f"ports must be integers in {spec!r}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", action="append", type=parse_listen, default=[], metavar="PORT:HOST:PORT",
                        help="relay clients in datacenter A to a server in B (repeatable)")
    parser.add_argument("--listen-control", action="append", type=parse_listen, default=[],
                        metavar="PORT:HOST:PORT",
                        help="as --listen, in the priority class: its bytes go ahead of bulk bytes queued on "
                             "the line (HTTP control calls and token streams beside KV copies)")
    parser.add_argument("--listen-back", action="append", type=parse_listen, default=[], metavar="PORT:HOST:PORT",
                        help="relay clients in B to a server in A (uses the B->A direction)")
    parser.add_argument("--host", default="127.0.0.1", help="address the relay and control API bind to")
    parser.add_argument("--rate-mbps", type=float, default=DEFAULT_RATE_MBPS, help="per direction; 0: unlimited")
    parser.add_argument("--latency-ms", type=float, default=DEFAULT_LATENCY_S * 1e3, help="one-way latency")
    parser.add_argument("--jitter-ms", type=float, default=DEFAULT_JITTER_S * 1e3, help="uniform +- jitter")
    parser.add_argument("--burst-kb", type=float, default=DEFAULT_BURST_BYTES / 1024, help="token bucket depth")
    parser.add_argument("--seed", type=int, default=0, help="jitter RNG seed")
    parser.add_argument("--control-port", type=int, default=None, help="HTTP control API port (0: any)")
    parser.add_argument("--secret-file", default=None,
                        help="file holding the deployment secret; the control API uses the key derived from it")
    parser.add_argument("--name", default=None, help="this relay's name, which control calls are signed for "
                                                     "(default: wan)")


def run(args: argparse.Namespace) -> int:
    import asyncio

    if not args.listen and not args.listen_back and not args.listen_control:
        print("pdd wan: give at least one --listen, --listen-control or --listen-back", file=sys.stderr)
        return 2
    key = None
    if args.control_port is not None:
        if not args.secret_file:
            print("pdd wan: --control-port needs --secret-file", file=sys.stderr)
            return 2
        from pdd.keys import Purpose, derive_key
        from pdd.server.http_auth import read_secret

        key = derive_key(read_secret(args.secret_file), Purpose.WAN_CONTROL)   # the master is not kept
    return asyncio.run(_serve(args, key))


async def _serve(args: argparse.Namespace, key: bytes | None) -> int:
    import asyncio
    import signal

    from pdd.wan.relay import WanLink

    link = WanLink(rate_bytes_s=args.rate_mbps * MBIT_BYTES_S, latency_s=args.latency_ms / 1e3,
                   jitter_s=args.jitter_ms / 1e3, burst_bytes=int(args.burst_kb * 1024), seed=args.seed)
    control = None
    try:
        for (port, host, target_port), reverse, control in [(m, False, False) for m in args.listen] + \
                                                           [(m, False, True) for m in args.listen_control] + \
                                                           [(m, True, False) for m in args.listen_back]:
            await link.add_mapping(port, host, target_port, listen_host=args.host, reverse=reverse, control=control)
        if key is not None:
            from pdd.wan.control import DEFAULT_NAME, ControlServer

            control = ControlServer(link, key, args.name or DEFAULT_NAME)
            await control.start(args.host, args.control_port)
        print(json.dumps({"event": "ready", "mappings": link.stats_dict()["mappings"],
                          "control_port": control.port if control else None}), flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        if control is not None:
            await control.close()
        await link.close()
    print(json.dumps({"event": "stopped", **{k: v for k, v in link.stats_dict().items() if k.startswith(("bytes", "num"))}}),
          flush=True)
    return 0
