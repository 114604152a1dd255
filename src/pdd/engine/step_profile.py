"""Where a decode step's time goes: `python -m pdd.engine.step_profile`.

    python -m pdd.engine.step_profile [--dtypes float32,bfloat16] [--batches 1,8,16]
                                 [--prompt 128] [--steps 24] [--threads 1] [--prefill 2048]

For each dtype and batch: an Engine with `batch` requests of `prompt` random
tokens is prefilled in one step, then `steps` decode steps run under
torch.profiler. Every aten op's self CPU time is put in one bucket by name
(weight matmuls, attention, KV cache writes and gathers, sampling, dtype
conversions, other tensor ops); "python" is the step's wall time minus all
op time (interpreter work in the engine, scheduler, metadata and model code,
plus the profiler's own per-op cost, so it reads high). On a shared machine
wall time includes waiting for a core, so a step's time is its process CPU
time over unprofiled steps (one thread), and the buckets are the profiled
shares of that time. Compare only within one run. `--prefill N` adds one
step that prefills N tokens (a row "prefill N"), split the same way.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

# aten op name -> bucket; first match on a prefix wins
BUCKETS = [
    ("matmul", ("mkldnn::_linear", "aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::mkldnn", "aten::_mkl")),
    ("attention", ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::bmm", "aten::baddbmm",
                   "aten::_softmax", "aten::softmax", "aten::_safe_softmax")),
    ("kv write/gather", ("aten::index_copy", "aten::index_select", "aten::index")),
    ("sampling", ("aten::argmax", "aten::max", "aten::log_softmax", "aten::multinomial")),
    ("dtype conversion", ("aten::_to_copy", "aten::to", "aten::copy_")),
]
ORDER = ["matmul", "attention", "kv write/gather", "sampling", "dtype conversion", "other ops", "python"]


def bucket(name: str) -> str:
    for b, prefixes in BUCKETS:
        if name.startswith(prefixes):
            return b
    return "other ops"


def profile_decode(model, mcfg, dtype: str, batch: int, prompt: int, steps: int, seed: int = 0) -> dict:
    """ms per decode step by bucket (shares of the unprofiled step's CPU time), and that time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pdd.engine.config import EngineConfig
    from pdd.engine.engine import Engine
    from pdd.engine.request import EngineRequest, SamplingParams

    rng = random.Random(seed)
    bs = 16
    cfg = EngineConfig(block_size=bs, num_blocks=batch * (-(-(prompt + 3 * steps + 8) // bs)) + 8,
                       max_num_seqs=max(32, batch), max_num_batched_tokens=max(2048, batch * prompt),
                       dtype=dtype)
    eng = Engine(model, mcfg, cfg)
    for i in range(batch):
        ids = [rng.randrange(100, mcfg.vocab_size) for _ in range(prompt)]
        eng.submit(EngineRequest(f"p{i}", ids, SamplingParams(max_tokens=3 * steps + 4, ignore_eos=True)))
    eng.step()                                   # prefill
    for _ in range(4):                           # warm-up
        eng.step()
    c0 = time.process_time()
    for _ in range(steps):                       # unprofiled reference
        eng.step()
    plain_ms = (time.process_time() - c0) / steps * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        wall_ms = (time.perf_counter() - t0) / steps * 1e3
    out = {b: 0.0 for b in ORDER}
    for ev in prof.key_averages():
        out[bucket(ev.key)] += ev.self_cpu_time_total / 1e3 / steps
    out["python"] = max(0.0, wall_ms - sum(out.values()))
    scale = plain_ms / max(sum(out.values()), 1e-9)
    out = {k: v * scale for k, v in out.items()}
    return {"buckets_ms": out, "profiled_ms": wall_ms, "step_ms": plain_ms, "tok_s": batch / plain_ms * 1e3}


def profile_prefill(model, mcfg, dtype: str, prompt: int, repeats: int = 3, seed: int = 0) -> dict:
    """ms of one step that prefills `prompt` random tokens, by bucket (as profile_decode):
    the median unprofiled step's CPU time, split by one profiled step's shares."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pdd.engine.config import EngineConfig
    from pdd.engine.engine import Engine
    from pdd.engine.request import EngineRequest, SamplingParams

    rng = random.Random(seed)
    cfg = EngineConfig(block_size=16, num_blocks=-(-prompt // 16) + 8, max_num_batched_tokens=max(2048, prompt),
                       dtype=dtype, enable_prefix_cache=False)

    def step(i: int) -> float:
        eng = Engine(model, mcfg, cfg)
        ids = [rng.randrange(100, mcfg.vocab_size) for _ in range(prompt)]
        eng.submit(EngineRequest(f"p{i}", ids, SamplingParams(max_tokens=1, ignore_eos=True)))
        c0 = time.process_time()
        eng.step()
        return time.process_time() - c0

    step(0)                                      # warm-up
    plain_ms = sorted(step(i + 1) for i in range(repeats))[repeats // 2] * 1e3
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step(repeats + 1)
        wall_ms = (time.perf_counter() - t0) * 1e3
    out = {b: 0.0 for b in ORDER}
    for ev in prof.key_averages():
        out[bucket(ev.key)] += ev.self_cpu_time_total / 1e3
    out["python"] = max(0.0, wall_ms - sum(out.values()))
    scale = plain_ms / max(sum(out.values()), 1e-9)
    out = {k: v * scale for k, v in out.items()}
    return {"buckets_ms": out, "profiled_ms": wall_ms, "step_ms": plain_ms, "tok_s": prompt / plain_ms * 1e3}


def format_rows(rows: list[tuple[str, int, dict]]) -> str:
    head = "| dtype | batch (prefill: tokens) | step ms (tok/s) | " + " | ".join(ORDER) + " |"
    lines = [head, "|" + "---|" * (3 + len(ORDER))]
    for dtype, batch, r in rows:
        b = r["buckets_ms"]
        cells = " | ".join(f"{b[k]:.1f}" for k in ORDER)
        what = f"prefill {-batch}" if batch < 0 else str(batch)
        lines.append(f"| {dtype} | {what} | {r['step_ms']:.1f} ({r['tok_s']:.0f}) | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdd.engine.step_profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batches", default="1,8,16")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                   help="also profile one step that prefills this many tokens (0: none)")
    p.add_argument("--model", default="default")
    a = p.parse_args(argv)
    import torch

    from pdd.engine.runner import DTYPES
    from pdd.model.loader import default_cache_dir, load_model, resolve_model_path

    torch.set_num_threads(a.threads)
    folder = resolve_model_path(a.model, default_cache_dir())
    rows = []
    for dtype in a.dtypes.split(","):
        model, mcfg = load_model(folder, DTYPES[dtype])
        for batch in (int(x) for x in a.batches.split(",") if x):
            print(f"{dtype} batch {batch} ...", file=sys.stderr, flush=True)
            rows.append((dtype, batch, profile_decode(model, mcfg, dtype, batch, a.prompt, a.steps)))
        if a.prefill:
            print(f"{dtype} prefill {a.prefill} ...", file=sys.stderr, flush=True)
            rows.append((dtype, -a.prefill, profile_prefill(model, mcfg, dtype, a.prefill)))
    print(format_rows(rows))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
