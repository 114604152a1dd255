"""`pdd model prepare [--cache DIR]` and `pdd model info [--model SPEC] [--cache DIR]`."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", metavar="ACTION")
    p = sub.add_parser("prepare", help="convert the embedded SmolLM2 GGUF into the safetensors cache (once)")
    p.add_argument("--cache", default=None, help="cache directory (default: $PDD_CACHE or ~/.cache/pdd)")
    i = sub.add_parser("info", help="print a model's config, model_id and KV size")
    i.add_argument("--model", default="default", help="'default'/'smollm2' or a local HF folder")
    i.add_argument("--cache", default=None, help="cache directory (default: $PDD_CACHE or ~/.cache/pdd)")


def run(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from .loader import ModelNotFoundError, default_cache_dir, read_model_config, resolve_model_path

    cmd = getattr(args, "model_command", None)
    if cmd is None:
        print("usage: pdd model {prepare,info} ...", file=sys.stderr)
        return 2
    cache = Path(args.cache).expanduser() if getattr(args, "cache", None) else default_cache_dir()
    try:
        if cmd == "prepare":
            t0 = time.perf_counter()
            path = resolve_model_path("default", cache)
            print(path)
            print(f"ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
            return 0
        if cmd == "info":
            path = resolve_model_path(args.model, cache)
            cfg = read_model_config(path)
            info = {
                "path": str(path),
                **{k: v for k, v in vars(cfg).items()},
                "kv_bytes_per_token_fp32": cfg.kv_bytes_per_token(4),
                "kv_bytes_per_token_bf16": cfg.kv_bytes_per_token(2),
            }
            info["rope_scaling"] = dict(cfg.rope_scaling)
            info["eos_token_ids"] = list(cfg.eos_token_ids)
            print(json.dumps(info, indent=2))
            return 0
    except ModelNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"unknown model action {cmd!r}", file=sys.stderr)
    return 2
