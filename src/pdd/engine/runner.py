"""Carries out a StepPlan with the model over the paged KV tensors.

Owns the KV storage: one tensor [L, 2, num_blocks * block_size, KVH, D]; a
block is the slot range [b * block_size, (b + 1) * block_size). It also reads
and writes whole blocks as bytes for KV export and import.
"""

from __future__ import annotations

import numpy as np
import torch

from pdd.engine.config import EngineConfig
from pdd.engine.decode_rows import DecodeRows
from pdd.engine.kv_codec import layers_per_part
from pdd.engine.attention_kernels import decode_kernel
from pdd.engine.native_attention import use_kernel
from pdd.engine.paged_attention import PagedAttention, build_metadata
from pdd.engine.sampler import sample
from pdd.engine.scheduler import StepPlan

class StepProgress:
    """The step under way, for readers on other threads: which tokens of which
    requests it computes, and how many layers' KV it has written so far. A
    layer's KV for those tokens is final once written, so P can send it while
    the step computes the next layers (layer-wise KV streaming)."""

    def __init__(self, step: int, spans: dict[str, tuple[int, int]], notify=None,
                 every: int = 1, num_layers: int = 0):
        self.step = step
        self.spans = spans              # request id -> [start, end) tokens this step computes
        self.layers_written = 0
        # Called (on the engine thread) once every `every` layers' KV is
        # written, and after the last layer: a streamed copy sends a block's
        # layers in parts of that many (`kv_codec.layers_per_part`), so a
        # wake-up per layer found nothing to send five times in six and cost
        # P's core a thread switch each time.
        self.notify = notify
        self.every = max(int(every), 1)
        self.num_layers = num_layers

    def wrote(self, layers: int) -> None:
        self.layers_written = layers
        if self.notify is not None and (layers % self.every == 0 or layers == self.num_layers):
            self.notify()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, model, model_cfg, cfg: EngineConfig):
        self.model = model
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        model_dtype = getattr(model, "dtype", self.dtype)
        if model_dtype != self.dtype:
            raise ValueError(f"engine.dtype is {cfg.dtype} but the model's weights are {model_dtype}: "
                             f"load the model in the engine's dtype")
        # the packed weights on 2 MB pages, once per model (None: not asked)
        self.huge_pages = model.weights_on_huge_pages() if cfg.huge_pages and hasattr(
            model, "weights_on_huge_pages") else None
        self.kv = torch.zeros(
            model_cfg.num_layers, 2, cfg.num_blocks * cfg.block_size,
            model_cfg.num_kv_heads, model_cfg.head_dim, dtype=self.dtype,
        )  # [L, 2, S, KVH, D]
        self.kv_layers = self.kv.unbind(0)   # kv[l] per layer, made once
        # bf16 / fp32: every sequence of a step attended by our kernel (AVX512-BF16 / AVX-512F)
        # where it runs, else SDPA
        self.native = use_kernel(cfg.attention, self.dtype, model_cfg.head_dim, cfg.num_threads)
        # decodes in bf16 / fp16 otherwise: SDPA on the dtype or the fp32 kernel, measured once per process
        self.decode_kernel = "native" if self.native else decode_kernel(
            cfg.decode_attention, self.dtype, model_cfg.num_kv_heads, model_cfg.head_dim,
            model_cfg.num_heads // model_cfg.num_kv_heads)
        self.num_steps = 0
        self.progress: StepProgress | None = None
        # Called on the engine thread when a step starts (which requests it
        # computes is known: `progress.spans`) and each time a streamed part's
        # layers are written (`progress.layers_written`; every
        # `layers_per_notify` layers and the last), so that readers waiting
        # for either wake up instead of polling.
        self.on_step_start = None
        self.on_progress = None
        self.layers_per_notify = layers_per_part(self.block_bytes, self.num_layers)
        # running decodes' contexts kept contiguous between steps (None: always gather)
        # (in the engine's dtype under either decode kernel: rows kept in fp32 and attended
        # without a copy decoded 0.89-0.94x as fast as bf16 rows copied to a compact fp32
        # buffer each layer, batch 8-16, 128-token prompts, on the AMD EPYC of docs/DESIGN.md)
        # (not with our kernels: they read every context in place through the block table)
        self.rows: DecodeRows | None = DecodeRows(
            model_cfg.num_layers, model_cfg.num_kv_heads, model_cfg.head_dim, self.dtype, cfg.block_size,
        ) if cfg.decode_rows and not self.native else None

    @property
    def block_bytes(self) -> int:
        return self.kv[:, :, : self.cfg.block_size].numel() * self.kv.element_size()

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> list[int | None]:
        """Runs one forward pass; returns a sampled token per seq (None if not sampled)."""
        ids, pos, seqs, decodes = [], [], [], []
        for s in plan.seqs:
            r = s.request
            ids.extend(r.token_ids[s.start : s.start + s.num_tokens])
            pos.extend(range(s.start, s.start + s.num_tokens))
            seqs.append((s.start, s.num_tokens, r.block_ids))
            if s.num_tokens == 1:
                decodes.append((r.request_id, s.start + 1, r.block_ids))
        rows = None
        if self.rows is not None:
            rp = self.rows.prepare(decodes, self.kv) if decodes else None
            if rp is None:
                self.rows.clear()
            else:
                rows = (self.rows, rp)
        md = build_metadata(seqs, self.cfg.block_size, rows=rows, native=self.native)
        self.num_steps += 1
        progress = StepProgress(self.num_steps, {s.request.request_id: (s.start, s.start + s.num_tokens)
                                                 for s in plan.seqs}, self.on_progress,
                                self.layers_per_notify, self.num_layers)
        self.progress = progress
        if self.on_step_start is not None:
            self.on_step_start()
        try:
            hidden = self.model.forward(
                torch.tensor(ids), torch.tensor(pos), PagedAttention(self.kv, md, progress, self.kv_layers,
                                                                  self.decode_kernel)
            )  # [T, hidden]
        except BaseException:
            if self.rows is not None:
                self.rows.clear()    # some layers may hold this step's token, others not
            raise
        if self.rows is not None:
            self.rows.commit()
        last, params, positions, rows = [], [], [], []
        tok = 0
        for i, s in enumerate(plan.seqs):
            tok += s.num_tokens
            if s.sample:
                last.append(tok - 1)
                params.append(s.request.sampling)
                positions.append(s.start + s.num_tokens)
                rows.append(i)
        out: list[int | None] = [None] * len(plan.seqs)
        if last:
            h = hidden if len(last) == hidden.shape[0] else hidden[torch.tensor(last)]   # all-decode: every row
            logits = self.model.compute_logits(h, fp32=False)  # [N, V], the model's dtype (sample upcasts)
            for i, t in zip(rows, sample(logits, params, positions)):
                out[i] = t
        return out

    def release_idle_memory(self) -> None:
        """Nothing left to run: forget the decode rows (their storage stays: making it
        again cost the next request's first decode its pages' faults). Then ask the C
        allocator to return the free pages it keeps (a step's activations, the senders'
        copies of blocks): an idle process gives back what its busiest moment took."""
        if self.rows is not None:
            self.rows.release()
        trim_heap()

    # -- whole blocks as bytes ------------------------------------------------
    def _block_view(self, block_id: int) -> torch.Tensor:
        bs = self.cfg.block_size
        return self.kv[:, :, block_id * bs : (block_id + 1) * bs]  # [L, 2, bs, KVH, D]

    def read_block(self, block_id: int) -> memoryview:
        return read_kv_bytes(self._block_view(block_id))

    def read_block_into(self, block_id: int, out: memoryview) -> None:
        """read_block's bytes written straight into `out` (a same-host
        segment's slot): one strided copy, no buffer in between."""
        read_kv_bytes_into(self._block_view(block_id), out)

    def read_block_layers(self, block_id: int, lo: int, hi: int) -> memoryview:
        """Layers [lo, hi) of a block: bytes [lo, hi) x layer_bytes of read_block's."""
        bs = self.cfg.block_size
        return read_kv_bytes(self.kv[lo:hi, :, block_id * bs : (block_id + 1) * bs])

    @property
    def num_layers(self) -> int:
        return self.kv.shape[0]

    def write_block(self, block_id: int, payload: bytes | memoryview) -> None:
        if self.rows is not None:
            self.rows.drop_block(block_id)   # never let a row outlive K/V it was copied from
        write_kv_bytes(self._block_view(block_id), payload)


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def read_kv_bytes(view: torch.Tensor) -> memoryview:
    """A strided view of the KV pool as bytes, in one copy
    (`.contiguous().numpy().tobytes()` made two): a read-only 1-D view of a
    buffer nobody else holds."""
    out = torch.empty(view.shape, dtype=view.dtype)
    out.copy_(view)
    return memoryview(out.view(-1).view(torch.uint8).numpy()).toreadonly()


def read_kv_bytes_into(view: torch.Tensor, out: memoryview) -> None:
    """`read_kv_bytes` into a writable buffer of exactly the view's bytes."""
    dst = view.view(_SAME_WIDTH_INT[view.element_size()]).numpy()
    np.copyto(np.frombuffer(out, dtype=dst.dtype).reshape(dst.shape), dst)


def write_kv_bytes(view: torch.Tensor, payload: bytes | memoryview) -> None:
    """`read_kv_bytes`' inverse, in one copy from the (read-only) bytes straight
    into the strided view: numpy reads a buffer it may not write to without a
    copy or a warning (torch.frombuffer wants a writable one, and took a
    `bytearray` copy first); the view is seen as integers of its width, so the
    bits move unchanged."""
    dst = view.view(_SAME_WIDTH_INT[view.element_size()]).numpy()
    np.copyto(dst, np.frombuffer(payload, dtype=dst.dtype).reshape(dst.shape))


def trim_heap() -> None:
    """glibc's malloc_trim(0), where there is one (a no-op elsewhere)."""
    global _MALLOC_TRIM
    if _MALLOC_TRIM is None:
        try:
            import ctypes
            _MALLOC_TRIM = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _MALLOC_TRIM = False
    if _MALLOC_TRIM:
        _MALLOC_TRIM(0)


_MALLOC_TRIM = None
