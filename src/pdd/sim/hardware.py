"""Accelerator profiles on the four axes that decide P vs D placement.

peak compute, memory capacity, memory bandwidth, interconnect bandwidth, plus
an hourly price. `gpu_a` / `gpu_b` are the report's archetypes (A: compute-
heavy prefill chip; B: memory-heavy decode chip, priced 25% above A). The
data-sheet entries quote dense (non-sparse) FP8 peaks, or BF16 where the chip
has no FP8 (A100); prices are indicative on-demand cloud rates per chip-hour,
not quotes. `cpu` is this machine's prior, meant to be replaced by
`CostModel.calibrate` on measured engine steps.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

TERA = 1e12
GIB = 1 << 30


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    peak_flops: float             # FLOP/s, one chip
    mem_bytes: float              # device memory, one chip
    mem_bw_bytes_s: float         # device memory bandwidth, one chip
    interconnect_bytes_s: float   # chip-to-chip (NVLink / IF / PCIe), one direction
    price_per_hour: float         # currency units per chip-hour
    # FLOP/s of 16-bit (bf16) matmuls where it differs from `peak_flops`
    # (a CPU whose peak_flops is its FP32 figure); None: the same.
    peak_flops_16bit: float | None = None

    def peak_for(self, bytes_per_param: float) -> float:
        """The compute peak for weights (and activations) of this width."""
        if bytes_per_param <= 2 and self.peak_flops_16bit is not None:
            return self.peak_flops_16bit
        return self.peak_flops

    def __post_init__(self) -> None:
        for name in ("peak_flops", "mem_bytes", "mem_bw_bytes_s", "interconnect_bytes_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{self.name}: {name} must be > 0")
        if self.price_per_hour < 0:
            raise ValueError(f"{self.name}: price_per_hour must be >= 0")


PROFILES: dict[str, HardwareProfile] = {p.name: p for p in (
    # The report's archetypes.
    HardwareProfile("gpu_a", 1979 * TERA, 96e9, 3.35e12, 450e9, 2.00),
    HardwareProfile("gpu_b", 990 * TERA, 192e9, 6.0e12, 450e9, 2.50),
    # Public data sheets (dense FP8 unless noted).
    HardwareProfile("h100_sxm", 1979 * TERA, 80e9, 3.35e12, 450e9, 2.50),
    HardwareProfile("h200", 1979 * TERA, 141e9, 4.8e12, 450e9, 3.50),
    HardwareProfile("a100_80gb", 312 * TERA, 80e9, 2.039e12, 300e9, 1.50),   # BF16
    HardwareProfile("l40s", 733 * TERA, 48e9, 0.864e12, 32e9, 1.00),         # PCIe 4.0 x16
    HardwareProfile("mi300x", 2615 * TERA, 192e9, 5.3e12, 448e9, 2.50),
    HardwareProfile("b200", 4500 * TERA, 180e9, 8.0e12, 900e9, 5.00),
    # This CPU, before calibration: one core of FP32 SIMD, DDR bandwidth. Its
    # bf16 peak is what one thread's bf16 matmuls of the model's shapes reach
    # (AMX through oneDNN: [512, 576] x [576, 1536] 1.40, [512, 1536] x [1536,
    # 576] 1.31 TFLOP/s, best of 30, 2026-12-06). It was 4x the FP32 figure
    # (0.4 TFLOP/s) until session 24, below what P's prefill reaches in a quiet
    # hour (512 tokens at context 512 in 0.208 s of CPU, 147 GFLOP by this
    # model's count: 0.71 TFLOP/s): every bf16 run's prefill fit then sat at
    # mfu = 1.0, unable to express P's uncontended steps.
    HardwareProfile("cpu", 100e9, 16 * GIB, 20e9, 10e9, 0.05, peak_flops_16bit=1400e9),
)}


def get_profile(name: str, **overrides: float) -> HardwareProfile:
    try:
        base = PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown hardware {name!r}; known: {sorted(PROFILES)}") from None
    return replace(base, **overrides) if overrides else base
