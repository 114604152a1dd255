"""A bf16 layer's elementwise work in fewer passes, from library kernels only.

In a bf16 prompt pass the weight matmuls (oneDNN with AMX) are fast enough
that the elementwise ops around them cost as much: each torch op is one more
pass over the activations, and bf16 elementwise kernels run well below
memory speed here (measured before this module, SmolLM2-135M, 2,048-token
prefill, one thread: SDPA 604 ms, matmuls 448 ms, elementwise ops and dtype
conversions ~820 ms). So in bf16 (`LlamaBlock.forward_fused`):

* RMSNorm's weight is folded into the matrix that reads the norm's output
  (`w * g[None, :]`, rounded once to bf16 at load), and the norm itself is
  one fp32-accumulated reduction (`vector_norm`) plus one scaling pass
  (`rms_scale`), instead of eight passes (two of them dtype conversions);
* RoPE runs in bf16 with bf16 cos/sin, as HF's Llama does for a bf16 model
  (`rope_`: a roll, then in-place multiply and multiply-add on q and k);
* the residual adds and the MLP's SiLU-and-multiply are oneDNN post-ops of
  the matmuls (`linear_add`, `mlp`): the gate matmul applies SiLU (oneDNN's
  "swish") as it writes, the up matmul multiplies by the gate as it writes,
  and the o and down projections add the residual as they write, each
  accumulating in fp32 and rounding once.

fp32 (and fp16) keep the plain path (`LlamaBlock.forward`): fp32 is the exact reference.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rms_scale(x: Tensor, eps: Tensor) -> Tensor:
    """x [T, hidden] -> x * rsqrt(mean(x^2) + eps), statistics in fp32, result in x.dtype
    (RMSNorm without its weight, which the next matmul's weight carries); eps: [1, 1] fp32
    (a tensor, so that eps + n^2 / hidden is one op: a decode step runs 60 of these)."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)  # [T, 1]
    s = torch.addcmul(eps, n, n, value=1.0 / x.shape[-1]).rsqrt_()              # [T, 1] fp32
    # the scale rounded to bf16 first: one bf16 pass (1.0 ms at 2,048 x 576) where
    # multiplying by the fp32 scale into a bf16 result takes 3.8; a row's values move by
    # at most one bf16 step (27% of them do), as one more rounding would move them
    return x * s.to(x.dtype)


def rope_(qk: Tensor, cos: Tensor, sin_signed: Tensor) -> Tensor:
    """RoPE in place on qk [T, N, D] (rotate_half convention); cos, sin_signed [T, 1, D] in qk's
    dtype, sin_signed = sin with its first half negated, so rotate_half(x) * sin = roll(x) * sin_signed.
    (Expanded to [T, N, D] once per forward, cos and sin made these two passes 2x slower in
    a 2,048-token prefill: 3 MB more to read each.)"""
    r = qk.roll(qk.shape[-1] // 2, -1)          # [x2, x1]
    return qk.mul_(cos).addcmul_(r, sin_signed)


def linear_packed(x: Tensor, packed: Tensor) -> Tensor:
    """x @ W^T (W packed by `llama.pack_weight`)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def linear_add(x: Tensor, packed: Tensor, residual: Tensor) -> Tensor:
    """residual + x @ W^T in one oneDNN call (W packed by `llama.pack_weight`)."""
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, None, "add")


def mlp(h: Tensor, gate: Tensor, up: Tensor) -> Tensor:
    """silu(h @ Wg^T) * (h @ Wu^T), SiLU and the product as post-ops: [T, inter]."""
    g = torch.ops.mkldnn._linear_pointwise(h, gate, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(h, g, up, None, "mul")


def fold_norm(w: Tensor, g: Tensor) -> Tensor:
    """w [out, in] times an RMSNorm weight g [in] along its input dim, in fp32, rounded once."""
    return (w.float() * g.float()[None, :]).to(w.dtype)
