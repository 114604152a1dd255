"""The engines `pdd bench engine` times side by side: ours in this process
(`Ours`), vLLM or our engine from another checkout in worker processes
(`Worker`, `start_workers`; the worker is `bench_worker.py`), and plain HF
transformers (`HF`); with the summary helpers they share. The method is in
`pdd.engine.bench`'s docstring."""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


class _Stamps:
    """A generate() streamer that records when each put() happens (the prompt first)."""

    def __init__(self):
        self.t: list[float] = []
        self.cpu: list[float] = []

    def put(self, value):
        self.t.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def end(self):
        pass


# ---------------------------------------------------------------------- ours
class Ours:
    def __init__(self, model, model_cfg, block_size: int, num_blocks: int, budget: int, max_seqs: int,
                 threads: int, dtype: str = "float32"):
        from pdd.engine.config import EngineConfig

        self.model, self.model_cfg = model, model_cfg
        self.ecfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_seqs,
                                 max_num_batched_tokens=budget, num_threads=threads, dtype=dtype)
        self._n = 0

    def engine(self):
        from pdd.engine.engine import Engine

        return Engine(self.model, self.model_cfg, self.ecfg)

    def _req(self, prompt: list[int], max_tokens: int):
        from pdd.engine.request import EngineRequest, SamplingParams

        self._n += 1
        return EngineRequest(f"b{self._n}", list(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def prefill(self, prompt: list[int], engine=None) -> tuple[float, float, int]:
        """(wall s, CPU s) of the one step that prefills `prompt` (and samples its first token); cached tokens."""
        eng = engine or self.engine()
        req = self._req(prompt, 1)
        eng.submit(req)
        c0, t0 = time.process_time(), time.perf_counter()
        eng.step()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        rec = eng.step_log[-1]
        if rec.num_prefill_tokens + req.num_cached_tokens != len(prompt) or not req.status.finished:
            raise RuntimeError(f"prefill of {len(prompt)} tokens did not run in one pass: {rec}")
        return dt, cpu, req.num_cached_tokens

    def warm_prefix(self, engine, prefix: list[int]) -> None:
        eng = engine
        eng.submit(self._req(prefix, 1))
        while eng.has_work:
            eng.step()

    def decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, int, float]:
        """(wall s, CPU s of the decode steps, tokens they made, mean batch size)."""
        eng = self.engine()
        reqs = [self._req(p, new_tokens + 1) for p in prompts]
        for r in reqs:
            eng.submit(r)
        eng.step()   # prefill of all prompts, samples every first token
        if any(r.num_output_tokens != 1 for r in reqs):
            raise RuntimeError("the prefill of the decode batch did not fit one step")
        n0 = len(eng.step_log)
        c0, t0 = time.process_time(), time.perf_counter()
        while eng.has_work:
            eng.step()
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        made = sum(r.num_output_tokens for r in reqs) - len(reqs)
        steps = list(eng.step_log)[n0:]
        if any(s.num_prefill_tokens for s in steps):
            raise RuntimeError("a decode step contained prefill tokens")
        return dt, cpu, made, sum(s.batch_size for s in steps) / max(1, len(steps))


# ---------------------------------------------------------------------- other engines, in workers
SHORT = {"float32": "", "bfloat16": "_bf16", "float16": "_fp16"}


class Worker:
    """A bench_worker.py process (vLLM, or our engine from another checkout) that
    takes the same measurements as `Ours` when asked; see bench_worker's protocol."""

    def __init__(self, argv: list[str], env: dict, log_path: Path, timeout_s: float):
        import subprocess

        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path, self.timeout_s = log_path, timeout_s
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env=env)
        ready = self._read()
        if not ready.get("ready"):
            raise RuntimeError(f"worker did not start: {ready}")
        self.version, self.startup_s = ready.get("version"), ready.get("startup_s")
        self.note = ready.get("note", "")         # e.g. ours: the weights' pages

    def _read(self) -> dict:
        import select

        r, _, _ = select.select([self.proc.stdout], [], [], self.timeout_s)
        line = self.proc.stdout.readline() if r else ""
        if not line:
            self.close()
            raise RuntimeError(f"worker gave no answer within {self.timeout_s:g} s (exit code "
                               f"{self.proc.poll()}); its log: {self.log_path}")
        ans = json.loads(line)
        if "error" in ans:
            raise RuntimeError(f"worker: {ans['error']} (log: {self.log_path})")
        return ans

    def _call(self, **cmd) -> dict:
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            code = self.proc.wait()
            raise RuntimeError(f"worker exited with code {code}"
                               + (" (killed: out of memory?)" if code == -9 else "")
                               + f"; its log: {self.log_path}") from None
        return self._read()

    def prefill(self, prompt: list[int]) -> tuple[float, float, int]:
        a = self._call(op="prefill", prompt=prompt)
        return a["wall_s"], a["cpu_s"], 0

    def decode(self, prompts: list[list[int]], new_tokens: int) -> tuple[float, float, int, float]:
        a = self._call(op="decode", prompts=prompts, new_tokens=new_tokens)
        return a["wall_s"], a["cpu_s"], a["tokens"], float(len(prompts))

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=30)
            except Exception:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_workers(args, folder: Path, dtypes: list[str], sizes: dict, budget: int, num_blocks: int,
                  out: Path) -> dict[str, Worker]:
    """name -> Worker: vllm[_bf16] with --vs-vllm, base[_bf16] with --baseline-src."""
    script = str(Path(__file__).with_name("bench_worker.py"))
    longest = max([*sizes["prefill_lens"], sizes["prefix_prompt"], sizes["decode_prompt"] + sizes["decode_tokens"] + 2])
    common = ["--model", str(folder), "--threads", str(args.threads), "--max-num-batched-tokens", str(budget),
              "--max-num-seqs", str(max(32, *sizes["decode_batches"])), "--max-model-len", str(longest + 8)]
    plan = []
    if getattr(args, "ours_in_worker", False):
        # this checkout's pdd, the one this process imported (the venv's editable install may
        # point at another checkout, which a worker would otherwise import instead)
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
        for d in dtypes:
            plan.append((f"ours_w{SHORT[d]}", [sys.executable, script, "--backend", "pdd", "--dtype", d,
                                               "--block-size", str(args.block_size),
                                               "--num-blocks", str(num_blocks)], env))
    if args.vs_vllm:
        python = Path(args.vllm_python)
        if not python.exists():
            raise SystemExit(f"--vs-vllm: no interpreter at {python} (a venv with vLLM; --vllm-python)")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        for d in (args.vllm_dtypes.split(",") if args.vllm_dtypes else dtypes):
            plan.append((f"vllm{SHORT[d]}", [str(python), script, "--backend", "vllm", "--dtype", d,
                                             "--block-size", str(args.vllm_block_size)], env))
    if args.baseline_src:
        env = dict(os.environ, PYTHONPATH=str(Path(args.baseline_src).resolve() / "src"))
        for d in dtypes:
            plan.append((f"base{SHORT[d]}", [sys.executable, script, "--backend", "pdd", "--dtype", d,
                                             "--block-size", str(args.block_size),
                                             "--num-blocks", str(num_blocks)], env))
    workers: dict[str, Worker] = {}
    try:
        for name, argv, env in plan:
            _log(f"starting worker {name} ...")
            workers[name] = Worker(argv + common, env, out.with_suffix(f".{name}.log"), args.worker_timeout)
    except BaseException:
        for w in workers.values():
            w.close()
        raise
    return workers


