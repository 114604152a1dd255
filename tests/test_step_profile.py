"""`python -m pdd.engine.step_profile` on the tiny model: every bucket is
there, none negative, and they add up to the step's time."""

from __future__ import annotations

import math

import pytest

from pdd.engine import step_profile


@pytest.mark.parametrize("dtype", ["bfloat16"])
def test_buckets_add_up_to_the_step(tiny_model_dir, dtype):
    import torch

    from pdd.model.loader import load_model

    model, cfg = load_model(tiny_model_dir, getattr(torch, dtype))
    r = step_profile.profile_decode(model, cfg, dtype, batch=4, prompt=20, steps=3)
    b = r["buckets_ms"]
    assert list(b) == step_profile.ORDER and all(v >= 0 for v in b.values())
    assert math.isclose(sum(b.values()), r["step_ms"], rel_tol=1e-6) and r["step_ms"] > 0
    assert b["matmul"] > 0 and b["attention"] > 0
    table = step_profile.format_rows([(dtype, 4, r)])
    assert table.count("\n") == 2 and "| matmul |" in table
    assert step_profile.bucket("mkldnn::_linear_pointwise") == "matmul"
    assert step_profile.bucket("aten::index_select") == "kv write/gather"


def test_a_prefill_step_splits_the_same_way(tiny_model_dir):
    import torch

    from pdd.model.loader import load_model

    model, cfg = load_model(tiny_model_dir, torch.bfloat16)
    r = step_profile.profile_prefill(model, cfg, "bfloat16", prompt=40, repeats=1)
    b = r["buckets_ms"]
    assert list(b) == step_profile.ORDER and all(v >= 0 for v in b.values())
    assert math.isclose(sum(b.values()), r["step_ms"], rel_tol=1e-6) and r["step_ms"] > 0
    assert b["matmul"] > 0 and b["attention"] > 0
    assert "| bfloat16 | prefill 40 |" in step_profile.format_rows([("bfloat16", -40, r)])
