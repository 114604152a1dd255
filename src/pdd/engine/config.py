"""Engine settings: one frozen dataclass, checked once, passed down."""

from __future__ import annotations

from dataclasses import dataclass

from pdd.policy.step_packing import STEP_OVERHEAD_TOKENS

# Bytes per element of each serving dtype: the KV cache, its blocks on the
# wire and the simulator's KV and weight sizes all follow the engine's dtype.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# `[engine] decode_attention`: how decodes are attended in bf16 / fp16 (engine/paged_attention.py)
DECODE_ATTENTION = ("auto", "flash", "fp32")
# `[engine] attention` (older name `bf16_attention`): which kernel attends in bf16 and fp32
# (engine/native_attention.py)
ATTENTION = ("auto", "sdpa", "native")
BF16_ATTENTION = ATTENTION      # the older name, kept for importers


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int = 1024              # KV pool size; tokens = num_blocks * block_size
    max_num_seqs: int = 32              # running requests per step
    max_num_batched_tokens: int = 512   # per-step token budget (chunked prefill)
    max_model_len: int | None = None    # default: the model's max positions
    enable_prefix_cache: bool = True
    num_threads: int = 1
    dtype: str = "float32"
    step_log_size: int = 100_000
    # keep running decodes' K/V as contiguous rows between steps (engine/decode_rows.py);
    # False: gather them from the block table every step (the reference path)
    decode_rows: bool = True
    # rebuild the packed weights on 2 MB pages at start-up (model/huge_pages.py):
    # decode of 8-16 rows ~7-9% faster, ~2-4 s of CPU once per process (SmolLM2)
    huge_pages: bool = True
    # how decodes are attended in bf16 / fp16 (engine/paged_attention.py, `decode_kernel`):
    # "flash" (SDPA on the dtype), "fp32" (the context copied to fp32), "auto" (the faster, measured)
    decode_attention: str = "auto"
    # which kernel attends in bf16 and fp32 (engine/native_attention.py): "native" (ours,
    # AVX512-BF16 / AVX-512F, every prefill chunk and decode of a step in one call a layer; an
    # error where it cannot run), "sdpa" (SDPA, decodes as `decode_attention` says), "auto"
    # (native where it runs and the engine has one thread)
    attention: str = "auto"
    # the older name of `attention` (when it only chose bf16's kernel), still read from
    # deployment files: where given it sets `attention` (left at "auto"), then reads None;
    # given both, different and neither "auto", is an error
    bf16_attention: str | None = None
    # a step's fixed cost in tokens of its per-token cost: how much longer prompt
    # work may join a step that ends short prompts (policy/step_packing.py)
    step_overhead_tokens: int = STEP_OVERHEAD_TOKENS

    def __post_init__(self):
        for name in ("enable_prefix_cache", "decode_rows", "huge_pages"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"engine.{name} must be true or false, got {getattr(self, name)!r}")
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "num_threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"engine.{name} must be a positive integer, got {v!r}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"engine.decode_attention must be auto, flash or fp32, got {self.decode_attention!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"engine.attention must be auto, sdpa or native, got {self.attention!r}")
        if self.bf16_attention is not None:
            if self.bf16_attention not in ATTENTION:
                raise ValueError(f"engine.bf16_attention (now engine.attention) must be auto, sdpa or native, "
                                 f"got {self.bf16_attention!r}")
            if self.attention != "auto" and self.bf16_attention not in ("auto", self.attention):
                raise ValueError(f"engine.attention = {self.attention!r} and its older name engine.bf16_attention "
                                 f"= {self.bf16_attention!r} disagree: give one")
            if self.attention == "auto":
                object.__setattr__(self, "attention", self.bf16_attention)
            object.__setattr__(self, "bf16_attention", None)
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"engine.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if isinstance(self.step_overhead_tokens, bool) or not isinstance(self.step_overhead_tokens, int) \
                or self.step_overhead_tokens < 0:
            raise ValueError(f"engine.step_overhead_tokens must be an integer >= 0, got {self.step_overhead_tokens!r}")
        if self.max_num_batched_tokens < self.block_size:
            raise ValueError("engine.max_num_batched_tokens must be >= engine.block_size")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]
