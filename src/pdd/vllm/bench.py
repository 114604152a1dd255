"""Decode throughput of the vLLM backend through VllmEngine (what an instance
runs), at batch 1 / 8 / 16, one thread, median of 3: the figure to set beside
`pdd bench engine` (our engine) on the same machine.

    .venv-vllm/bin/python -m pdd.vllm.bench --out results/vllm-engine.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def decode_tok_s(engine, batch: int, prompt_len: int, num_tokens: int, tag: str) -> float:
    """Tokens per second over the steps after every request has its first token."""
    from pdd.engine.request import EngineRequest, SamplingParams

    rng = random.Random(batch)
    rids = [f"{tag}-{k}" for k in range(batch)]
    for rid in rids:
        prompt = [rng.randrange(100, 40000) for _ in range(prompt_len)]
        engine.submit(EngineRequest(rid, prompt, SamplingParams(max_tokens=num_tokens, ignore_eos=True)))
    started: set[str] = set()
    t0, counted = None, 0
    while engine.has_work:
        events = engine.step()
        if t0 is not None:
            counted += sum(1 for e in events if e.token_id is not None)
        started |= {e.request_id for e in events if e.token_id is not None}
        if t0 is None and len(started) == batch:
            t0 = time.perf_counter()
    wall = time.perf_counter() - t0
    for rid in rids:
        engine.forget(rid)
    return counted / wall


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from pdd.engine.config import EngineConfig
    from pdd.model.loader import default_cache_dir, read_model_config, resolve_model_path
    from pdd.vllm.engine import VllmEngine

    model_dir = resolve_model_path("default", default_cache_dir())
    cfg = EngineConfig(block_size=32, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=2048,
                       dtype=args.dtype, num_threads=1)
    t0 = time.perf_counter()
    engine = VllmEngine.build(model_dir, cfg, read_model_config(model_dir))
    result = {"backend": "vllm", "dtype": args.dtype, "threads": 1, "build_s": time.perf_counter() - t0,
              "decode_tok_s": {}}
    for b in (int(x) for x in args.batches.split(",")):
        runs = [decode_tok_s(engine, b, 128, 64, f"b{b}r{k}") for k in range(args.repeats)]
        result["decode_tok_s"][str(b)] = {"median": statistics.median(runs), "runs": runs}
        print(f"batch {b}: {statistics.median(runs):.1f} tok/s (runs {', '.join(f'{r:.1f}' for r in runs)})",
              flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
