"""Our Llama forward vs HF LlamaForCausalLM on tiny random models (fp32).

Tolerance: max |logit diff| < 1e-4 (in practice ~1e-6 or exactly 0 here).
"""

import hashlib

import pytest
import torch
from model_fixtures import hf_greedy, hf_logits, our_logits

from pdd.model.llama import LlamaModel, WeightLoadError
from pdd.model.loader import load_model, make_tiny_model
from pdd.model.reference import ContiguousAttention, generate_greedy

TOL = 1e-4


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def tiny(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_model(tmp_path_factory.mktemp("tiny"), seed=3, tie_word_embeddings=request.param)
    model, cfg = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, cfg, hf


def _prompt(n, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def test_logits_match_hf(tiny):
    _, model, cfg, hf = tiny
    ids = _prompt(200, cfg.vocab_size)
    ours, ref = our_logits(model, ids), hf_logits(hf, ids)
    assert ours.dtype == torch.float32 and ours.shape == (200, cfg.vocab_size)
    assert (ours - ref).abs().max().item() < TOL


def test_greedy_matches_hf_generate(tiny):
    _, model, cfg, hf = tiny
    ids = _prompt(12, cfg.vocab_size, seed=1)
    ours = generate_greedy(model, ids, 32, eos_token_ids=cfg.eos_token_ids)
    assert ours == hf_greedy(hf, ids, 32)
    assert len(set(ours)) > 4  # the tiny model's output is not degenerate


def test_chunked_prefill_and_decode_equal_full_pass(tiny):
    """Feeding the sequence in chunks (mask path of ContiguousAttention) == one pass."""
    _, model, cfg, _ = tiny
    ids = _prompt(50, cfg.vocab_size, seed=2)
    full = our_logits(model, ids)
    attn = ContiguousAttention(cfg.num_layers, initial_capacity=4)  # forces regrowth
    outs = []
    with torch.inference_mode():
        for a, b in [(0, 17), (17, 18), (18, 40), (40, 41), (41, 50)]:
            h = model(torch.tensor(ids[a:b]), torch.arange(a, b), attn)
            outs.append(model.compute_logits(h))
    assert attn.seq_len == 50
    assert (torch.cat(outs) - full).abs().max().item() < 1e-5


def test_attention_callback_contract(tiny):
    """The callback receives post-RoPE q/k with the documented shapes, per layer in order."""
    _, model, cfg, _ = tiny
    seen = []
    inner = ContiguousAttention(cfg.num_layers)

    def attn(layer, q, k, v):
        seen.append((layer, tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        return inner(layer, q, k, v)

    with torch.inference_mode():
        h = model(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 2]), attn)
    H, KVH, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    assert seen == [(i, (3, H, D), (3, KVH, D), (3, KVH, D)) for i in range(cfg.num_layers)]
    assert h.shape == (3, cfg.hidden_size)


def test_positions_are_honoured(tiny):
    """Same tokens at shifted positions give different hidden states (RoPE is applied)."""
    _, model, cfg, _ = tiny
    ids = torch.tensor(_prompt(8, cfg.vocab_size))
    with torch.inference_mode():
        a = model(ids, torch.arange(8), ContiguousAttention(cfg.num_layers))
        b = model(ids, torch.arange(100, 108), ContiguousAttention(cfg.num_layers))
        # beyond the cached max positions the RoPE cache grows instead of failing
        c = model(ids[:1], torch.tensor([cfg.max_position_embeddings + 5]), ContiguousAttention(cfg.num_layers))
    assert not torch.allclose(a, b)
    assert torch.isfinite(c).all()


def test_tiny_model_is_deterministic_per_seed(tmp_path):
    def digest(p):
        return hashlib.sha256((p / "model.safetensors").read_bytes()).hexdigest()

    a = make_tiny_model(tmp_path / "a", seed=7)
    b = make_tiny_model(tmp_path / "b", seed=7)
    c = make_tiny_model(tmp_path / "c", seed=8)
    assert digest(a) == digest(b) != digest(c)
    ma, ca = load_model(a)
    mb, cb = load_model(b)
    assert ca.model_id == cb.model_id  # the id names the weights, not the folder
    assert ca.model_id != load_model(c)[1].model_id


def test_load_state_dict_errors_are_clear(tiny):
    _, model, cfg, hf = tiny
    sd = dict(hf.state_dict())
    fresh = LlamaModel(cfg)
    bad = dict(sd)
    del bad["model.layers.1.mlp.up_proj.weight"]
    bad["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(WeightLoadError) as e:
        fresh.load_state_dict_hf(bad)
    assert "missing model.layers.1.mlp.up_proj.weight" in str(e.value)
    assert "model.layers.0.self_attn.k_proj.weight: shape (3, 3)" in str(e.value)
    extra = dict(sd)
    extra[f"model.layers.{cfg.num_layers}.mlp.up_proj.weight"] = sd["model.layers.0.mlp.up_proj.weight"]
    with pytest.raises(WeightLoadError, match="beyond num_layers"):
        fresh.load_state_dict_hf(extra)
    with pytest.raises(ValueError, match="1-D"):
        model(torch.tensor([[1, 2]]), torch.tensor([[0, 1]]), ContiguousAttention(cfg.num_layers))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17, 300])
def test_packed_linear_is_the_same_product(rows, dtype):
    """The oneDNN path (weights packed once, used from PACKED_MIN_ROWS rows)
    computes x @ W^T: same values to the dtype's rounding, same shape, a
    contiguous result; without a pack it is F.linear itself."""
    from pdd.model.llama import linear, pack_weight

    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 64, generator=g).to(dtype)
    x = torch.randn(rows, 64, generator=g).to(dtype)
    want = torch.nn.functional.linear(x.double(), w.double())
    packed = pack_weight(w)
    assert packed is not None      # oneDNN is in every CPU build we pin
    got = linear(x, w, packed)
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * 8)
    assert torch.equal(linear(x, w), torch.nn.functional.linear(x, w))


def test_model_packs_its_weights_on_load_and_can_drop_them(tiny_model):
    """load_state_dict_hf packs every weight matrix; logits with and without the packs agree."""
    from model_fixtures import our_logits

    model, _ = tiny_model
    assert model.packed_logits is not None and all(
        p is not None for layer in model.layers for p in layer.packed.values())
    ids = list(range(3, 40))
    try:
        packed = our_logits(model, ids)
        model.pack(False)
        assert model.packed_logits is None and not model.layers[0].packed
        plain = our_logits(model, ids)
    finally:
        model.pack()
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
