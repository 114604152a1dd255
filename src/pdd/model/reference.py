"""Contiguous (unpaged) attention for ONE sequence, and greedy generation with it.

The correctness reference for the paged engine: simple on purpose.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from .llama import LlamaModel


class ContiguousAttention:
    """Attention callback with a growing per-layer K/V cache for one sequence.

    Tokens must be fed in order: each call appends its k/v after the cached ones
    and the queries are the last T positions (causal).
    """

    def __init__(self, num_layers: int, initial_capacity: int = 256) -> None:
        self.num_layers = num_layers
        self._cap = initial_capacity
        self._k: list[Tensor | None] = [None] * num_layers  # [cap, KVH, D]
        self._v: list[Tensor | None] = [None] * num_layers
        self._len = [0] * num_layers

    @property
    def seq_len(self) -> int:
        """Tokens cached (by the last layer, i.e. after a complete forward)."""
        return self._len[-1]

    def reset(self) -> None:
        self._k = [None] * self.num_layers
        self._v = [None] * self.num_layers
        self._len = [0] * self.num_layers

    def kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """The cached k, v of a layer: [L, KVH, D] each (views)."""
        n = self._len[layer]
        assert self._k[layer] is not None and self._v[layer] is not None
        return self._k[layer][:n], self._v[layer][:n]

    def _append(self, layer: int, k: Tensor, v: Tensor) -> None:
        n, t = self._len[layer], k.shape[0]
        kc = self._k[layer]
        if kc is None or n + t > kc.shape[0]:
            cap = max(self._cap, 2 * (n + t))
            newk = k.new_empty((cap,) + tuple(k.shape[1:]))
            newv = v.new_empty((cap,) + tuple(v.shape[1:]))
            if kc is not None:
                newk[:n] = kc[:n]
                newv[:n] = self._v[layer][:n]  # type: ignore[index]
            self._k[layer], self._v[layer] = newk, newv
        self._k[layer][n : n + t] = k  # type: ignore[index]
        self._v[layer][n : n + t] = v  # type: ignore[index]
        self._len[layer] = n + t

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        # q: [T, H, D]; k, v: [T, KVH, D]
        T = q.shape[0]
        self._append(layer, k, v)
        K, V = self.kv(layer)  # K, V: [L, KVH, D]
        L = K.shape[0]
        # 4-D inputs: the CPU flash kernel is only taken for [B, H, T, D] (3-D falls
        # back to the ~3x slower math path)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        kh = K.transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        vh = V.transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        if T == 1:
            mask = None  # the newest token sees everything
            causal = False
        elif T == L:
            mask, causal = None, True
        else:
            # query i sits at absolute position L - T + i and sees keys j <= L - T + i
            qpos = torch.arange(L - T, L, device=q.device)[:, None]
            mask = torch.arange(L, device=q.device)[None, :] <= qpos  # [T, L] bool
            causal = False
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, is_causal=causal, enable_gqa=True)
        return out[0].transpose(0, 1)  # [T, H, D]


@torch.inference_mode()
def generate_greedy(
    model: LlamaModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Iterable[int] = (),
) -> list[int]:
    """Greedy decoding of one sequence; returns the new tokens only.

    Stops after an eos token (included in the output) if ``eos_token_ids`` is
    given; by default runs exactly ``max_new_tokens`` steps.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    eos = set(int(e) for e in eos_token_ids)
    device = model.embed_tokens.device
    attn = ContiguousAttention(model.cfg.num_layers, initial_capacity=len(prompt_ids) + max_new_tokens)
    ids = torch.tensor(list(prompt_ids), dtype=torch.long, device=device)
    pos = torch.arange(len(prompt_ids), dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        hidden = model(ids, pos, attn)  # [T, hidden]
        nxt = int(model.compute_logits(hidden[-1:]).argmax(dim=-1))
        out.append(nxt)
        if nxt in eos:
            break
        ids = torch.tensor([nxt], dtype=torch.long, device=device)
        pos = torch.tensor([attn.seq_len], dtype=torch.long, device=device)
    return out
