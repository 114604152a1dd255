"""`pdd bench engine`: our engine against plain HF transformers `generate`, on one CPU.

    pdd bench engine --out results/engine.json [--model PATH] [--threads 1] [--repeats 3] [--quick]
                     [--dtypes float32,bfloat16] [--vs-vllm [--vllm-python P]] [--baseline-src DIR]

Everything is measured in one process, on the same weights (fp32), with the
same thread count, and repeats are interleaved (ours, then HF, then ours ...)
so that a noisy neighbour on a shared machine hurts both sides alike.

* prefill tok/s at 512 and 2048 prompt tokens: ours = one Engine.step() of a
  single request (max_tokens=1) on a fresh engine, with a token budget large
  enough that the whole prompt is one pass; HF = one forward of the prompt
  (use_cache=True, logits_to_keep=1, as `generate` does).
* decode tok/s at batch 1, 8, 16: N requests with equal-length random prompts
  each generate `decode_tokens + 1` tokens with ignore_eos. The first token
  comes out of the prefill; only the following steps are timed, from the first
  token to the last, so tok/s = N * decode_tokens / that time. HF: `generate`
  over the same N prompts as one batch (equal lengths, so no padding; an
  all-ones attention mask), do_sample=False, min_new_tokens=max_new_tokens,
  timed with a streamer that stamps every new token: the same window, from
  the first token to the last. Both the default DynamicCache and
  cache_implementation="static" are run; the faster is HF's best.
* prefix hit: a prompt whose first ~90% (whole blocks) is already in our
  prefix cache (a request with just that prefix ran first) vs the same prompt
  on a fresh engine.
* long-context decode (`--long-ctx`, default 2048 tokens, at the decode
  batches): one decode step's forward (30 layers, cache writes, attention;
  no sampling) over a KV cache filled with random values, every sequence's
  blocks scattered at random over the cache as in a long-running pool. The
  two attention paths are timed alternately in one process: per sequence
  (what the engine picks at these sizes) and the batched padded SDPA (the
  path used for short contexts, and before for every decode); attention's
  share of the step is timed around the per-layer callback. Two block
  layouts: "pool" (as a fresh engine's pool lays out prompts that then
  decoded 64 tokens) and "scattered" (a random permutation: the worst case).
* other engines side by side (prefill and decode only): `--dtypes` adds
  ours in bf16 ("ours_bf16"); `--vs-vllm` vLLM in each dtype ("vllm",
  "vllm_bf16": an in-process V1 LLMEngine, eager, prefix caching on, block
  size `--vllm-block-size`, one thread) and `--baseline-src DIR` our engine
  from another checkout ("base", "base_bf16": before/after), each in a
  worker process (`bench_worker.py`) started once; every repeat times each
  engine in turn on the same prompts and token counts.
* every number is wall-clock (the headline); process CPU time is recorded
  beside it (cpu_*) as a cross-check on a shared machine: with one thread it
  leaves out the time the process waited for a core.

Writes a JSON file (medians, raw samples, settings, versions, method) whose
top-level keys include `decode_speedup_b16` and `prefix_hit_speedup`, and
prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

from pdd.engine.bench_sides import HF, SHORT, Ours, Worker, _log, _median, _summ, start_workers

TARGET_DECODE_SPEEDUP_B16 = 3.0
TARGET_PREFIX_HIT_SPEEDUP = 5.0

FULL = {"prefill_lens": [512, 2048], "decode_batches": [1, 8, 16], "decode_prompt": 128,
        "decode_tokens": 64, "prefix_prompt": 2048, "prefix_frac": 0.9, "long_ctx": 2048}
QUICK = {"prefill_lens": [64, 256], "decode_batches": [1, 16], "decode_prompt": 16,
         "decode_tokens": 8, "prefix_prompt": 256, "prefix_frac": 0.9, "long_ctx": 300}

METHOD = __doc__.split("\n\n", 2)[2].rsplit("\n\nWrites", 1)[0].strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "engine micro-benchmark: our engine vs HF transformers generate"
    parser.add_argument("--out", default="results/engine.json", help="JSON file to write")
    parser.add_argument("--model", default="default",
                        help="'default' (embedded SmolLM2-135M) or a local HF folder")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per measurement; the median is reported")
    parser.add_argument("--quick", action="store_true", help="small sizes (for tests)")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip the HF baseline")
    parser.add_argument("--prefill-lens", type=_int_list, default=None, metavar="N,N")
    parser.add_argument("--decode-batches", type=_int_list, default=None, metavar="N,N")
    parser.add_argument("--decode-prompt", type=int, default=None, metavar="TOKENS")
    parser.add_argument("--decode-tokens", type=int, default=None, metavar="TOKENS",
                        help="timed decode steps per request (one more token comes from prefill)")
    parser.add_argument("--prefix-prompt", type=int, default=None, metavar="TOKENS")
    parser.add_argument("--long-ctx", type=int, default=None, metavar="TOKENS",
                        help="context per sequence of the long-context decode steps (0: skip)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtypes", default="float32", metavar="D,D",
                        help="our engine in these dtypes (float32 always; e.g. float32,bfloat16)")
    parser.add_argument("--vs-vllm", action="store_true",
                        help="also time vLLM in each of --dtypes, in a worker process (--vllm-python)")
    parser.add_argument("--vllm-python", default=".venv-vllm/bin/python", help="interpreter of a venv with vLLM")
    parser.add_argument("--vllm-dtypes", default=None, metavar="D,D",
                        help="vLLM only in these dtypes (default: --dtypes); each is a ~2.5 GB process")
    parser.add_argument("--vllm-block-size", type=int, default=128)
    parser.add_argument("--baseline-src", default=None, metavar="DIR",
                        help="also time our engine from another checkout (DIR/src), in a worker: before/after")
    parser.add_argument("--ours-in-worker", action="store_true",
                        help="time our engine's prefill and decode in worker processes too (this checkout), "
                             "like every other engine, instead of in the bench's own process")
    parser.add_argument("--worker-timeout", type=float, default=900.0, metavar="S",
                        help="longest wait for a worker's start or answer")


def _int_list(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x.strip()]


# ---------------------------------------------------------------------- helpers
def _prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[list[int]]:
    lo = min(100, vocab // 4)
    return [[rng.randrange(lo, vocab) for _ in range(length)] for _ in range(n)]


# ---------------------------------------------------------------------- long-context decode
class _TimedAttention:
    """Wraps a PagedAttention and adds up the wall time spent in it (all layers)."""

    def __init__(self, inner):
        self.inner, self.s = inner, 0.0

    def __call__(self, layer, q, k, v):
        t0 = time.perf_counter()
        out = self.inner(layer, q, k, v)
        self.s += time.perf_counter() - t0
        return out


LONG_DECODE_GROWN = 64   # tokens each sequence decoded before the timed step ("pool" layout)


def _block_tables(layout: str, batch: int, nblk: int, bs: int, g) -> list[list[int]]:
    """Each sequence's block ids. "scattered": a random permutation of the cache, no
    two neighbours adjacent by design (the worst case: everything is gathered).
    "pool": what our BlockPool hands out on a fresh engine: every prompt's blocks in
    one allocate() call, then the blocks of the last LONG_DECODE_GROWN decoded
    tokens one at a time, round robin over the batch as decode steps grow them."""
    import torch

    from pdd.engine.block_pool import BlockPool

    if layout == "scattered":
        perm = torch.randperm(batch * nblk, generator=g).tolist()
        return [perm[i * nblk:(i + 1) * nblk] for i in range(batch)]
    pool = BlockPool(batch * nblk, bs)
    grown = min(nblk - 1, LONG_DECODE_GROWN // bs)
    tables = [pool.allocate(nblk - grown) for _ in range(batch)]
    for _ in range(grown):
        for t in tables:
            t.extend(pool.allocate(1))
    return tables


def long_decode(model, mcfg, batch: int, ctx: int, block_size: int, repeats: int, seed: int,
                layout: str = "scattered") -> dict:
    """Times one decode step (the forward of `batch` tokens at `ctx` context each) on both
    attention paths, alternated; {path: {"step": _summ, "attention": _summ}}."""
    import torch

    from pdd.engine.paged_attention import PagedAttention, build_metadata

    bs = block_size
    nblk = -(-(ctx + 1) // bs)
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(mcfg.num_layers, 2, batch * nblk * bs, mcfg.num_kv_heads, mcfg.head_dim,
                     generator=g)   # [L, 2, S, KVH, D]
    seqs = [(ctx, 1, t) for t in _block_tables(layout, batch, nblk, bs, g)]
    ids = torch.randint(100, mcfg.vocab_size, (batch,), generator=g)
    pos = torch.full((batch,), ctx, dtype=torch.long)
    paths = {"per_seq": 0, "batched": 1 << 62}   # decode_each_min_tokens for each path
    samples = {p: ([], [], []) for p in paths}     # step wall s, step CPU s, attention wall s
    with torch.inference_mode():
        for r in range(repeats + 1):                 # the first round warms up
            for p, min_tokens in paths.items():
                att = _TimedAttention(PagedAttention(kv, build_metadata(seqs, bs, min_tokens)))
                c0, t0 = time.process_time(), time.perf_counter()
                model.forward(ids, pos, att)
                if r:
                    samples[p][0].append(time.perf_counter() - t0)
                    samples[p][1].append(time.process_time() - c0)
                    samples[p][2].append(att.s)
    out = {p: {"step": _summ(st, batch, cpu), "attention": _summ(at)} for p, (st, cpu, at) in samples.items()}
    out["speedup"] = out["batched"]["step"]["median_s"] / out["per_seq"]["step"]["median_s"]
    out["cpu_speedup"] = out["batched"]["step"]["cpu_median_s"] / out["per_seq"]["step"]["cpu_median_s"]
    return out


# ---------------------------------------------------------------------- the run
def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch

    from pdd.model.loader import default_cache_dir, load_model, resolve_model_path

    sizes = dict(QUICK if args.quick else FULL)
    for k in ("prefill_lens", "decode_batches", "decode_prompt", "decode_tokens", "prefix_prompt", "long_ctx"):
        v = getattr(args, k, None)
        if v is not None:
            sizes[k] = v
    if args.threads < 1 or args.repeats < 1:
        print("--threads and --repeats must be >= 1", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    folder = resolve_model_path(args.model, default_cache_dir())
    model, mcfg = load_model(folder, torch.float32)
    bs = args.block_size
    batches, dprompt, dtok = sizes["decode_batches"], sizes["decode_prompt"], sizes["decode_tokens"]
    plen = sizes["prefix_prompt"]
    longest = max([*sizes["prefill_lens"], plen, dprompt + dtok + 2])
    if longest >= mcfg.max_position_embeddings:
        print(f"prompts of {longest} tokens exceed the model's {mcfg.max_position_embeddings} positions",
              file=sys.stderr)
        return 2
    budget = max(2048, *sizes["prefill_lens"], plen, max(batches) * dprompt)
    need = max(longest + 1, max(batches) * (dprompt + dtok + 2))
    num_blocks = -(-need // bs) + max(batches) + 8
    ours = Ours(model, mcfg, bs, num_blocks, budget, max(32, max(batches)), args.threads)
    dtypes = ["float32"] + [d for d in args.dtypes.split(",") if d.strip() and d.strip() != "float32"]
    if any(d not in SHORT for d in dtypes):
        print(f"--dtypes: choose from {sorted(SHORT)}", file=sys.stderr)
        return 2
    # every engine timed beside `ours`, in the order they alternate
    others: dict = {}
    for d in dtypes[1:] if not getattr(args, "ours_in_worker", False) else ():
        from pdd.engine.runner import DTYPES

        md, _ = load_model(folder, DTYPES[d])
        others[f"ours{SHORT[d]}"] = Ours(md, mcfg, bs, num_blocks, budget, max(32, max(batches)), args.threads, d)
    others.update(start_workers(args, folder, dtypes, sizes, budget, num_blocks, Path(args.out)))
    timed = ours
    if getattr(args, "ours_in_worker", False):
        # the in-process engine still runs the prefix-hit measurement (it needs engine access)
        timed = others.pop("ours_w")
        for d in dtypes[1:]:
            others[f"ours{SHORT[d]}"] = others.pop(f"ours_w{SHORT[d]}")
        others = {k: others[k] for k in sorted(others, key=lambda k: not k.startswith("ours"))}
    try:
        return _run_all(args, sizes, model, mcfg, folder, ours, others, dtypes, bs, num_blocks, budget, timed)
    finally:
        for o in (timed, *others.values()):
            if isinstance(o, Worker):
                o.close()


def _run_all(args, sizes, model, mcfg, folder, ours, others, dtypes, bs, num_blocks, budget, timed=None) -> int:
    """timed: what the prefill and decode columns "ours" time (ours, or our engine in a worker)."""
    import torch

    vocab = mcfg.vocab_size
    batches, dprompt, dtok = sizes["decode_batches"], sizes["decode_prompt"], sizes["decode_tokens"]
    plen = sizes["prefix_prompt"]
    hf = HF(folder) if args.hf else None
    rng = random.Random(args.seed)
    R = args.repeats

    # warm-up: allocator, oneDNN/MKL kernels, HF generate machinery
    wp = _prompts(rng, 2, 32, vocab)
    timed = timed or ours
    for o in (timed, *others.values()):
        o.prefill(wp[0])
        o.decode(wp, 4)
    if hf:
        hf.prefill(wp[0])
        hf.decode(wp, 4, "dynamic")
        hf.decode(wp, 4, "static")

    result: dict = {
        "settings": {
            "model": str(folder), "model_id": mcfg.model_id, "dtype": "float32", "dtypes": dtypes,
            "others": {k: getattr(o, "version", None) or "ours" for k, o in others.items()},
            "vllm_block_size": args.vllm_block_size if args.vs_vllm else None,
            "worker_startup_s": {k: o.startup_s for k, o in others.items() if isinstance(o, Worker)},
            "worker_notes": {k: o.note for k, o in others.items() if isinstance(o, Worker) and o.note},
            "ours_in_worker": isinstance(timed, Worker),
            "threads": args.threads, "repeats": R, "quick": bool(args.quick), "seed": args.seed,
            "block_size": bs, "num_blocks": num_blocks, "max_num_batched_tokens": budget,
            "prefill_one_pass": True, **sizes,
        },
        "torch_version": torch.__version__,
        "transformers_version": _version("transformers"),
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpu_count": os.cpu_count(),
        "method": METHOD,
    }

    # ---- prefill
    prefill: dict = {}
    for L in sizes["prefill_lens"]:
        _log(f"prefill {L} tokens ...")
        o, oc, h, hc = [], [], [], []
        xs: dict[str, tuple[list, list]] = {k: ([], []) for k in others}
        for _ in range(R):
            p = _prompts(rng, 1, L, vocab)[0]
            dt, cpu, _ = timed.prefill(p)
            o.append(dt)
            oc.append(cpu)
            for k, eng in others.items():
                dt, cpu, _ = eng.prefill(p)
                xs[k][0].append(dt)
                xs[k][1].append(cpu)
            if hf:
                dt, cpu = hf.prefill(p)
                h.append(dt)
                hc.append(cpu)
        e = {"ours": _summ(o, L, oc)} | {k: _summ(w, L, c) for k, (w, c) in xs.items()}
        if hf:
            e["hf"] = _summ(h, L, hc)
            e["speedup"] = e["hf"]["median_s"] / e["ours"]["median_s"]
        prefill[str(L)] = e
    result["prefill"] = prefill

    # ---- decode
    decode: dict = {}
    for N in batches:
        _log(f"decode batch {N} ...")
        o, oc = [], []
        h: dict[str, list[float]] = {"dynamic": [], "static": []}
        hc: dict[str, list[float]] = {"dynamic": [], "static": []}
        o_tokens = h_tokens = 0
        mean_batch = []
        xs = {k: ([], []) for k in others}
        for _ in range(R):
            ps = _prompts(rng, N, dprompt, vocab)
            dt, cpu, o_tokens, mb = timed.decode(ps, dtok)
            o.append(dt)
            oc.append(cpu)
            mean_batch.append(mb)
            for k, eng in others.items():
                dt, cpu, x_tokens, _ = eng.decode(ps, dtok)
                if x_tokens != o_tokens:
                    raise RuntimeError(f"{k} made {x_tokens} decode tokens, ours {o_tokens}")
                xs[k][0].append(dt)
                xs[k][1].append(cpu)
            if hf:
                for cache in h:
                    dt, cpu, h_tokens = hf.decode(ps, dtok, cache)
                    h[cache].append(dt)
                    hc[cache].append(cpu)
        e = {"ours": {**_summ(o, o_tokens, oc), "mean_batch": _median(mean_batch)}}
        e |= {k: _summ(w, o_tokens, c) for k, (w, c) in xs.items()}
        if hf:
            e["hf_dynamic"] = _summ(h["dynamic"], h_tokens, hc["dynamic"])
            e["hf_static"] = _summ(h["static"], h_tokens, hc["static"])
            best = max(("hf_dynamic", "hf_static"), key=lambda k: e[k]["tok_s"])
            e["hf_best"] = best
            e["speedup"] = e["ours"]["tok_s"] / e[best]["tok_s"]
            cbest = max(e[k]["cpu_tok_s"] for k in ("hf_dynamic", "hf_static"))
            e["cpu_speedup"] = e["ours"]["cpu_tok_s"] / cbest
        decode[str(N)] = e
    result["decode"] = decode

    # ---- prefix hit vs cold
    _log(f"prefix hit vs cold ({plen} tokens) ...")
    hit_tokens = (int(plen * sizes["prefix_frac"]) // bs) * bs
    cold, hot, cold_cpu, hot_cpu, cached = [], [], [], [], []
    for _ in range(R):
        p = _prompts(rng, 1, plen, vocab)[0]
        dt, cpu, c = ours.prefill(p)        # fresh engine: cold
        if c:
            raise RuntimeError("cold prefill found cached tokens")
        cold.append(dt)
        cold_cpu.append(cpu)
        eng = ours.engine()
        ours.warm_prefix(eng, p[:hit_tokens])
        dt, cpu, c = ours.prefill(p, eng)
        hot.append(dt)
        hot_cpu.append(cpu)
        cached.append(c)
    if any(c != hit_tokens for c in cached):
        raise RuntimeError(f"expected {hit_tokens} cached tokens, got {cached}")
    result["prefix_hit"] = {
        "prompt_tokens": plen, "cached_tokens": hit_tokens, "hit_fraction": hit_tokens / plen,
        "cold": _summ(cold, cpu=cold_cpu), "hit": _summ(hot, cpu=hot_cpu),
        "speedup": _median(cold) / _median(hot),
        "cpu_speedup": _median(cold_cpu) / _median(hot_cpu),
    }

    # ---- long-context decode steps, both attention paths
    if sizes["long_ctx"]:
        long: dict = {"pool": {}, "scattered": {}}
        for layout, by_batch in long.items():
            for N in batches:
                _log(f"long-context decode step, batch {N} x {sizes['long_ctx']} tokens, {layout} blocks ...")
                by_batch[str(N)] = long_decode(model, mcfg, N, sizes["long_ctx"], bs, R, args.seed, layout)
        result["long_decode"] = long

    # ---- headline
    b16 = decode.get("16", {})
    result["decode_speedup_b16"] = b16.get("speedup")
    result["prefix_hit_speedup"] = result["prefix_hit"]["speedup"]
    result["targets"] = {
        "decode_speedup_b16": TARGET_DECODE_SPEEDUP_B16,
        "prefix_hit_speedup": TARGET_PREFIX_HIT_SPEEDUP,
        "decode_speedup_b16_met": None if result["decode_speedup_b16"] is None
        else result["decode_speedup_b16"] >= TARGET_DECODE_SPEEDUP_B16,
        "prefix_hit_speedup_met": result["prefix_hit_speedup"] >= TARGET_PREFIX_HIT_SPEEDUP,
    }

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(format_table(result))
    print(f"\nwrote {out}")
    return 0


def _version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:  # pragma: no cover
        return None


def format_table(r: dict) -> str:
    s = r["settings"]
    lines = [f"engine bench: {Path(s['model']).name}, fp32, {s['threads']} thread(s), "
             f"median of {s['repeats']}, torch {r['torch_version']}"]
    hf = any("hf" in e for e in r["prefill"].values())
    lines.append("")
    lines.append(f"{'prefill':<22}{'ours tok/s':>12}{'HF tok/s':>12}{'speedup':>10}")
    for L, e in r["prefill"].items():
        lines.append(f"{L + ' tokens':<22}{e['ours']['tok_s']:>12.1f}"
                     + (f"{e['hf']['tok_s']:>12.1f}{e['speedup']:>9.2f}x" if hf else ""))
    lines.append("")
    lines.append(f"{'decode':<22}{'ours tok/s':>12}{'HF dyn':>12}{'HF static':>12}{'speedup':>10}"
                 f"{'(CPU time)':>12}")
    for N, e in r["decode"].items():
        row = f"{'batch ' + N:<22}{e['ours']['tok_s']:>12.1f}"
        if "hf_best" in e:
            row += (f"{e['hf_dynamic']['tok_s']:>12.1f}{e['hf_static']['tok_s']:>12.1f}"
                    f"{e['speedup']:>9.2f}x{e['cpu_speedup']:>11.2f}x")
        lines.append(row)
    lines.extend(_side_by_side(r))
    p = r["prefix_hit"]
    lines.append("")
    lines.append(f"prefix hit: {p['prompt_tokens']}-token prompt, {p['cached_tokens']} cached "
                 f"({100 * p['hit_fraction']:.0f}%): cold {p['cold']['median_s'] * 1e3:.1f} ms, "
                 f"hit {p['hit']['median_s'] * 1e3:.1f} ms -> {p['speedup']:.2f}x "
                 f"(CPU time {p['cpu_speedup']:.2f}x)")
    for layout, by_batch in (r.get("long_decode") or {}).items():
        lines.append("")
        lines.append(f"{'step, ' + str(s['long_ctx']) + ' ctx, ' + layout:<26}{'per-seq s':>10}{'batched s':>10}"
                     f"{'speedup':>9}{'(CPU time)':>12}{'attn share':>12}")
        for N, e in by_batch.items():
            ps = e["per_seq"]
            share = ps["attention"]["median_s"] / ps["step"]["median_s"]
            lines.append(f"{'batch ' + N:<26}{ps['step']['median_s']:>10.3f}"
                         f"{e['batched']['step']['median_s']:>10.3f}{e['speedup']:>8.2f}x"
                         f"{e['cpu_speedup']:>11.2f}x{share:>11.0%}")
    d = r["decode_speedup_b16"]
    lines.append(f"decode_speedup_b16 = {'n/a' if d is None else f'{d:.2f}x'} (target >= "
                 f"{TARGET_DECODE_SPEEDUP_B16:g}x); prefix_hit_speedup = {r['prefix_hit_speedup']:.2f}x "
                 f"(target >= {TARGET_PREFIX_HIT_SPEEDUP:g}x)")
    return "\n".join(lines)


def _side_by_side(r: dict) -> list[str]:
    """tok/s of every engine timed beside ours (--dtypes, --vs-vllm, --baseline-src), one column each."""
    names = ["ours", *r["settings"].get("others", {})]
    if len(names) == 1:
        return []
    lines = ["", "| tok/s | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    rows = [(f"decode, batch {N}", e) for N, e in r["decode"].items()]
    rows += [(f"prefill, {L} tokens", e) for L, e in r["prefill"].items()]
    for label, e in rows:
        lines.append(f"| {label} | " + " | ".join(f"{e[n]['tok_s']:.1f}" for n in names) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:  # pragma: no cover - `pdd bench engine` is the entry
    p = argparse.ArgumentParser(prog="python -m pdd.engine.bench")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
