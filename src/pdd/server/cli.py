"""`pdd serve`: run one instance (or the router) of a deployment file.

`pdd up` starts one of these per instance; on a multi-host deployment run
`pdd serve -c deploy.toml --name NAME --secret-file F` on each host.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import time
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-c", "--config", required=True, help="deployment TOML")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--name", help="instance name to run")
    g.add_argument("--router", action="store_true", help="run the router")
    p.add_argument("--secret-file", required=True, help="file holding the deployment's shared secret")
    p.add_argument("--tls-dir", default=None,
                   help="certificate directory (ca.crt, NAME.crt, NAME.key; default: the file's [tls] dir)")
    p.add_argument("--cache", default=None, help="model cache dir (default $PDD_CACHE or ~/.cache/pdd)")
    p.add_argument("--override", default=None, help="JSON overrides of the deployment file (used by pdd bench)")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help="router only: a client API key (repeat or comma-separate for several; also $PDD_API_KEY "
                        "and the deployment's [router] api_keys_file / api_key_env). None: the API is open")
    p.add_argument("--log-level", default="WARNING")


def run(args: argparse.Namespace) -> int:
    import json

    from pdd.deploy.spec import load_spec
    from pdd.model.loader import default_cache_dir, resolve_model_path
    from pdd.server.http_auth import read_secret

    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    spec = load_spec(args.config, json.loads(args.override) if args.override else None)
    secret = read_secret(args.secret_file)
    cache = Path(args.cache) if args.cache else default_cache_dir()
    model_dir = resolve_model_path(spec.model, cache)
    tls_dir = Path(args.tls_dir) if args.tls_dir else spec.tls.dir
    if args.router:
        from pdd.server.api_keys import collect_api_keys

        keys = collect_api_keys(spec, args.api_key, os.environ)   # the one place keys are read
        return asyncio.run(_serve_router(spec, secret, model_dir, keys, tls_dir))
    return asyncio.run(_serve_instance(spec, spec.instance(args.name), secret, model_dir, tls_dir))


async def _wait_for_signal() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def lower_priority(nice: int, autogroup: Path = Path("/proc/self/autogroup")) -> bool:
    """Run this process at `nice` (before it starts any thread: threads take
    their creator's). Where the kernel groups scheduling by session
    (autogroup, /proc/sys/kernel/sched_autogroup_enabled = 1, Linux's default
    in many distributions) it first splits a core between sessions, by each
    session's own nice, and applies a thread's nice only inside its session;
    every instance is a session of its own (the launcher starts it so), so
    its session's nice must say the same, or a niced RLD still takes half of
    P's core: measured, RLD at nice 5 beside P's prompt chunks ran 0.06 s of
    CPU in each 0.12 s step, P's chunk 0.41 s of CPU in 0.97 s
    (`results/heldout-agentic-28s1`). True where the session's nice was set.
    Without CAP_SYS_ADMIN the kernel takes one such change per 0.1 s on the
    whole machine (EAGAIN otherwise): instances starting together retry."""
    os.nice(nice)
    for _ in range(20):
        try:
            autogroup.write_text(str(nice))
            return True
        except OSError as e:    # no autogroup here (the process nice alone decides), or not allowed
            if e.errno != errno.EAGAIN:
                return False
            time.sleep(0.11)
    return False


async def _serve_instance(spec, inst, secret: bytes, model_dir: Path, tls_dir: Path | None) -> int:
    from pdd.deploy.spec import Backend

    if inst.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {inst.cpu % os.cpu_count()})
    if inst.nice > 0 and hasattr(os, "nice"):
        lower_priority(inst.nice)
    if inst.backend == Backend.VLLM:
        from pdd.vllm.instance import VllmInstanceServer, build_engine

        t0 = time.monotonic()
        engine = build_engine(inst, model_dir)   # vLLM is imported only here
        server = VllmInstanceServer(spec, inst, secret, engine, tls_dir)
        return await _run_instance(server, spec, inst, f" (vllm, built in {time.monotonic() - t0:.1f} s)")
    import torch

    from pdd.engine.engine import Engine
    from pdd.engine.runner import DTYPES
    from pdd.model.loader import load_model
    from pdd.model.tokenizer import Tokenizer
    from pdd.server.instance import InstanceServer

    torch.set_num_threads(inst.engine.num_threads)
    model, cfg = load_model(model_dir, DTYPES[inst.engine.dtype])
    try:
        tok = Tokenizer(model_dir)
    except Exception:   # a token-id-only model (tiny test model) still serves ids
        tok = None
    engine = Engine(model, cfg, inst.engine, tokenizer=tok)
    if inst.role.decodes:
        engine.reserve_decode_rows()
    pages = engine.runner.huge_pages
    notes = ([pages.line()] if pages is not None else []) + (
        [f"decode attention: {engine.runner.decode_kernel}"] if inst.engine.dtype != "float32" else [])
    note = f" ({'; '.join(notes)})" if notes else ""
    return await _run_instance(InstanceServer(spec, inst, secret, engine, tls_dir), spec, inst, note)


async def _run_instance(server, spec, inst, note: str = "") -> int:
    from pdd.transport.tls import http_tls

    runner = await server.start()
    scheme = "https" if http_tls(spec, inst) else "http"
    print(f"{inst.name} ({inst.role.value}) ready on {scheme}://{inst.host}:{inst.port}{note}", flush=True)
    try:
        await _wait_for_signal()
    finally:
        await server.close()
        await runner.cleanup()
    return 0


async def _serve_router(spec, secret: bytes, model_dir: Path, api_keys: frozenset[str],
                        tls_dir: Path | None) -> int:
    from aiohttp import web

    from pdd.model.loader import read_model_config
    from pdd.model.tokenizer import Tokenizer
    from pdd.deploy.spec import ROUTER_CERT_NAME
    from pdd.server.api_keys import ApiKeys
    from pdd.server.router import RouterServer
    from pdd.transport.tls import TlsError, TlsFiles, router_peers, uses_tls

    peers = {}
    if uses_tls(spec):
        if tls_dir is None:
            raise TlsError(f"TLS is on (tls.mode = {spec.tls.mode.value}): pass --tls-dir or set [tls] dir")
        peers = router_peers(spec, TlsFiles(tls_dir, ROUTER_CERT_NAME))
    router = RouterServer(spec, secret, Tokenizer(model_dir), read_model_config(model_dir), model_dir.name,
                          ApiKeys(api_keys), internal_tls=peers)
    runner = web.AppRunner(router.app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, spec.router_host, spec.router_port).start()
    print(f"router: http://{spec.router_host}:{spec.router_port}/v1", flush=True)
    try:
        await _wait_for_signal()
    finally:
        await runner.cleanup()
    return 0
