"""A simulation scenario from TOML: model, workload, SLA, and modes side by side.

    [sim]        duration / warm-up / drain, token-time stride, macro steps
    [model]      preset = "report-moe" (+ field overrides)
    [workload]   kind = "agentic" | "fixed_hit" | "trace" (+ that workload's fields)
    [sla]        ttft_s, tpot_s
    [[mode]]     name, [mode.policy] (PolicyConfig fields), [mode.rdma], [mode.wan],
                 [[mode.pool]] role, hardware, chips, count, datacenter, max_batch, ...

Several files may be given at once; their modes are simulated on the same
workload, which must then be identical in every file.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from pdd.measure.metrics import Sla
from pdd.policy import PolicyConfig, Role
from pdd.policy.step_packing import STEP_OVERHEAD_TOKENS
from pdd.sim.hardware import get_profile
from pdd.sim.model_shape import ModelShape, get_model
from pdd.sim.workload import AgenticWorkload, FixedHitWorkload, TraceWorkload


@dataclass(frozen=True)
class PoolSpec:
    role: Role
    hardware: str
    chips: int
    count: int
    datacenter: str = "a"
    max_batch: int = 64
    token_budget: int = 8192
    mem_fraction: float = 0.9
    prefix_cache: bool = True
    mfu: float = 0.5
    mbu: float = 0.7
    overhead_s: float = 0.004
    per_seq_s: float = 20e-6
    attn_cost: float = 1.0                # one attention FLOP in matmul FLOPs (`CostModel.attn_cost`)
    # "packed": a step fills its token budget with chunks of several jobs (a
    # job's tail chunk rides with the next job's head); "single": one prefill
    # chunk per step, so a tail chunk runs alone (the report's bathtub valleys);
    # "short_first": our engine's scheduler (shortest remaining prompt first,
    # a step that completes prompts takes only what they can wait for:
    # `pdd.policy.step_packing`, with `step_overhead_tokens`).
    chunk_packing: str = "packed"
    step_overhead_tokens: int = STEP_OVERHEAD_TOKENS
    time_scale: float = 1.0               # stretches every step (a CPU shared with foreign load)
    # Set by runtime deployment files (pdd.sim.deployment), rarely by hand:
    name: str | None = None               # instance name (instance ids follow it)
    kv_blocks: int | None = None          # fixed KV pool (engine num_blocks) instead of memory-derived
    price_per_hour: float | None = None   # per instance; default chips x the hardware's price
    core: int | None = None               # CPU core the instance is pinned to; a shared core time-slices
    nice: int = 0                         # its priority there (Linux nice): a smaller share of the shared core
    # Lognormal sigma of each step's time around the model (mean kept): the
    # scatter of measured steps about the calibrated fit. 0: deterministic.
    step_jitter: float = 0.0
    # A step of n tokens takes row_factors[row_bucket(n) - 1] x the model
    # (1.0 past the end): a calibrated engine's kernels by rows per step.
    row_factors: tuple[float, ...] = ()
    # A decoder's step that decodes nothing (a sequence's first step alone,
    # an extend alone) takes this x its row class's time (calibrated:
    # `calibration.ThreadFit.lone_chunk`).
    lone_chunk_factor: float = 1.0

    def __post_init__(self) -> None:
        if isinstance(self.role, str):
            object.__setattr__(self, "role", Role(self.role))
        get_profile(self.hardware)
        if self.chips < 1 or self.count < 0 or self.max_batch < 1 or self.token_budget < 1:
            raise ValueError(f"pool {self.role.value}: chips, max_batch, token_budget >= 1, count >= 0")
        if self.chunk_packing not in ("packed", "single", "short_first"):
            raise ValueError(f"pool {self.role.value}: chunk_packing must be 'packed', 'single' "
                             "or 'short_first'")
        if self.step_overhead_tokens < 0:
            raise ValueError(f"pool {self.role.value}: step_overhead_tokens must be >= 0")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ValueError(f"pool {self.role.value}: kv_blocks must be >= 1")
        if not 0 <= self.step_jitter < 1:
            raise ValueError(f"pool {self.role.value}: step_jitter must be in [0, 1)")
        object.__setattr__(self, "row_factors", tuple(float(f) for f in self.row_factors))
        if any(not f > 0 for f in self.row_factors):
            raise ValueError(f"pool {self.role.value}: row_factors must be > 0")
        if not self.lone_chunk_factor > 0:
            raise ValueError(f"pool {self.role.value}: lone_chunk_factor must be > 0")

    def instance_price(self) -> float:
        if self.price_per_hour is not None:
            return self.price_per_hour
        return self.chips * get_profile(self.hardware).price_per_hour


@dataclass(frozen=True)
class LinkSpec:
    gbps: float
    rtt_ms: float
    max_flow_gbps: float | None = None
    price_per_hour: float = 0.0
    # Bytes the line's buffer holds when a transfer a user waits on starts
    # (all flows together): those go first, whatever the senders'
    # priorities (`sim.link`).
    buffer_bytes: float = 0.0
    # ... and what a yielding copy still has on its way when it pauses,
    # beyond its part of that buffer: its sender's socket buffers (None: 0).
    yield_leak_bytes: float | None = None
    # ... and what of a transfer a user waits on is still to cross when its
    # sender lets the yielding copies go again (its socket's buffer; 0: none).
    tail_release_bytes: float = 0.0
    # Bytes of other transfers a handshake's frames (BEGIN, HAVE) meet in the
    # line's buffers on average, measured (`CpuCalibration.handshake_queue`):
    # a BEGIN waits at least that long at the line's rate.
    handshake_queue_bytes: float = 0.0

    @property
    def bandwidth_bytes_s(self) -> float:
        return self.gbps * 1e9 / 8

    @property
    def rtt_s(self) -> float:
        return self.rtt_ms / 1e3


@dataclass(frozen=True)
class ServingOverheads:
    """What a real deployment adds around the engines (runtime files only).

    The router sits in `router_datacenter`; every token travels from its
    instance to the router (one-way link latency) and through two HTTP
    streams (`token_s`); before routing, the router spends `request_s` and,
    in PDD, asks the instances of its own datacenter for their cached
    prefixes (one local round trip; MD's come from its index, no WAN trip). Steps of instances pinned to one core time-slice that core.
    KV calls may wait for engine step boundaries (`manifest_after_step`,
    `import_wait`).
    """

    router_datacenter: str = "a"
    request_s: float = 0.0
    token_s: float = 0.0
    match_round_trip: bool = False
    # The server runs engine calls as commands between two engine steps:
    # P reads a prompt's KV manifest (and starts sending) after its next step;
    # "submit": KV import runs under the pool lock during steps, only the
    # decode submit waits for a boundary (the server today); "batch": arriving
    # blocks go into a busy receiver's pool between its steps (all that
    # arrived, one command per step: the KV is usable after the step under
    # way when the last byte lands; HAVE waits a boundary too); "block" (one
    # block per step); "none".
    manifest_after_step: bool = False
    import_wait: str = "none"
    # P streams each block to its receivers as soon as its chunk is computed
    # (the server today); False: it sends after the whole prefill (before).
    stream_kv: bool = False
    # ... and a chunk's KV layer by layer while the chunk computes (the server
    # today); False: a chunk's blocks once its step is over.
    stream_kv_layers: bool = False

    def __post_init__(self) -> None:
        if self.import_wait not in ("none", "submit", "batch", "block"):
            raise ValueError(f"import_wait must be none, submit, batch or block, got {self.import_wait!r}")


@dataclass(frozen=True)
class ModeSpec:
    name: str
    pools: tuple[PoolSpec, ...]
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    rdma: LinkSpec = LinkSpec(gbps=3200.0, rtt_ms=0.02)
    wan: LinkSpec | None = None
    serving: ServingOverheads | None = None
    seed: int = 0          # of the step-time jitter (pools with step_jitter > 0)
    # Throughput of a core that pools share (`PoolSpec.core`) while two or
    # more of its engines step, relative to one alone (calibrated).
    core_sharing: float = 1.0

    def cost_per_hour(self) -> float:
        chips = sum(p.count * p.instance_price() for p in self.pools)
        return chips + (self.wan.price_per_hour if self.wan else 0.0)

    def num_chips(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.pools:
            out[p.hardware] = out.get(p.hardware, 0) + p.count * p.chips
        return out


@dataclass(frozen=True)
class SimSettings:
    warmup_s: float = 0.0
    drain_s: float = 600.0           # simulated time allowed after the last arrival
    token_stride: int = 1
    max_macro_steps: int = 32


@dataclass(frozen=True)
class Scenario:
    model: ModelShape
    workload: AgenticWorkload | FixedHitWorkload | TraceWorkload
    sla: Sla
    modes: tuple[ModeSpec, ...]
    settings: SimSettings = SimSettings()


def _build(cls, d: dict, where: str):
    known = {f.name for f in fields(cls)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    return cls(**d)


def _mode(d: dict) -> ModeSpec:
    d = dict(d)
    pools = tuple(_build(PoolSpec, p, f"mode {d.get('name')} pool") for p in d.pop("pool", []))
    if not pools:
        raise ValueError(f"mode {d.get('name')}: no [[mode.pool]]")
    policy = PolicyConfig.from_dict(d.pop("policy", {}))
    rdma = _build(LinkSpec, d.pop("rdma"), "rdma") if "rdma" in d else LinkSpec(3200.0, 0.02)
    wan = _build(LinkSpec, d.pop("wan"), "wan") if "wan" in d else None
    name = d.pop("name")
    if d:
        raise ValueError(f"mode {name}: unknown keys {sorted(d)}")
    if len({p.datacenter for p in pools}) > 1 and wan is None:
        raise ValueError(f"mode {name}: pools in several datacenters need a [mode.wan]")
    return ModeSpec(name, pools, policy, rdma, wan)


def parse(doc: dict, base_dir: Path = Path(".")) -> Scenario:
    model_d = dict(doc.get("model", {"preset": "report-moe"}))
    model = get_model(model_d.pop("preset", "report-moe"), **model_d)
    wl = dict(doc.get("workload", {}))
    kind = wl.pop("kind", "agentic")
    if kind == "agentic":
        workload = _build(AgenticWorkload, wl, "workload")
    elif kind == "fixed_hit":
        workload = _build(FixedHitWorkload, wl, "workload")
    elif kind == "trace":
        p = Path(wl.pop("path"))
        wl["path"] = str(p if p.is_absolute() else (base_dir / p).resolve())
        workload = _build(TraceWorkload, wl, "workload")
    else:
        raise ValueError(f"workload kind {kind!r}: expected 'agentic', 'fixed_hit' or 'trace'")
    sla = _build(Sla, doc.get("sla", {"ttft_s": 10.0, "tpot_s": 0.1}), "sla")
    settings = _build(SimSettings, doc.get("sim", {}), "sim")
    modes = tuple(_mode(m) for m in doc.get("mode", []))
    if not modes:
        raise ValueError("no [[mode]] in the scenario")
    return Scenario(model, workload, sla, modes, settings)


def load(paths: list[Path]) -> Scenario:
    """One scenario from one or more files (modes concatenated, the rest equal)."""
    scenarios = [parse(tomllib.loads(Path(p).read_text()), Path(p).parent) for p in paths]
    first = scenarios[0]
    for p, s in zip(paths[1:], scenarios[1:]):
        for name in ("model", "workload", "sla", "settings"):
            if getattr(s, name) != getattr(first, name):
                raise ValueError(f"{p}: [{name}] differs from {paths[0]}; modes must share it")
    modes = tuple(m for s in scenarios for m in s.modes)
    names = [m.name for m in modes]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate mode names: {names}")
    return Scenario(first.model, first.workload, first.sla, modes, first.settings)
