"""Our own attention kernels, in bf16 (csrc/attention_bf16.c) and fp32
(csrc/attention_f32.c): a step's prompt chunks and decodes, every sequence
over its context in the paged pool, one call a layer.

Why bf16: on a CPU without AMX, SDPA's CPU flash kernel attends a 512-token
bf16 chunk at 36-69 GFLOP/s on one thread (no faster than its fp32 kernel),
against ~212 for the weight matmuls: attention was about half of a
2,048-token bf16 prefill, and bf16 decodes went through an fp32 copy of
their context (docs/DESIGN.md, "Our bf16 attention kernel"). The C kernel
uses the AVX512-BF16 dot product (vdpbf16ps) on the bf16 values as they
are, accumulating in fp32, and reads every context straight from the paged
pool through its block table (no gather, no decode rows): 130-150 GFLOP/s
on those chunks here.

Why fp32: the same layout and semantics with AVX-512F FMAs. A decode step
then needs no decode rows and no padded, masked SDPA call per layer, a
prefill chunk no gather of its cached prefix, and the whole step is one C
call a layer instead of several torch ops per sequence (docs/DESIGN.md,
"Our fp32 attention kernel"). Each query row's result depends only on its
own keys (not on which rows share its call), so fp32 keeps its exact
equalities (a chunk's tokens = the same tokens decoded one by one).

Each is built on first use with the system's C compiler into the model cache
(`$PDD_CACHE` or ~/.cache/pdd, `kernels/<hash>/`), once per source and flags,
and loaded with ctypes (the call releases the GIL). Where the CPU lacks the
instructions, no compiler is found or the build fails, `available(dtype)` is
False with the reason in `unavailable_reason(dtype)`, and the engine keeps
SDPA (`[engine] attention = "auto"`; also for an engine of more than one
thread, as the kernels run on the calling thread only); "native" makes an
unusable kernel an error at start-up instead, "sdpa" never uses one.
`bf16_attention` is the setting's older name (config.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from pdd.model.loader import default_cache_dir

CSRC = Path(__file__).with_name("csrc")
HEAD_DIM = 64                  # the one head size the kernels are written for

_P = ctypes.c_void_p
_L = ctypes.c_long
_STEP_ARGS = (ctypes.c_int, _P, _P, _P, _P, _P, ctypes.c_int, ctypes.c_int, ctypes.c_int,    # nseq .. D
              _P, _L, _P, _P, _L, _P, _P, _L, ctypes.c_int, ctypes.c_float, _P, _L)
_ARGS = (_P, ctypes.c_long, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,   # q, q_ts, n, H, KVH, D
         _P, _P, ctypes.c_long, _P, ctypes.c_int, ctypes.c_int,                        # pools, pool_ts, table, bs, prefix
         _P, _P, ctypes.c_long, ctypes.c_int,                                          # own k, v, own_ts, nown
         ctypes.c_int, ctypes.c_int, ctypes.c_float, _P, ctypes.c_long)                # pos0, causal, scale, out, o_ts


@dataclass
class Kernel:
    """One dtype's kernel: its C source (entry points `pdd_attend_<name>` and
    `pdd_attend_<name>_step`, the same signature in either dtype), how it is
    built, what it needs of the CPU (as /proc/cpuinfo names it), and, once
    loaded, its functions or why there are none."""
    name: str
    dtype: torch.dtype
    source: Path
    flags: tuple[str, ...]
    cpu_flags: tuple[str, ...]
    fn: object = None
    step_fn: object = None
    why: str | None = None
    tried: bool = False

    def load(self) -> None:
        self.tried = True
        missing = [f for f in self.cpu_flags if f not in cpu_flags()]
        if missing:
            self.why = f"the CPU lacks {', '.join(missing)}"
            return
        cc = _compiler()
        if cc is None:
            self.why = "no C compiler (cc, gcc or clang) on PATH"
            return
        try:
            lib = ctypes.CDLL(str(_build(cc, self.source, self.flags)))
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            self.why = f"building the {self.name} kernel failed: {e}"
            return
        fn = getattr(lib, f"pdd_attend_{self.name}")
        fn.restype = ctypes.c_int
        fn.argtypes = _ARGS
        step = getattr(lib, f"pdd_attend_{self.name}_step")
        step.restype = ctypes.c_int
        step.argtypes = _STEP_ARGS
        self.fn, self.step_fn = fn, step

    def ready(self) -> "Kernel":
        """This kernel, loaded; an error saying why where it cannot run."""
        if not self.tried:
            self.load()
        if self.fn is None:
            raise RuntimeError(f"the {self.name} kernel cannot run: {self.why}")
        return self


KERNELS = {
    torch.bfloat16: Kernel("bf16", torch.bfloat16, CSRC / "attention_bf16.c",
                           ("-O3", "-std=gnu11", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma",
                            "-shared", "-fPIC"),
                           ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")),
    torch.float32: Kernel("f32", torch.float32, CSRC / "attention_f32.c",
                          ("-O3", "-std=gnu11", "-mavx512f", "-mfma", "-shared", "-fPIC"), ("avx512f", "fma")),
}


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _build(cc: str, source: Path, flags: tuple[str, ...]) -> Path:
    # The kernels' shared headers (csrc/*.h) are part of what is built.
    src = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(src + " ".join(flags).encode() + version.encode()).hexdigest()[:16]
    out = default_cache_dir() / "kernels" / key / f"{source.stem}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Built beside its final name and renamed into place: instances starting
    # together may each build it, and none loads a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-o", tmp, str(source), "-lm"], capture_output=True, text=True,
                           timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-500:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def available(dtype: torch.dtype = torch.bfloat16) -> bool:
    k = KERNELS.get(dtype)
    if k is None:
        return False
    if not k.tried:
        k.load()
    return k.fn is not None


def unavailable_reason(dtype: torch.dtype = torch.bfloat16) -> str | None:
    if dtype not in KERNELS:
        return f"no kernel for {dtype}"
    return None if available(dtype) else KERNELS[dtype].why


def use_kernel(setting: str, dtype: torch.dtype, head_dim: int, num_threads: int = 1) -> bool:
    """Whether an engine attends with our kernel for its dtype: `setting` is `[engine]
    attention` ("auto", "sdpa" or "native"). The kernels run on the calling thread only,
    so "auto" keeps SDPA (which uses torch's threads) for an engine of more than one
    thread. Dtypes without a kernel (fp16) keep SDPA whatever the setting."""
    if setting == "sdpa" or dtype not in KERNELS or (setting == "auto" and num_threads > 1):
        return False
    why = None if head_dim == HEAD_DIM else f"head_dim {head_dim} (the kernel takes {HEAD_DIM})"
    if why is None and not available(dtype):
        why = unavailable_reason(dtype)
    if why is None:
        return True
    if setting == "native":
        raise RuntimeError(f"engine.attention = \"native\" but the {KERNELS[dtype].name} kernel cannot run: {why}")
    return False


def _check_rows(name: str, t: torch.Tensor, dtype: torch.dtype, D: int) -> None:
    """Every tensor the kernels read or write: the step's dtype, its last two dimensions contiguous."""
    if t.dtype is not dtype or t.stride(-1) != 1 or t.stride(-2) != D:
        raise ValueError(f"{name}: {KERNELS[dtype].name} with its last two dimensions contiguous expected")


def _kernel_for(q: torch.Tensor) -> Kernel:
    k = KERNELS.get(q.dtype)
    if k is None:
        raise ValueError(f"q: no kernel for {q.dtype} (bf16 or fp32)")
    return k.ready()


def attend(q: torch.Tensor, k_own: torch.Tensor, v_own: torch.Tensor,
           pool: tuple[torch.Tensor, torch.Tensor] | None = None, table: torch.Tensor | None = None,
           prefix: int = 0, block_size: int = 16, causal: bool = True,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D] over a context of `prefix` tokens in the paged pool (K and V of one
    layer, [slots, KVH, D] each, through `table`'s block ids) followed by k_own / v_own
    [m, KVH, D] (the chunk's own; m may be 0) -> [n, H, D] in q's dtype (bf16 or fp32).
    Token t of q sits at position prefix + m - n + t; causal: it sees the keys up to
    there, else all of them. Every tensor in q's dtype with its last two dimensions
    contiguous; `out` (the same) is written when given."""
    kern = _kernel_for(q)
    n, H, D = q.shape
    m, KVH = k_own.shape[0], k_own.shape[1]
    for name, t in (("q", q), ("k_own", k_own), ("v_own", v_own)):
        _check_rows(name, t, q.dtype, D)
    if k_own.stride(0) != v_own.stride(0):
        raise ValueError("k_own and v_own must have the same token stride")
    if out is None:
        out = q.new_empty((n, H, D))
    elif out.shape != q.shape:
        raise ValueError("out: shaped as q expected")
    _check_rows("out", out, q.dtype, D)
    kp = vp = tb = 0
    pool_ts = 0
    if prefix:
        kpool, vpool = pool
        _check_rows("pool", kpool, q.dtype, D)
        if kpool.stride() != vpool.stride() or vpool.dtype is not q.dtype:
            raise ValueError("pool: K and V [slots, KVH, D] with the same layout")
        if table.dtype is not torch.int64 or not table.is_contiguous() or table.numel() * block_size < prefix:
            raise ValueError("table: int64, contiguous, covering the prefix")
        kp, vp, tb, pool_ts = kpool.data_ptr(), vpool.data_ptr(), table.data_ptr(), kpool.stride(0)
    rc = kern.fn(q.data_ptr(), q.stride(0), n, H, KVH, D, kp, vp, pool_ts, tb, block_size, prefix,
                 k_own.data_ptr(), v_own.data_ptr(), k_own.stride(0), m,
                 prefix + m - n, int(causal), D ** -0.5, out.data_ptr(), out.stride(0))
    if rc != 0:
        raise ValueError(f"the {kern.name} kernel refused the shapes (code {rc}): q {tuple(q.shape)}, "
                         f"own {tuple(k_own.shape)}, prefix {prefix}")
    return out


class StepPlan:
    """What every layer of a step passes the kernel: per sequence (flat order) its first
    token's row, its number of tokens, its start position, and its block table (all its
    blocks, flattened), as int64 tensors made once a step."""

    def __init__(self, seqs: list[tuple[int, int, list[int]]], block_size: int):
        tok, num, start, off, table = [], [], [], [], []
        row = 0
        for s, n, blocks in seqs:
            tok.append(row)
            num.append(n)
            start.append(s)
            off.append(len(table))
            table.extend(blocks[: -(-(s + n) // block_size)])
            row += n
        self.nseq = len(seqs)
        self.block_size = block_size
        self._t = [torch.tensor(x, dtype=torch.int64) for x in (tok, num, start, table or [0], off)]
        self._ptrs = [t.data_ptr() for t in self._t]


def attend_step(plan: StepPlan, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                pool: tuple[torch.Tensor, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """A step's queries q [T, H, D] (flat order, `plan`'s sequences), each sequence over
    its context in the pool (K and V of one layer, [slots, KVH, D]) followed by its own
    tokens' k / v [T, KVH, D], causally -> written into out [T, H, D]. Layouts and dtypes
    as `attend`."""
    kern = _kernel_for(q)
    T, H, D = q.shape
    KVH = k.shape[1]
    kpool, vpool = pool
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out), ("pool", kpool), ("pool", vpool)):
        _check_rows(name, t, q.dtype, D)
    if k.stride(0) != v.stride(0) or kpool.stride() != vpool.stride():
        raise ValueError("k / v and the pool's K / V must share their layouts")
    tok, num, start, table, off = plan._ptrs
    rc = kern.step_fn(plan.nseq, tok, num, start, table, off, H, KVH, D, q.data_ptr(), q.stride(0),
                      k.data_ptr(), v.data_ptr(), k.stride(0), kpool.data_ptr(), vpool.data_ptr(),
                      kpool.stride(0), plan.block_size, D ** -0.5, out.data_ptr(), out.stride(0))
    if rc != 0:
        raise ValueError(f"the {kern.name} kernel refused the step (code {rc})")
    return out
