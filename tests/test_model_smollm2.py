"""The real SmolLM2-135M-Instruct (converted from the embedded GGUF): ours vs HF, fp32.

Tolerance: max |logit diff| < 1e-3 on logits of magnitude ~30 (measured ~1e-5).
"""

import pytest
import torch
from model_fixtures import default_model_path, hf_greedy, hf_logits, our_logits

from pdd.model.loader import load_model
from pdd.model.reference import generate_greedy
from pdd.model.tokenizer import Tokenizer

pytestmark = pytest.mark.slow
TOL = 1e-3


@pytest.fixture(scope="module")
def smol():
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model, cfg = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, cfg, hf, Tokenizer(path)


def test_config(smol):
    _, _, cfg, _, tok = smol
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == (2,) and tok.eos_token_ids == (2,)
    assert cfg.kv_bytes_per_token(2) == 23040


def test_logits_match_hf(smol):
    _, model, _, hf, tok = smol
    ids = tok.encode("The capital of France is Paris. The capital of Germany is Berlin, and the capital of")
    assert 16 <= len(ids) <= 24
    diff = (our_logits(model, ids) - hf_logits(hf, ids)).abs().max().item()
    assert diff < TOL


def test_greedy_matches_hf_generate_on_chat(smol):
    _, model, cfg, hf, tok = smol
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ours = generate_greedy(model, ids, 24, eos_token_ids=cfg.eos_token_ids)
    assert ours == hf_greedy(hf, ids, 24)
    assert "Paris" in tok.decode(ours)
