"""`ModelConfig`: the few numbers our Llama forward needs, read from an HF config.json.

Pure Python (no torch) so that policy / planning code can import it cheaply.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

# RoPE variants we implement (see pdd.model.llama.rope_inv_freq).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_MODEL_TYPES = ("llama",)


@dataclass(frozen=True)
class ModelConfig:
    model_id: str  # stable digest naming the weights (used to refuse foreign KV)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # RoPE scaling as sorted (key, value) pairs, () for plain RoPE. Hashable on purpose.
    # Keys: "rope_type" ("linear" | "llama3"), "factor", and for llama3
    # "low_freq_factor", "high_freq_factor", "original_max_position_embeddings".
    rope_scaling: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid ModelConfig: {msg}")

        if not isinstance(self.model_id, str) or not self.model_id:
            raise bad(f"model_id must be a non-empty string, got {self.model_id!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise bad(f"{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise bad(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2 != 0:
            raise bad(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise bad(f"{name} must be a positive finite number, got {v!r}")
        if not isinstance(self.tie_word_embeddings, bool):
            raise bad(f"tie_word_embeddings must be a bool, got {self.tie_word_embeddings!r}")
        if self.bos_token_id is not None and not (0 <= self.bos_token_id < self.vocab_size):
            raise bad(f"bos_token_id {self.bos_token_id} outside vocab [0, {self.vocab_size})")
        if not isinstance(self.eos_token_ids, tuple):
            raise bad(f"eos_token_ids must be a tuple, got {type(self.eos_token_ids).__name__}")
        for e in self.eos_token_ids:
            if isinstance(e, bool) or not isinstance(e, int) or not (0 <= e < self.vocab_size):
                raise bad(f"eos token id {e!r} outside vocab [0, {self.vocab_size})")
        rs = dict(self.rope_scaling)
        if rs:
            rt = rs.get("rope_type")
            if rt not in ("linear", "llama3"):
                raise bad(f"rope_scaling rope_type {rt!r} not supported (have {SUPPORTED_ROPE_TYPES})")
            need = ["factor"]
            if rt == "llama3":
                need += ["low_freq_factor", "high_freq_factor", "original_max_position_embeddings"]
            for k in need:
                if k not in rs:
                    raise bad(f"rope_scaling of type {rt!r} lacks {k!r}")

    # ------------------------------------------------------------------ helpers
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def kv_bytes_per_token(self, dtype_bytes: int = 4) -> int:
        """Bytes of K and V over all layers for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def rope_scaling_dict(self) -> dict[str, Any]:
        return dict(self.rope_scaling)

    # ------------------------------------------------------------------ from HF
    @classmethod
    def from_hf_config(
        cls,
        hf: Mapping[str, Any],
        model_id: str,
        extra_eos_token_ids: tuple[int, ...] | list[int] = (),
    ) -> "ModelConfig":
        """Build from an HF config.json dict. Raises ValueError on what we cannot run.

        ``extra_eos_token_ids`` (e.g. from generation_config.json) are appended to
        the config's own ``eos_token_id``.
        """
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported; pdd implements {SUPPORTED_MODEL_TYPES}"
            )
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("attention_bias / mlp_bias = true is not supported by pdd's Llama")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act {act!r} not supported (only 'silu')")
        if hf.get("pretraining_tp", 1) not in (1, None):
            raise ValueError("pretraining_tp > 1 is not supported")

        def req(key: str) -> Any:
            if key not in hf or hf[key] is None:
                raise ValueError(f"HF config lacks required key {key!r}")
            return hf[key]

        hidden = int(req("hidden_size"))
        heads = int(req("num_attention_heads"))
        kv_heads = int(hf.get("num_key_value_heads") or heads)
        head_dim = hf.get("head_dim") or (hidden // heads)

        # RoPE: transformers v5 writes `rope_parameters` {rope_theta, rope_type, ...};
        # older configs use top-level `rope_theta` plus `rope_scaling`.
        params = dict(hf.get("rope_parameters") or {})
        old_scaling = hf.get("rope_scaling")
        if old_scaling:
            old = dict(old_scaling)
            if "rope_type" not in old and "type" in old:  # very old spelling
                old["rope_type"] = old["type"]
            params = {**params, **old}
        theta = params.get("rope_theta", hf.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default")) or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"RoPE scaling type {rope_type!r} is not implemented by pdd "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")
        rope_scaling: tuple[tuple[str, Any], ...] = ()
        if rope_type != "default":
            keep = {"rope_type": rope_type, "factor": float(params.get("factor", 1.0))}
            if rope_type == "llama3":
                for k in ("low_freq_factor", "high_freq_factor"):
                    if k not in params:
                        raise ValueError(f"llama3 rope scaling lacks {k!r}")
                    keep[k] = float(params[k])
                keep["original_max_position_embeddings"] = int(
                    params.get("original_max_position_embeddings")
                    or hf.get("max_position_embeddings")
                )
            rope_scaling = tuple(sorted(keep.items()))

        eos_raw = hf.get("eos_token_id")
        if eos_raw is None:
            eos: list[int] = []
        elif isinstance(eos_raw, (list, tuple)):
            eos = [int(e) for e in eos_raw]
        else:
            eos = [int(eos_raw)]
        for e in extra_eos_token_ids:
            if int(e) not in eos:
                eos.append(int(e))
        bos = hf.get("bos_token_id")
        return cls(
            model_id=model_id,
            vocab_size=int(req("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(req("intermediate_size")),
            num_layers=int(req("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=tuple(eos),
            rope_scaling=rope_scaling,
        )