# ---------------------------------------------------------------------- HF
class HF:
    def __init__(self, folder: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        eos = self.model.config.eos_token_id
        self.pad = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0

    def prefill(self, prompt: list[int]) -> tuple[float, float]:
        torch = self.torch
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            c0, t0 = time.process_time(), time.perf_counter()
            out = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                             logits_to_keep=1)
            out.logits[:, -1].argmax(-1)
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        return dt, cpu

    def decode(self, prompts: list[list[int]], new_tokens: int, cache: str) -> tuple[float, float, int]:
        """(wall s, CPU s from the first new token to the last, tokens made in that window)."""
        torch = self.torch
        ids = torch.tensor(prompts)
        stamps = _Stamps()
        kw = {"cache_implementation": "static"} if cache == "static" else {}
        with torch.inference_mode():
            out = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False,
                max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1,
                pad_token_id=self.pad, streamer=stamps, **kw,
            )
        made = out.shape[1] - ids.shape[1]
        # stamps: [prompt, token 1 (after prefill), token 2, ..., token new_tokens+1]
        if made != new_tokens + 1 or len(stamps.t) != made + 1:
            raise RuntimeError(f"HF generate made {made} tokens, {len(stamps.t)} stamps")
        return stamps.t[-1] - stamps.t[1], stamps.cpu[-1] - stamps.cpu[1], len(prompts) * (made - 1)


# ---------------------------------------------------------------------- summaries
def _summ(samples: list[float], tokens: int | None = None, cpu: list[float] | None = None) -> dict:
    """Wall-clock median and samples (the headline numbers), plus process CPU time
    (a cross-check on a shared machine: with one thread it leaves out time spent descheduled)."""
    med = _median(samples)
    d = {"median_s": med, "samples_s": samples}
    if tokens is not None:
        d["tokens"] = tokens
        d["tok_s"] = tokens / med if med > 0 else math.inf
        d["samples_tok_s"] = [tokens / s if s > 0 else math.inf for s in samples]
    if cpu:
        d["cpu_median_s"] = _median(cpu)
        d["cpu_samples_s"] = cpu
        if tokens is not None:
            d["cpu_tok_s"] = tokens / d["cpu_median_s"] if d["cpu_median_s"] > 0 else math.inf
    return d


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
