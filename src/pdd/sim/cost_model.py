"""Step time of one engine step (prefill chunks + decode tokens + extends).

    t = overhead_s + per_seq_s * batch
        + max((linear_flops + attn_cost * attention_flops) / (chips * peak * mfu),
              bytes / (chips * mem_bw * mbu))
        + tensor-parallel all-reduce time over the interconnect

a roofline with fixed costs. `attn_cost` is what one attention FLOP (the
query-key products and the weighted sum of values) costs against one FLOP
of the weight matmuls: 1.0 on a chip whose attention kernel runs at its
matmuls' rate; on this CPU without AMX (one thread, bf16) the SDPA kernel
reached 35-60 GFLOP/s against 212 for a [512, 576] x [576, 1536] matmul,
and P's prefill chunks fitted 3.4 (docs/SIMULATOR.md, "Attention's own
cost"). An extend (RLD -> MD handoff) is a prefill chunk whose context
starts at the prompt length, so it needs no term of its own. `calibrate`
fits (mfu, mbu, attn_cost, overhead_s, per_seq_s) by least squares to the
step records an engine logs, so the CPU profile follows measurement.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from pdd.sim.hardware import HardwareProfile
from pdd.sim.model_shape import ModelShape


@dataclass(frozen=True)
class StepShape:
    num_prefill_tokens: int
    num_decode_tokens: int
    batch_size: int
    context_lens: Sequence[int] = ()     # per sequence, after the step
    attn_pairs: float | None = None      # exact (query, key) pairs when the caller knows them

    @classmethod
    def from_record(cls, rec: dict) -> "StepShape":
        return cls(int(rec["num_prefill_tokens"]), int(rec["num_decode_tokens"]),
                   int(rec["batch_size"]), tuple(rec.get("context_lens", ())),
                   rec.get("attn_pairs"))

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def pairs(self) -> float:
        if self.attn_pairs is not None:
            return self.attn_pairs
        # Decode tokens see their whole context; prefill tokens on average half a
        # chunk less than the longest context (exact for one chunk from zero).
        ctx = self.context_lens
        longest = max(ctx) if ctx else self.num_prefill_tokens
        return sum(ctx) + self.num_prefill_tokens * max(longest - self.num_prefill_tokens / 2, 0)


def row_bucket(rows: int) -> int:
    """The row-count class of a step (its tokens, the rows of its matmuls):
    1-16 as themselves, then one class per doubling (17-32 -> 17, 33-64 ->
    18, ..., 257-512 -> 21). Calibrated CPU profiles scale a step by the
    factor of its class (`PoolSpec.row_factors`)."""
    if rows <= 16:
        return max(rows, 1)
    return 12 + (rows - 1).bit_length()


def chunk_pairs(start: int, length: int) -> float:
    """Attention pairs of a prefill chunk covering positions [start, start + length)."""
    return length * start + length * (length + 1) / 2


@dataclass(frozen=True)
class CostModel:
    model: ModelShape
    hw: HardwareProfile
    chips: int = 1
    mfu: float = 0.5
    mbu: float = 0.7
    overhead_s: float = 0.004
    per_seq_s: float = 20e-6
    # Stretches whole steps: a machine that lends part of its cores to other
    # processes (measured per run by `pdd.sim.calibration`), 1.0 elsewhere.
    time_scale: float = 1.0
    # One attention FLOP's cost in weight-matmul FLOPs (module docstring).
    attn_cost: float = 1.0

    def __post_init__(self) -> None:
        if self.chips < 1 or not 0 < self.mfu <= 1 or not 0 < self.mbu <= 1:
            raise ValueError("chips >= 1 and mfu, mbu in (0, 1] required")
        if self.overhead_s < 0 or self.per_seq_s < 0 or self.time_scale <= 0:
            raise ValueError("overheads must be >= 0 and time_scale > 0")
        if not self.attn_cost > 0:
            raise ValueError("attn_cost must be > 0")

    # --- the two roofline inputs, at the profile's peak ------------------
    def compute_parts_s(self, s: StepShape) -> tuple[float, float]:
        """(weight matmuls, attention) at the peak, attention at the matmuls' rate."""
        peak = self.chips * self.hw.peak_for(self.model.weight_bytes_per_param)
        return self.model.linear_flops(s.num_tokens) / peak, self.model.attention_flops(s.pairs()) / peak

    def compute_s(self, s: StepShape) -> float:
        linear, attention = self.compute_parts_s(s)
        return linear + self.attn_cost * attention

    def memory_s(self, s: StepShape) -> float:
        kv = self.model.kv_bytes_per_token * (sum(s.context_lens) + s.num_tokens)
        return (self.model.weight_read_bytes(s.num_tokens) + kv) / (self.chips * self.hw.mem_bw_bytes_s)

    def comm_s(self, s: StepShape) -> float:
        n = self.chips
        if n == 1:
            return 0.0
        return self.model.allreduce_bytes(s.num_tokens) * 2 * (n - 1) / n / self.hw.interconnect_bytes_s

    def step_time(self, s: StepShape) -> float:
        roof = max(self.compute_s(s) / self.mfu, self.memory_s(s) / self.mbu)
        return self.time_scale * (self.overhead_s + self.per_seq_s * s.batch_size + roof + self.comm_s(s))

    def fast(self) -> "FastStepTime":
        return FastStepTime(self)

    def fits(self) -> bool:
        return self.model.weight_bytes < self.chips * self.hw.mem_bytes

    def kv_capacity_tokens(self, mem_fraction: float = 0.9) -> int:
        """Tokens of KV the instance holds after its weights (mem_fraction usable)."""
        free = self.chips * self.hw.mem_bytes * mem_fraction - self.model.weight_bytes
        return max(int(free // self.model.kv_bytes_per_token), 0)


@dataclass(frozen=True)
class Calibration:
    model: CostModel
    num_records: int
    rmse_s: float        # absolute error of the fitted model, seconds
    r2: float


def calibrate(step_records: Iterable[dict], base: CostModel,
              balance: bool = False, fit_attention: bool = True) -> Calibration:
    """Least-squares fit of (mfu, mbu, attn_cost, overhead_s, per_seq_s) to measured steps.

    The roofline max() is not linear, so (mfu, mbu) are searched on a log grid
    (coarse, then refined around the best cell), for each of a log grid of
    attn_cost values (0.5-16, then refined; `fit_attention=False` keeps the
    base's); for each cell the fixed costs follow in closed form, clipped at
    zero. The fit minimises relative error, a decode-only step weighed by the
    tokens it makes (TPOT is a per-token mean); with `balance`, steps with prefill tokens weigh as much in total as
    the (usually far more numerous) decode-only steps, so TTFT is fitted too.
    """
    import numpy as np

    recs = list(step_records)
    if len(recs) < 3:
        raise ValueError("calibrate needs at least 3 step records")
    shapes = [StepShape.from_record(r) for r in recs]
    wall = np.array([float(r["wall_s"]) for r in recs])
    lin, att = np.array([base.compute_parts_s(s) for s in shapes]).T
    mem = np.array([base.memory_s(s) for s in shapes])
    comm = np.array([base.comm_s(s) for s in shapes])
    batch = np.array([float(s.batch_size) for s in shapes])
    weight = 1.0 / np.maximum(wall, 1e-9)
    pre = np.array([s.num_prefill_tokens > 0 for s in shapes])
    # A decode step counts once per token it makes: TPOT is a per-token mean,
    # and a batch-8 step makes eight of them where a batch-1 step makes one.
    tokens = np.array([max(s.num_decode_tokens, 1) for s in shapes], dtype=float)
    share = np.where(pre, 1.0, tokens)
    weight = weight * np.sqrt(share)
    if balance:
        n_pre, n = int(pre.sum()), len(shapes)
        if 0 < n_pre < n:
            tot_pre, tot_dec = share[pre].sum(), share[~pre].sum()
            weight = weight * np.sqrt(np.where(pre, 0.5 / tot_pre, 0.5 / tot_dec) * share.sum())

    def search(mfus, mbus, costs):
        best = None
        for c in costs:
            comp = lin + c * att
            roof = np.maximum(comp[None, None, :] / mfus[:, None, None],
                              mem[None, None, :] / mbus[None, :, None])      # [F, B, N]
            y = wall[None, None, :] - comm[None, None, :] - roof
            a, b = _fit_affine(batch, y, weight)
            sse = (((y - a[..., None] - b[..., None] * batch) * weight) ** 2).sum(-1)
            i, j = np.unravel_index(np.argmin(sse), sse.shape)
            if best is None or sse[i, j] < best[-1]:
                best = (mfus[i], mbus[j], c, a[i, j], b[i, j], sse[i, j])
        return best

    grid = np.logspace(-5, 0, 41)
    costs = 2.0 ** np.arange(-1.0, 4.01, 0.5) if fit_attention else np.array([base.attn_cost])
    f, m, c, *_ = search(grid, grid, costs)
    step = grid[1] / grid[0]
    fine = lambda x: np.clip(np.geomspace(x / step, x * step, 21), 1e-6, 1.0)
    fine_c = np.geomspace(c / 2 ** 0.5, c * 2 ** 0.5, 9) if fit_attention else costs
    f, m, c, a, b, _ = search(fine(f), fine(m), fine_c)
    fitted = replace(base, mfu=float(f), mbu=float(m), attn_cost=float(c),
                     overhead_s=float(a), per_seq_s=float(b))
    pred = np.array([fitted.step_time(s) for s in shapes])
    sse_abs = float(((wall - pred) ** 2).sum())
    var = float(((wall - wall.mean()) ** 2).sum())
    return Calibration(fitted, len(recs), math.sqrt(sse_abs / len(recs)),
                       1.0 - sse_abs / var if var > 0 else 1.0)


def _fit_affine(x, y, w):
    """Per-cell weighted least squares y ~ a + b x with a, b >= 0.

    x, w: [N]; y: [..., N]. Weights 1/wall make the fit minimise *relative*
    error, so millisecond decode steps count as much as second-long prefills.
    """
    import numpy as np

    w2 = w * w
    s11, s12, s22 = w2.sum(), (w2 * x).sum(), (w2 * x * x).sum()
    t1, t2 = (w2 * y).sum(-1), (w2 * x * y).sum(-1)
    det = s11 * s22 - s12 * s12
    if det > 1e-30 * max(s11 * s22, 1e-300):
        a = (s22 * t1 - s12 * t2) / det
        b = (s11 * t2 - s12 * t1) / det
    else:
        a, b = t1 / s11, np.zeros_like(t1)
    # Clip to the feasible region, re-solving the remaining coefficient.
    neg_b = b < 0
    b = np.where(neg_b, 0.0, b)
    a = np.where(neg_b, t1 / s11, a)
    neg_a = a < 0
    a = np.where(neg_a, 0.0, a)
    b = np.where(neg_a, np.maximum(t2 / s22 if s22 > 0 else 0.0, 0.0), b)
    return a, b


class FastStepTime:
    """`CostModel.step_time` with constants folded, for the simulator's hot loop.

    Same arithmetic as `step_time(StepShape(..., attn_pairs=pairs))` with the
    context lengths given only through their sum.
    """

    __slots__ = ("_over", "_per_seq", "_lin", "_attn", "_w_total", "_w_active",
                 "_kv", "_inv_f", "_inv_b", "_comm", "_scale")

    def __init__(self, c: CostModel) -> None:
        m, n = c.model, c.chips
        self._over, self._per_seq = c.overhead_s, c.per_seq_s
        self._lin = 2.0 * m.active_params
        self._attn = 4.0 * m.num_layers * m.num_heads * m.head_dim * c.attn_cost
        self._w_total = m.total_params * m.weight_bytes_per_param
        self._w_active = m.active_params * m.weight_bytes_per_param
        self._kv = float(m.kv_bytes_per_token)
        self._inv_f = 1.0 / (n * c.hw.peak_for(m.weight_bytes_per_param) * c.mfu)
        self._inv_b = 1.0 / (n * c.hw.mem_bw_bytes_s * c.mbu)
        self._comm = (m.allreduce_bytes(1) * 2 * (n - 1) / n / c.hw.interconnect_bytes_s
                      if n > 1 else 0.0)
        self._scale = c.time_scale

    def __call__(self, num_tokens: int, batch: int, ctx_sum: float, pairs: float) -> float:
        flops = self._lin * num_tokens + self._attn * pairs
        w = min(self._w_total, self._w_active * (num_tokens if num_tokens > 1 else 1))
        mem = w + self._kv * (ctx_sum + num_tokens)
        roof = flops * self._inv_f
        b = mem * self._inv_b
        if b > roof:
            roof = b
        t = self._over + self._per_seq * batch + roof + self._comm * num_tokens
        return t if self._scale == 1.0 else t * self._scale
