"""Shared helpers for the model tests (import with `from model_fixtures import ...`)."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

torch.set_num_threads(1)


def default_model_path():
    """The converted SmolLM2 folder (`make test` prepares it first via `make model`)."""
    from pdd.model.loader import default_cache_dir, prepare_default_model

    return prepare_default_model(default_cache_dir())


def hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


def our_logits(model, ids: list[int]) -> torch.Tensor:
    from pdd.model.reference import ContiguousAttention

    with torch.inference_mode():
        attn = ContiguousAttention(model.cfg.num_layers)
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), attn)
        return model.compute_logits(hidden)


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            pad_token_id=hf_model.config.eos_token_id if isinstance(hf_model.config.eos_token_id, int) else 0,
        )
    return out[0, len(ids):].tolist()
