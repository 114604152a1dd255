"""One request cannot fail its neighbours: absurd sampling parameters are
refused or made safe, the sampler never raises on a degenerate row, and a
request that still fails inside a batched step fails alone while the other
requests of that step produce exactly the tokens they produce alone."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pdd.engine.config import EngineConfig
from pdd.engine.engine import Engine, InvalidRequestError
from pdd.engine.request import EngineRequest, SamplingParams
from pdd.engine.sampler import sample


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 20000) for _ in range(n)]


@pytest.mark.parametrize("kw", [
    {"temperature": -0.5}, {"temperature": math.nan}, {"temperature": math.inf}, {"temperature": 1e9},
    {"temperature": "1"}, {"temperature": True}, {"top_p": 0.0}, {"top_p": -1e-300}, {"top_p": math.nan},
    {"top_p": 1.5}, {"max_tokens": 0}, {"max_tokens": True}, {"max_tokens": 2.0}, {"seed": 1.5},
    {"stop": ("",)}, {"stop": ("a", 3)}, {"stop_token_ids": ("x",)}, {"ignore_eos": 1},
])
def test_absurd_sampling_params_are_refused(kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw)


def test_tiny_temperature_is_greedy_and_tiny_top_p_allowed():
    assert SamplingParams(temperature=1e-300).greedy
    assert SamplingParams(temperature=9e-6).greedy
    assert not SamplingParams(temperature=1e-5).greedy
    SamplingParams(temperature=1.0, top_p=1e-300)   # valid: keeps only the top token


def test_sampler_never_raises_on_degenerate_rows():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 1000, generator=g) * 30    # [N, V]
    logits[3] = math.nan                               # a row the model could not compute
    logits[4, 7] = math.inf
    params = [
        SamplingParams(temperature=1e-5, seed=1),              # logits / 1e-5: huge but finite in float64
        SamplingParams(temperature=1.0, top_p=1e-300, seed=2),  # 1e-300 is 0 in float32
        SamplingParams(temperature=100.0, top_p=1e-300, seed=3),
        SamplingParams(temperature=1.0, seed=4),
        SamplingParams(temperature=0.7, seed=5),
    ]
    out = sample(logits, params, [10] * 5)
    argmax = logits.argmax(dim=-1).tolist()
    assert out[0] == argmax[0] and out[1] == argmax[1] and out[2] == argmax[2]   # only the top token survives
    assert out[3] == argmax[3] and out[4] == 7                                # degenerate: greedy fallback
    assert all(0 <= t < 1000 for t in out)


def test_extend_refuses_tokens_outside_the_vocabulary(tiny_model):
    model, cfg = tiny_model
    eng = Engine(model, cfg, EngineConfig(num_blocks=64))
    eng.submit(EngineRequest("h", prompt(1, 20), SamplingParams(max_tokens=8), hold=True))
    for bad in ([cfg.vocab_size], [-1], [True]):
        with pytest.raises(InvalidRequestError, match="vocabulary"):
            eng.extend("h", bad, final=False)
    assert eng.requests["h"].num_tokens == 20


def _run(eng: Engine, reqs: list[EngineRequest], corrupt: dict[str, int] | None = None,
         max_steps: int = 400) -> tuple[dict[str, list[int]], dict[str, str]]:
    toks = {r.request_id: [] for r in reqs}
    reasons: dict[str, str] = {}
    for r in reqs:
        eng.submit(r)
    for rid, tok in (corrupt or {}).items():
        # A request whose state went bad inside the engine after validation
        # (the model's embedding lookup will raise on this id mid-batch).
        eng.requests[rid].token_ids[-1] = tok
    for _ in range(max_steps):
        for ev in eng.step():
            if ev.token_id is not None:
                toks[ev.request_id].append(ev.token_id)
            if ev.finished:
                reasons[ev.request_id] = ev.finish_reason
        if len(reasons) == len(reqs):
            return toks, reasons
    raise AssertionError("the engine did not finish within the step bound")


def test_poisoned_batch_leaves_neighbours_unchanged_on_the_real_model(smollm2):
    model, cfg = smollm2
    # The ten prompts (12-33 tokens) in one step, the poisoned ones beside the
    # others: a step overhead this large lets every short prompt join the step
    # that ends the first ones (`pdd.policy.step_packing`).
    ecfg = EngineConfig(num_blocks=128, max_num_seqs=16, max_num_batched_tokens=512, step_overhead_tokens=512)
    n = 10
    normal = {f"n{k}": prompt(10 + k, 12 + 7 * k) for k in range(4)}
    alone = {}
    for rid, p in normal.items():
        eng = Engine(model, cfg, ecfg)
        toks, reasons = _run(eng, [EngineRequest(rid, p, SamplingParams(max_tokens=n, ignore_eos=True))])
        alone[rid] = toks[rid]
        assert reasons[rid] == "length"
    poisoned = {
        "t_tiny": SamplingParams(max_tokens=n, temperature=1e-300, ignore_eos=True),
        "p_tiny": SamplingParams(max_tokens=n, temperature=1.0, top_p=1e-300, seed=3, ignore_eos=True),
        "hot_p_tiny": SamplingParams(max_tokens=n, temperature=100.0, top_p=1e-300, seed=4, ignore_eos=True),
        "t_small": SamplingParams(max_tokens=n, temperature=1e-5, seed=5, ignore_eos=True),
        "hot": SamplingParams(max_tokens=n, temperature=100.0, seed=6, ignore_eos=True),
        "corrupt": SamplingParams(max_tokens=n, ignore_eos=True),
    }
    reqs = [EngineRequest(rid, p, SamplingParams(max_tokens=n, ignore_eos=True)) for rid, p in normal.items()]
    for k, (rid, sp) in enumerate(poisoned.items()):
        reqs.insert(2 * k % (len(reqs) + 1), EngineRequest(rid, prompt(50 + k, 15), sp))
    eng = Engine(model, cfg, ecfg)
    toks, reasons = _run(eng, reqs, corrupt={"corrupt": cfg.vocab_size + 7})
    # all ten were prefilled in the first step; the corrupt one failed there and was dropped from it
    assert eng.step_log[0].batch_size == len(reqs) - 1
    for rid in normal:
        assert toks[rid] == alone[rid], rid
        assert reasons[rid] == "length"
    assert reasons["corrupt"] == "error" and toks["corrupt"] == []
    assert "IndexError" in eng.requests["corrupt"].error
    for rid in poisoned.keys() - {"corrupt"}:
        assert reasons[rid] == "length" and len(toks[rid]) == n, rid
    greedy = Engine(model, cfg, ecfg)
    ref, _ = _run(greedy, [EngineRequest("g", prompt(50, 15), SamplingParams(max_tokens=n, ignore_eos=True))])
    assert toks["t_tiny"] == ref["g"]          # 1e-300 decodes greedily
    assert eng.stats()["num_running"] == 0 and not eng.has_work
