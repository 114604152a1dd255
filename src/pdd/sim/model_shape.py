"""The model as the cost model sees it: parameter and KV byte counts, FLOPs.

Only what step time depends on: weights read per step (all of them for a
dense model; for an MoE, the experts the step's tokens touch), 2 FLOPs per
active parameter per token, attention FLOPs per (query, key) pair, and KV
bytes per token (given, since MLA / GQA / FP8 KV differ too much to derive).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_heads: int
    head_dim: int
    hidden_size: int
    total_params: float
    active_params: float          # per token (== total for a dense model)
    weight_bytes_per_param: float
    kv_bytes_per_token: int

    def __post_init__(self) -> None:
        if not 0 < self.active_params <= self.total_params:
            raise ValueError(f"{self.name}: need 0 < active_params <= total_params")
        if min(self.num_layers, self.num_heads, self.head_dim, self.hidden_size,
               self.kv_bytes_per_token) <= 0 or self.weight_bytes_per_param <= 0:
            raise ValueError(f"{self.name}: sizes must be positive")

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_bytes_per_param

    def linear_flops(self, num_tokens: int) -> float:
        return 2.0 * self.active_params * num_tokens

    def attention_flops(self, num_pairs: float) -> float:
        # QK^T and PV: 2 FLOPs per multiply-add, 2 matmuls, per head dim, per layer.
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * num_pairs

    def weight_read_bytes(self, num_tokens: int) -> float:
        # An MoE step touches more experts as it carries more tokens.
        touched = min(self.total_params, self.active_params * max(num_tokens, 1))
        return touched * self.weight_bytes_per_param

    def allreduce_bytes(self, num_tokens: int) -> float:
        # Two all-reduces per layer (attention out, MLP out) of [T, hidden] activations.
        return 2.0 * self.num_layers * num_tokens * self.hidden_size * 2


PRESETS: dict[str, ModelShape] = {m.name: m for m in (
    # A ~235B-total / 22B-active MoE in FP8 with ~50 KB of KV per token: the
    # report's "~50 KB typical", at a size four chips can hold.
    ModelShape("report-moe", 94, 64, 128, 4096, 235e9, 22e9, 1.0, 51_200),
    ModelShape("llama3-70b", 80, 64, 128, 8192, 70.6e9, 70.6e9, 2.0, 327_680),
    ModelShape("llama3-8b", 32, 32, 128, 4096, 8.0e9, 8.0e9, 2.0, 131_072),
    # The embedded SmolLM2-135M as our CPU engine runs it (FP32).
    ModelShape("smollm2-135m", 30, 9, 64, 576, 134.5e6, 134.5e6, 4.0, 46_080),
)}


def get_model(name: str, **overrides) -> ModelShape:
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; known: {sorted(PRESETS)}") from None
    return replace(base, **overrides) if overrides else base
