"""Our Llama forward pass (gpt-fast style), free of batching, paging and caches.

A flattened list of T tokens goes in, with their absolute positions; attention
is a callback supplied by the caller (the engine's paged attention, or
`pdd.model.reference.ContiguousAttention`):

    attention(layer_idx, q[T, H, D], k[T, KVH, D], v[T, KVH, D]) -> out[T, H, D]

q and k reach the callback after RoPE. The callback owns the KV cache and the
masking (which tokens see which), so one forward can mix tokens of many
requests.

Numerics follow HF `LlamaForCausalLM`: RMSNorm in fp32, RoPE with the
`rotate_half` convention computed in fp32, SiLU-gated MLP. That is the
path fp32 (the exact reference) takes; bf16 layers run the same arithmetic
in fewer passes (`fused.py`, `LlamaBlock.forward_fused`), rounding in other
places.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import ModelConfig
from .fused import fold_norm, linear_add, linear_packed, mlp, rms_scale, rope_
from .huge_pages import HugePageReport, collapse, tensor_span

# Weight matmuls go through oneDNN with each weight reordered once, at load,
# into the blocked layout its kernels read (what torch.compile's CPU freezing
# does). Measured on this CPU, one thread, SmolLM2's 30 layers of matrices
# (ms per pass, 2026-12-04): fp32 with 1 / 3 / 4 / 8 / 16 / 512 rows took
# 38 / 40 / 38 / 44 / 54 / 583 packed against 31 / 35 / 53 / 69 / 72 / 617 as
# `F.linear`; bf16 21 / 21 / 21 / 21 / 22 / 76 packed against 30 / 31 / 31 /
# 32 / 32 / 109 (and 24 as W @ x^T, the old few-rows path, now slower than
# `F.linear` in fp32). So fp32 takes the packed path from 4 rows, bf16
# always. The packed tensors are oneDNN-opaque copies kept beside the plain
# weights (which stay the reference, the embedding, and the few-rows fp32
# path). One pack serves every row count; 16 is only its hint.
# fp32 prompt chunks (hundreds of rows, of every length) stay on `F.linear`:
# the packed kernel is only ~6% faster there, and oneDNN builds and keeps a
# primitive per row count, which grew a prefill instance by ~250 MB over the
# soak test's mix of prompt lengths (decode batches have few row counts).
PACKED_MIN_ROWS = {torch.float32: 4}   # other dtypes: from 1 row
PACKED_MAX_ROWS = {torch.float32: 64}  # other dtypes: no bound
PACK_HINT_ROWS = 16


def pack_weight(w: Tensor) -> Tensor | None:
    """w [out, in] -> an oneDNN-packed copy for `linear`, or None where oneDNN cannot take it."""
    if w.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach(), PACK_HINT_ROWS)
    except (RuntimeError, AttributeError):   # a torch built without the op, or a dtype it refuses
        return None


def linear(x: Tensor, w: Tensor, packed: Tensor | None = None) -> Tensor:
    """x [M, in] @ w[out, in]^T, through the packed copy of w when there is one and M is large enough."""
    m = x.shape[0]
    if packed is not None and PACKED_MIN_ROWS.get(x.dtype, 1) <= m <= PACKED_MAX_ROWS.get(x.dtype, m):
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    return F.linear(x, w)


def residual_linear(residual: Tensor, x: Tensor, w: Tensor, packed: Tensor | None = None) -> Tensor:
    """residual + x @ w^T; through the packed copy, the add is the matmul's post-op (one call, one
    pass: the same fp32 sum of the same two values, so the same bits as a separate add)."""
    m = x.shape[0]
    if packed is not None and PACKED_MIN_ROWS.get(x.dtype, 1) <= m <= PACKED_MAX_ROWS.get(x.dtype, m):
        return linear_add(x, packed, residual)
    return residual + F.linear(x, w)

AttentionFn = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class WeightLoadError(ValueError):
    """An HF state dict does not fit the model config."""


# ---------------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: ModelConfig) -> Tensor:
    """Inverse frequencies [D/2] (fp32), with HF's 'linear' / 'llama3' scaling."""
    d = cfg.head_dim
    inv_freq = 1.0 / (
        cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).to(torch.float32) / d)
    )
    rs = cfg.rope_scaling_dict()
    rt = rs.get("rope_type")
    if rt == "linear":
        inv_freq = inv_freq / rs["factor"]
    elif rt == "llama3":
        factor = rs["factor"]
        low, high = rs["low_freq_factor"], rs["high_freq_factor"]
        old_len = rs["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        inv_freq = torch.where(is_medium, smoothed, scaled)
    elif rt is not None:  # pragma: no cover - ModelConfig validates this
        raise ValueError(f"unsupported rope_type {rt!r}")
    return inv_freq


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def signed_sin(sin: Tensor) -> Tensor:
    """sin [..., D] with its first half negated: rotate_half(x) * sin == roll(x, D/2) * signed_sin(sin),
    exactly (a negation is exact), in one op instead of a chunk, a negation and a cat."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), -1)


def apply_rope_(x: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """x [T, N, D] (any dtype) <- x * cos + rotate_half(x) * sin, in place, computed in fp32
    (cos, sin_signed [T, 1, D] fp32): HF's arithmetic and rounding, in fewer passes; in place, so
    the k it rotates stays next to v in the qkv output (one K/V copy into the cache)."""
    if x.dtype == torch.float32:
        r = x.roll(x.shape[-1] // 2, -1).mul_(sin_signed)
        return x.mul_(cos).add_(r)
    xf = x.float()
    r = xf.roll(x.shape[-1] // 2, -1).mul_(sin_signed)
    return x.copy_(xf.mul_(cos).add_(r))


# ---------------------------------------------------------------------- layers
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.eps_t = torch.full((1, 1), eps)   # for fused.rms_scale
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        # x: [T, hidden]; statistics in fp32 exactly as HF LlamaRMSNorm
        # in place where it can be: the same ops, fewer tensors (fp32 skips the two no-op casts)
        if x.dtype == torch.float32:
            return self.weight * (x * x.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_())
        xf = x.float()
        s = xf.pow(2).mean(-1, keepdim=True).add_(self.eps).rsqrt_()
        return self.weight * (xf * s).to(x.dtype)


def _empty_param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    # torch.empty: no random init (weights come from load_state_dict_hf)
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.inter = cfg.intermediate_size
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.wqkv = _empty_param(self.q_size + 2 * self.kv_size, cfg.hidden_size, dtype=dtype)
        self.wo = _empty_param(cfg.hidden_size, self.q_size, dtype=dtype)
        self.w_gate_up = _empty_param(2 * cfg.intermediate_size, cfg.hidden_size, dtype=dtype)
        self.w_down = _empty_param(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)
        self.packed: dict[str, Tensor | None] = {}   # weight name -> pack_weight copy (set by pack)
        self.fused = False                            # forward_fused, with its own packs (set by pack)

    def pack(self, enabled: bool = True) -> None:
        """Packed copies for `linear`; in bf16, the fused path's copies instead (norm
        weights folded in, gate and up apart: `fused.py`), where oneDNN takes them all."""
        self.packed, self.fused = {}, False
        if not enabled:
            return
        if self.wqkv.dtype == torch.bfloat16:
            I = self.inter
            g1, g2 = self.input_layernorm.weight, self.post_attention_layernorm.weight
            folded = {"wqkv": fold_norm(self.wqkv, g1), "wo": self.wo,
                      "w_gate": fold_norm(self.w_gate_up[:I], g2), "w_up": fold_norm(self.w_gate_up[I:], g2),
                      "w_down": self.w_down}
            packed = {n: pack_weight(w) for n, w in folded.items()}
            if all(p is not None for p in packed.values()):
                self.packed, self.fused = packed, True
                return
        names = ("wqkv", "wo", "w_gate_up", "w_down")
        self.packed = {n: pack_weight(getattr(self, n)) for n in names}

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention: AttentionFn) -> Tensor:
        """x: [T, hidden]; cos, sin [T, 1, D]: fp32, sin with its first half negated (`signed_sin`)."""
        if self.fused:
            return self.forward_fused(x, cos, sin, attention)
        T = x.shape[0]
        h = self.input_layernorm(x)
        pk = self.packed
        H, KVH = self.num_heads, self.num_kv_heads
        qkv = linear(h, self.wqkv, pk.get("wqkv")).view(T, H + 2 * KVH, self.head_dim)  # [T, H + 2*KVH, D]
        # RoPE on q and k in one pass, in place (same arithmetic per element as two, fewer ops)
        q, k = apply_rope_(qkv[:, : H + KVH], cos, sin).split([H, KVH], dim=1)  # [T, H, D], [T, KVH, D]
        o = attention(self.layer_idx, q, k, qkv[:, H + KVH :])  # o: [T, H, D]
        x = residual_linear(x, o.reshape(T, self.q_size), self.wo, pk.get("wo"))  # [T, hidden]
        h = self.post_attention_layernorm(x)
        gate_up = linear(h, self.w_gate_up, pk.get("w_gate_up"))  # gate_up: [T, 2*I]
        gate, up = gate_up.split([self.inter, self.inter], dim=-1)
        return residual_linear(x, F.silu(gate) * up, self.w_down, pk.get("w_down"))  # [T, hidden]

    def forward_fused(self, x: Tensor, cos: Tensor, sin_signed: Tensor, attention: AttentionFn) -> Tensor:
        """`forward` in fewer passes (bf16; `fused.py`): cos, sin_signed [T, 1, D] in x's dtype."""
        T = x.shape[0]
        pk = self.packed
        H, KVH = self.num_heads, self.num_kv_heads
        h = rms_scale(x, self.input_layernorm.eps_t)  # [T, hidden], the norm's weight is in wqkv
        qkv = linear_packed(h, pk["wqkv"]).view(T, H + 2 * KVH, self.head_dim)  # [T, H + 2*KVH, D]
        q, k = rope_(qkv[:, : H + KVH], cos, sin_signed).split([H, KVH], dim=1)  # [T, H, D], [T, KVH, D]
        o = attention(self.layer_idx, q, k, qkv[:, H + KVH :])  # o: [T, H, D]
        x = linear_add(o.reshape(T, self.q_size), pk["wo"], x)  # [T, hidden]
        h = rms_scale(x, self.post_attention_layernorm.eps_t)
        return linear_add(mlp(h, pk["w_gate"], pk["w_up"]), pk["w_down"], x)  # [T, hidden]


