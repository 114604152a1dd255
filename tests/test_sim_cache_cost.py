import random

import pytest

from pdd.sim.cost_model import CostModel, StepShape, calibrate
from pdd.sim.hardware import PROFILES, get_profile
from pdd.sim.model_shape import get_model
from pdd.sim.prefix_cache import PrefixCache


def test_prefix_match_stops_at_first_miss():
    c = PrefixCache(10)
    c.insert([1, 2, 3])
    assert c.match([1, 2, 3, 4]) == 3
    assert c.match([1, 9, 3]) == 1
    assert c.match([9]) == 0


def test_lru_evicts_chain_tails_first():
    c = PrefixCache(4)
    c.insert([1, 2, 3])
    c.insert([7, 8])          # needs one slot: the oldest chain's leaf goes
    assert 3 not in c and 1 in c and 2 in c
    assert c.match([1, 2, 3]) == 2
    c.set_capacity(2)         # memory taken by running requests
    assert len(c) == 2 and c.num_evicted == 3


def test_profiles_cover_the_axes_and_b_costs_more_than_a():
    a, b = get_profile("gpu_a"), get_profile("gpu_b")
    assert a.peak_flops > b.peak_flops and b.mem_bytes > a.mem_bytes
    assert b.mem_bw_bytes_s > a.mem_bw_bytes_s
    assert 1.2 <= b.price_per_hour / a.price_per_hour <= 1.3
    assert {"h100_sxm", "h200", "a100_80gb", "l40s", "mi300x", "cpu"} <= set(PROFILES)


def test_roofline_regimes():
    cm = CostModel(get_model("llama3-8b"), get_profile("h100_sxm"))
    decode = StepShape(0, 8, 8, [4096] * 8)
    prefill = StepShape(8192, 0, 1, [8192])
    assert cm.memory_s(decode) > cm.compute_s(decode)       # decode: memory-bound
    assert cm.compute_s(prefill) > cm.memory_s(prefill)     # prefill: compute-bound
    assert cm.step_time(prefill) > cm.step_time(decode)


@pytest.mark.parametrize("attn_cost", [1.0, 3.5])
def test_fast_path_equals_step_time(attn_cost):
    cm = CostModel(get_model("report-moe"), get_profile("gpu_a"), chips=4, attn_cost=attn_cost)
    s = StepShape(300, 20, 22, [5000] * 20, attn_pairs=123456.0)
    t = cm.fast()(320, 22, 100000.0, 123456.0)
    assert t == pytest.approx(cm.step_time(s), rel=1e-12)


def _prefill_chunks(truth: CostModel, seed: int) -> list[dict]:
    """Prefill chunks of 32-512 tokens at contexts 0-3K, +-2% noise."""
    rng = random.Random(seed)
    recs = []
    for _ in range(120):
        n = rng.choice([512, 512, rng.randint(32, 512)])
        ctx = n + rng.randint(0, 3072)
        rec = {"num_prefill_tokens": n, "num_decode_tokens": 0, "batch_size": 1, "context_lens": [ctx]}
        rec["wall_s"] = truth.step_time(StepShape.from_record(rec)) * rng.uniform(0.98, 1.02)
        recs.append(rec)
    return recs


@pytest.mark.parametrize("attn_cost", [1.0, 3.4])
def test_calibrate_separates_attention_from_the_matmuls(attn_cost):
    """A chunk's time grows with its context faster than the attention FLOPs
    at the matmuls' rate say where the attention kernel is slower (this CPU
    without AMX: 3.4x); the fit finds the factor, and finds none where there
    is none."""
    model = get_model("smollm2-135m")
    truth = CostModel(model, get_profile("cpu"), mfu=0.15, overhead_s=0.05, attn_cost=attn_cost)
    recs = _prefill_chunks(truth, 1)
    fitted = calibrate(recs, CostModel(model, get_profile("cpu")), balance=True).model
    assert fitted.attn_cost == pytest.approx(attn_cost, rel=0.2)
    for rec in _prefill_chunks(truth, 2):     # held-out chunks
        s = StepShape.from_record(rec)
        assert fitted.step_time(s) == pytest.approx(truth.step_time(s), rel=0.06)
    # Without the factor the same fit misses long contexts against short ones.
    flat = calibrate(recs, CostModel(model, get_profile("cpu")), balance=True, fit_attention=False).model
    short, long_ = StepShape(512, 0, 1, [512]), StepShape(512, 0, 1, [3584])
    ratio = lambda m: m.step_time(long_) / m.step_time(short)
    if attn_cost > 1.5:
        assert ratio(flat) < 0.9 * ratio(truth)
    assert ratio(fitted) == pytest.approx(ratio(truth), rel=0.05)


def test_calibrate_recovers_known_coefficients():
    true = CostModel(get_model("smollm2-135m"), get_profile("cpu"), mfu=0.12, mbu=0.4,
                     overhead_s=0.003, per_seq_s=0.0004)
    rng = random.Random(0)
    recs = []
    for _ in range(200):
        n_dec = rng.randint(0, 16)
        n_pre = rng.choice([0, 0, rng.randint(1, 512)])
        ctx = [rng.randint(1, 2048) for _ in range(n_dec + (1 if n_pre else 0))]
        if not ctx:
            continue
        rec = {"num_prefill_tokens": n_pre, "num_decode_tokens": n_dec,
               "batch_size": len(ctx), "context_lens": ctx}
        rec["wall_s"] = true.step_time(StepShape.from_record(rec)) * rng.uniform(0.98, 1.02)
        recs.append(rec)
    base = CostModel(get_model("smollm2-135m"), get_profile("cpu"))
    cal = calibrate(recs, base)
    assert cal.r2 > 0.98
    assert cal.model.mfu == pytest.approx(0.12, rel=0.15)
    assert cal.model.overhead_s == pytest.approx(0.003, rel=0.3)
