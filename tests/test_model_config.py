import dataclasses
import math

import pytest

from pdd.model.config import ModelConfig

SMOL = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
    "max_position_embeddings": 8192,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_from_hf_config_smollm2():
    cfg = ModelConfig.from_hf_config(SMOL, "mid")
    assert cfg.num_layers == 30 and cfg.num_kv_heads == 3 and cfg.head_dim == 64
    assert cfg.rope_theta == 100000.0 and cfg.rope_scaling == ()
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1 and cfg.tie_word_embeddings
    assert cfg.kv_bytes_per_token() == 2 * 30 * 3 * 64 * 4 == 46080
    assert cfg.kv_bytes_per_token(2) == 23040
    hash(cfg)  # frozen and hashable
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_layers = 3  # type: ignore[misc]


def test_old_style_rope_and_eos_list():
    hf = {k: v for k, v in SMOL.items() if k not in ("rope_parameters", "head_dim", "num_key_value_heads")}
    hf.update(rope_theta=500000.0, eos_token_id=[2, 0])
    cfg = ModelConfig.from_hf_config(hf, "mid", extra_eos_token_ids=[0, 7])
    assert cfg.rope_theta == 500000.0 and cfg.head_dim == 64 and cfg.num_kv_heads == 9
    assert cfg.eos_token_ids == (2, 0, 7)


@pytest.mark.parametrize("scaling", [{"rope_type": "yarn", "factor": 4.0}, {"type": "dynamic", "factor": 2.0}])
def test_unsupported_rope_scaling_is_a_clear_error(scaling):
    with pytest.raises(ValueError, match="not implemented"):
        ModelConfig.from_hf_config({**SMOL, "rope_scaling": scaling}, "mid")


def test_llama3_rope_matches_hf():
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pdd.model.llama import rope_inv_freq

    rp = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf = {**SMOL, "rope_parameters": rp, "max_position_embeddings": 131072}
    cfg = ModelConfig.from_hf_config(hf, "mid")
    assert dict(cfg.rope_scaling)["rope_type"] == "llama3"
    hfc = LlamaConfig(**{k: v for k, v in hf.items() if k != "model_type"})
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hfc, torch.device("cpu"))
    assert torch.allclose(rope_inv_freq(cfg), ref, rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"num_key_value_heads": 4}, "multiple"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"eos_token_id": 50000}, "eos"),
        ({"rms_norm_eps": -1.0}, "rms_norm_eps"),
        ({"rope_parameters": {"rope_theta": math.inf}}, "rope_theta"),
        ({"model_type": "qwen2"}, "model_type"),
        ({"attention_bias": True}, "bias"),
    ],
)
def test_validation_errors(change, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config({**SMOL, **change}, "mid")


def test_empty_model_id_rejected():
    with pytest.raises(ValueError, match="model_id"):
        ModelConfig.from_hf_config(SMOL, "")


def test_package_import_is_lazy():
    import subprocess
    import sys

    code = "import sys, pdd.model, pdd.model.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