class LlamaModel(nn.Module):
    """Llama decoder. `forward` returns final-normed hidden states; `compute_logits` the fp32 logits."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = _empty_param(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaBlock(cfg, i, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else _empty_param(
            cfg.vocab_size, cfg.hidden_size, dtype=dtype
        )
        self.packed_logits: Tensor | None = None
        self.huge_pages: HugePageReport | None = None  # set by weights_on_huge_pages
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._build_rope_cache(cfg.max_position_embeddings)

    # ------------------------------------------------------------------ RoPE cache
    def _build_rope_cache(self, n: int) -> None:
        pos = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
        freqs = pos[:, None] * self.inv_freq[None, :]  # [n, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, D]
        # cos, signed sin: [n, 1, D] fp32 (the 1 broadcasts over heads)
        self.register_buffer("rope_cos", emb.cos().unsqueeze(1), persistent=False)
        self.register_buffer("rope_sin_signed", signed_sin(emb.sin()).unsqueeze(1), persistent=False)

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if positions.numel():
            top = int(positions.max())
            if top >= self.rope_cos.shape[0]:
                # beyond max_position_embeddings: grow (quality is the model's business)
                self._build_rope_cache(max(top + 1, 2 * self.rope_cos.shape[0]))
        return self.rope_cos[positions], self.rope_sin_signed[positions]  # [T, 1, D] each, sin signed_sin

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: Tensor, positions: Tensor, attention: AttentionFn) -> Tensor:
        """input_ids, positions: LongTensor[T] -> final-normed hidden [T, hidden]."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must be 1-D of equal length, got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        cos, sin = self._rope(positions)               # sin: first half negated (signed_sin)
        if self.layers and self.layers[0].fused:      # bf16 RoPE, as HF's Llama in bf16 (fused.rope_)
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        x = F.embedding(input_ids, self.embed_tokens)  # x: [T, hidden]
        for layer in self.layers:
            x = layer.forward(x, cos, sin, attention)  # (no module hooks: forward itself, 30 calls a step)
        return self.norm(x)

    def compute_logits(self, hidden: Tensor, fp32: bool = True) -> Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in fp32, or with fp32=False in the model's dtype
        (the same values: fp32 holds every bf16 value exactly; a sampler that upcasts needs no copy)."""
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        logits = linear(hidden, w, self.packed_logits)
        return logits.float() if fp32 else logits

    def pack(self, enabled: bool = True) -> None:
        """Make (or, with enabled=False, drop) the packed weight copies `linear` uses.
        Called once the weights are loaded; a later change to a weight needs another call."""
        for layer in self.layers:
            layer.pack(enabled)
        w = self.embed_tokens if self.lm_head is None else self.lm_head
        self.packed_logits = pack_weight(w) if enabled else None
        self.huge_pages = None   # new copies, on whatever pages the allocator gave them

    def packed_weights(self) -> list[Tensor]:
        """Every packed copy (what a decode step of 4+ rows reads, all of it, every step)."""
        out = [p for layer in self.layers for p in layer.packed.values() if p is not None]
        return out + ([self.packed_logits] if self.packed_logits is not None else [])

    def weights_on_huge_pages(self) -> HugePageReport:
        """Rebuild the packed copies' memory as 2 MB pages (`huge_pages.collapse`), once per pack:
        a later call returns the first call's report."""
        if self.huge_pages is None:
            self.huge_pages = collapse(tensor_span(t) for t in self.packed_weights())
        return self.huge_pages

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_state_dict_hf(self, tensors: Mapping[str, Tensor]) -> None:
        """Load HF Llama per-matrix weights (fusing q/k/v and gate/up).

        Raises WeightLoadError naming every missing or mis-shaped tensor.
        Unknown extra tensors (e.g. rotary inv_freq) are ignored;
        lm_head.weight is ignored when the embeddings are tied.
        """
        cfg = self.cfg
        H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
        problems: list[str] = []

        def get(name: str, shape: tuple[int, ...]) -> Tensor | None:
            t = tensors.get(name)
            if t is None:
                problems.append(f"missing {name}")
                return None
            if tuple(t.shape) != shape:
                problems.append(f"{name}: shape {tuple(t.shape)}, expected {shape}")
                return None
            return t

        plan: list[tuple[Tensor, list[Tensor | None]]] = []
        plan.append((self.embed_tokens, [get("model.embed_tokens.weight", (V, H))]))
        plan.append((self.norm.weight, [get("model.norm.weight", (H,))]))
        if self.lm_head is not None:
            plan.append((self.lm_head, [get("lm_head.weight", (V, H))]))
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            plan.append((layer.input_layernorm.weight, [get(p + "input_layernorm.weight", (H,))]))
            plan.append(
                (layer.post_attention_layernorm.weight, [get(p + "post_attention_layernorm.weight", (H,))])
            )
            plan.append(
                (
                    layer.wqkv,
                    [
                        get(p + "self_attn.q_proj.weight", (cfg.q_size, H)),
                        get(p + "self_attn.k_proj.weight", (cfg.kv_size, H)),
                        get(p + "self_attn.v_proj.weight", (cfg.kv_size, H)),
                    ],
                )
            )
            plan.append((layer.wo, [get(p + "self_attn.o_proj.weight", (H, cfg.q_size))]))
            plan.append(
                (
                    layer.w_gate_up,
                    [get(p + "mlp.gate_proj.weight", (I, H)), get(p + "mlp.up_proj.weight", (I, H))],
                )
            )
            plan.append((layer.w_down, [get(p + "mlp.down_proj.weight", (H, I))]))
        extra_layers = sorted(
            {n for n in tensors if n.startswith("model.layers.") and int(n.split(".")[2]) >= cfg.num_layers}
        )
        if extra_layers:
            problems.append(
                f"state dict has layers beyond num_layers={cfg.num_layers}: e.g. {extra_layers[0]}"
            )
        if problems:
            shown = "; ".join(problems[:8]) + (f"; ... ({len(problems)} problems)" if len(problems) > 8 else "")
            raise WeightLoadError(f"HF weights do not match the config: {shown}")
        for dst, srcs in plan:
            off = 0
            for s in srcs:
                assert s is not None
                n = s.shape[0]
                dst[off : off + n].copy_(s)
                off += n
        self.pack()
