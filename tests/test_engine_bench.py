"""`pdd bench engine --quick` on the tiny random Llama, HF baseline included:
the JSON has every number it promises (positive, finite). Speed targets are
not asserted here: this checks the harness, not the machine."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pdd.engine import bench, bench_sides


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_bench_engine_quick_writes_all_numbers(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "engine.json"
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--model", str(tiny_model_dir), "--repeats", "2",
                              "--threads", "1", "--out", str(out)])
    assert bench.run(args) == 0
    r = json.loads(out.read_text())

    assert _positive(r["decode_speedup_b16"])
    assert _positive(r["prefix_hit_speedup"])
    assert r["settings"]["threads"] == 1 and r["settings"]["quick"] is True
    assert r["torch_version"] and r["method"]

    for L in r["settings"]["prefill_lens"]:
        e = r["prefill"][str(L)]
        for side in ("ours", "hf"):
            assert _positive(e[side]["tok_s"]) and len(e[side]["samples_s"]) == 2
        assert _positive(e["speedup"])

    assert "16" in r["decode"]
    for N in r["settings"]["decode_batches"]:
        e = r["decode"][str(N)]
        for side in ("ours", "hf_dynamic", "hf_static"):
            assert _positive(e[side]["tok_s"]) and all(_positive(s) for s in e[side]["samples_s"])
            assert e[side]["tokens"] == N * r["settings"]["decode_tokens"]
        assert e["ours"]["mean_batch"] == N      # continuous batching ran all N in every step
        assert e["hf_best"] in ("hf_dynamic", "hf_static")
        assert _positive(e["speedup"])

    p = r["prefix_hit"]
    assert p["cached_tokens"] % r["settings"]["block_size"] == 0
    assert 0.8 <= p["hit_fraction"] <= 0.9
    assert _positive(p["cold"]["median_s"]) and _positive(p["hit"]["median_s"])
    assert math.isclose(p["speedup"], r["prefix_hit_speedup"])

    assert set(r["long_decode"]) == {"pool", "scattered"}
    for by_batch in r["long_decode"].values():
        assert set(by_batch) == {str(N) for N in r["settings"]["decode_batches"]}
        for e in by_batch.values():
            for path in ("per_seq", "batched"):
                assert len(e[path]["step"]["samples_s"]) == 2 and _positive(e[path]["step"]["median_s"])
                assert 0 < e[path]["attention"]["median_s"] < e[path]["step"]["median_s"]
            assert _positive(e["speedup"]) and _positive(e["cpu_speedup"])

    printed = capsys.readouterr().out
    assert "decode_speedup_b16" in printed and "prefix hit" in printed and "per-seq" in printed


def test_bench_worker_times_our_engine_in_another_process(tiny_model_dir, tmp_path):
    """The worker protocol end to end with a real process: the pdd backend (what
    --baseline-src runs) answers prefill and decode with the same counts as Ours."""
    import os
    import sys

    script = str(Path(bench.__file__).with_name("bench_worker.py"))
    argv = [sys.executable, script, "--backend", "pdd", "--model", str(tiny_model_dir), "--dtype", "bfloat16",
            "--num-blocks", "64", "--max-num-batched-tokens", "512"]
    w = bench_sides.Worker(argv, dict(os.environ), tmp_path / "w.log", timeout_s=120)
    try:
        assert _positive(w.startup_s) and w.version
        wall, cpu, _ = w.prefill(list(range(100, 140)))
        assert _positive(wall) and _positive(cpu)
        wall, cpu, tokens, batch = w.decode([list(range(100, 120)), list(range(200, 220))], 5)
        assert tokens == 2 * 5 and batch == 2 and _positive(wall)
        try:
            w._call(op="nonsense")
            raise AssertionError("an unknown op must be reported")
        except RuntimeError as e:
            assert "unknown op" in str(e)
    finally:
        w.close()
    assert w.proc.returncode == 0


def test_vs_vllm_without_its_interpreter_says_so(tiny_model_dir, tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--model", str(tiny_model_dir), "--no-hf", "--vs-vllm",
                              "--vllm-python", str(tmp_path / "nope" / "python"), "--out", str(tmp_path / "e.json")])
    try:
        bench.run(args)
        raise AssertionError("expected SystemExit")
    except SystemExit as e:
        assert "--vllm-python" in str(e) and "no interpreter" in str(e)


def test_ours_in_worker_times_both_dtypes_in_workers(tiny_model_dir, tmp_path):
    """--ours-in-worker: the "ours" and "ours_bf16" prefill/decode columns come
    from worker processes of this checkout, with every count the in-process
    engine would give; the prefix-hit measurement still runs in process."""
    out = tmp_path / "engine.json"
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--quick", "--model", str(tiny_model_dir), "--repeats", "1", "--no-hf",
                              "--dtypes", "float32,bfloat16", "--ours-in-worker", "--long-ctx", "0",
                              "--decode-batches", "2", "--prefill-lens", "32", "--out", str(out)])
    assert bench.run(args) == 0
    r = json.loads(out.read_text())
    assert r["settings"]["ours_in_worker"] is True
    assert set(r["settings"]["worker_startup_s"]) == {"ours_bf16"}        # "ours" is the timed worker
    assert r["settings"]["others"]["ours_bf16"].endswith(str(Path(bench.__file__).parents[1]) + ")")
    assert r["settings"]["worker_notes"]["ours_bf16"].startswith("weights on")   # as `pdd serve` starts: its pages
    e = r["decode"]["2"]
    for side in ("ours", "ours_bf16"):
        assert _positive(e[side]["tok_s"]) and e[side]["tokens"] == 2 * r["settings"]["decode_tokens"]
    assert _positive(r["prefill"]["32"]["ours"]["tok_s"]) and _positive(r["prefix_hit_speedup"])
