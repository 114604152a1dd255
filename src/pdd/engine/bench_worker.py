"""An engine in its own process, timed on request: the other side of `pdd bench engine --vs-vllm`.

    PYTHON bench_worker.py --backend vllm|pdd --model DIR --dtype D --threads 1 ...

It runs under another interpreter (vLLM's venv, or our venv with another
source tree on PYTHONPATH for a before/after run), so it imports only the
standard library at the top and its backend's engine when started. The
bench process alternates: it times our engine, then asks each worker for the
same measurement on the same prompts, so a noisy neighbour hurts all alike.

Protocol: JSON lines. The worker reads commands on stdin and answers on the
stdout it was started with; everything else it (or vLLM's logging) prints
goes to stderr.
    -> {"op": "prefill", "prompt": [ids]}                  <- {"wall_s", "cpu_s"}
    -> {"op": "decode", "prompts": [[ids]], "new_tokens": n} <- {"wall_s", "cpu_s", "tokens"}
    -> {"op": "quit"}
First line out: {"ready": true, "version": ..., "startup_s": ...}; a failed
command answers {"error": "..."}.

Both backends measure what `Ours` in pdd.engine.bench_sides measures: prefill =
the one step that prefills the prompt and samples its first token; decode =
N requests prefilled in one step, then the steps from the first token to the
last, timed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time


class VllmBackend:
    """vLLM's in-process LLMEngine (V1, no multiprocessing), eager, one thread."""

    def __init__(self, a):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        os.environ["OMP_NUM_THREADS"] = str(a.threads)
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")   # GiB (an int): 22K fp32 tokens
        import torch
        import vllm
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        torch.set_num_threads(a.threads)
        self.version = vllm.__version__
        self.llm = LLMEngine.from_engine_args(EngineArgs(
            model=a.model, tokenizer=a.model, dtype=a.dtype, block_size=a.block_size,
            enforce_eager=not a.compile, max_num_seqs=a.max_num_seqs,
            max_num_batched_tokens=a.max_num_batched_tokens, enable_chunked_prefill=True,
            max_model_len=a.max_model_len, enable_prefix_caching=True, seed=0, disable_log_stats=True))
        torch.set_num_threads(a.threads)
        self._n = 0

    def _params(self, n: int):
        from vllm import SamplingParams

        return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)

    def _add(self, prompt: list[int], n: int) -> str:
        self._n += 1
        rid = f"w{self._n}"
        self.llm.add_request(rid, {"prompt_token_ids": list(prompt)}, self._params(n))
        return rid

    def prefill(self, prompt: list[int]) -> dict:
        self._add(prompt, 1)
        c0, t0 = time.process_time(), time.perf_counter()
        while self.llm.has_unfinished_requests():
            self.llm.step()
        return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0}

    def decode(self, prompts: list[list[int]], new_tokens: int) -> dict:
        for p in prompts:
            self._add(p, new_tokens + 1)
        made = 0
        while made < len(prompts):          # the prefill step(s): every first token
            made += sum(len(o.outputs[0].token_ids) for o in self.llm.step())
        c0, t0 = time.process_time(), time.perf_counter()
        tokens = 0
        while self.llm.has_unfinished_requests():
            for o in self.llm.step():
                if o.finished:
                    tokens += len(o.outputs[0].token_ids) - 1
        return {"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0, "tokens": tokens}


class PddBackend:
    """Our Engine, from whatever `pdd` this interpreter imports (a before/after baseline)."""

    def __init__(self, a):
        import torch

        import pdd
        try:
            from pdd.engine.bench_sides import Ours
        except ImportError:        # a --baseline-src checkout from before the split
            from pdd.engine.bench import Ours
        from pdd.model.loader import load_model

        torch.set_num_threads(a.threads)
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
        model, mcfg = load_model(a.model, dtype)
        self.version = getattr(pdd, "__version__", "src") + f" ({os.path.dirname(pdd.__file__)})"
        self.ours = Ours(model, mcfg, a.block_size, a.num_blocks, a.max_num_batched_tokens, a.max_num_seqs,
                         a.threads)
        self.ours.ecfg = dataclasses.replace(self.ours.ecfg, dtype=a.dtype)
        notes = []
        if getattr(self.ours.ecfg, "huge_pages", False):   # as `pdd serve` does at start-up, not inside a timing
            notes.append(model.weights_on_huge_pages().line())
        try:                                   # which attention the engine takes (a baseline checkout may predate it)
            from pdd.engine.native_attention import unavailable_reason, use_kernel

            ecfg = self.ours.ecfg
            setting = getattr(ecfg, "attention", None) or getattr(ecfg, "bf16_attention", None) or "sdpa"
            if a.dtype == "float32" and not hasattr(ecfg, "attention"):
                native, why = False, "a checkout from before the fp32 kernel"
            else:
                native = use_kernel(setting, dtype, mcfg.head_dim, a.threads)
                try:
                    why = unavailable_reason(dtype)
                except TypeError:                  # a checkout with only the bf16 kernel
                    why = unavailable_reason()
            notes.append(f"attention: our {'fp32' if a.dtype == 'float32' else 'bf16'} kernel" if native else
                         f"attention: SDPA ({why or 'attention = ' + setting})")
        except ImportError:
            notes.append("attention: SDPA")
        self.note = "; ".join(notes)

    def prefill(self, prompt: list[int]) -> dict:
        wall, cpu, _ = self.ours.prefill(prompt)
        return {"wall_s": wall, "cpu_s": cpu}

    def decode(self, prompts: list[list[int]], new_tokens: int) -> dict:
        wall, cpu, tokens, _ = self.ours.decode(prompts, new_tokens)
        return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens}


BACKENDS = {"vllm": VllmBackend, "pdd": PddBackend}


def serve(backend, inp, out) -> None:
    """Answer commands until quit or end of input."""
    for line in inp:
        if not line.strip():
            continue
        cmd = json.loads(line)
        op = cmd.get("op")
        if op == "quit":
            return
        try:
            if op == "prefill":
                ans = backend.prefill(cmd["prompt"])
            elif op == "decode":
                ans = backend.decode(cmd["prompts"], int(cmd["new_tokens"]))
            else:
                ans = {"error": f"unknown op {op!r}"}
        except Exception as e:   # answered, not raised: the bench reports it
            ans = {"error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(ans) + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_worker.py")
    p.add_argument("--backend", choices=sorted(BACKENDS), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--compile", action="store_true", help="vLLM: torch.compile / graphs (slow start)")
    a = p.parse_args(argv)
    # the protocol keeps the real stdout; everything printed from here on goes to stderr
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    t0 = time.perf_counter()
    backend = BACKENDS[a.backend](a)
    proto.write(json.dumps({"ready": True, "version": backend.version, "note": getattr(backend, "note", ""),
                            "startup_s": time.perf_counter() - t0}) + "\n")
    proto.flush()
    serve(backend, sys.stdin, proto)
    return 0


if __name__ == "__main__":
    sys.exit(main())
