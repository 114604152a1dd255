"""Fit the CPU profile to engine steps measured by `pdd bench`.

Input: `steps.jsonl` files (one engine step a line, with its "instance"),
each read with the `deploy.toml` saved beside it (`calibration_steps`), which says how many threads
each instance ran, its role and which core it was pinned to. Steps are
grouped by thread count and fitted with `cost_model.calibrate`, one
`CostModel` per group. A step of an instance pinned to a core it shares
with another instance is left out while any other data exists when it
overlapped a neighbour's step (by the steps' wall-clock starts; steps
recorded without a start are all left out): its wall time holds the
neighbour's time slices, which the simulator adds back by itself.

Each role group (prefill; decode, which covers D, MD and RLD; colocated)
with enough steps of its own gets a fit of its own as well. The server
around an engine does different work on the engine's core per role: P's
process serialises and sends the KV of every prompt it prefills, D's
receives and streams. Measured here, a P step carries ~0.1 s of fixed cost
that a decoder's step does not, which one pooled fit spreads over the
per-token term: it then made 512-token chunks ~8% too slow and 80-token
warm-turn chunks ~9% too fast. An instance whose role has no fit of its own
uses the pooled one.

Replaying a run, each instance runs at its own measured speed: the mean
measured / fitted time of its own unshared steps (`instance_load`), else
its run's `load` (against the pooled fit). Two more things the roofline
cannot know are measured from the same steps: a step's factor by the
number of rows it multiplies (`ThreadFit.row_factors`: the engine's kernels
change with the rows; and each instance's own factor over its role's,
`instance_rows`), and what a core two engines time-slice keeps of its
speed (`core_sharing`, from the steps MD and RLD ran at the same time).

The Prometheus text saved beside (metrics/*.prom) adds what KV transfers
really achieve per link: bytes sent over seconds spent, per run; the
records.jsonl beside, how long the WAN's handshakes took beyond the line's
round trip (`handshake_queue`).

Output: a `CpuCalibration`, saved as JSON, which `pdd sim --calibration`
reads and `deployment.mode_from_spec` applies per instance and link.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdd.sim.calibration_factors import (  # the fit's own parts, in a module of their own
    _instance_row_factors, _instance_speeds, _lone_chunk, _lone_chunk_factors, _own_row_factor, _row_factor,
    _row_factors, _speed_factor, _weight,
)
from pdd.sim.calibration_steps import handshake_queues, load_records, read_records, role_group, transfer_rates
from pdd.sim.cost_model import CostModel, StepShape, calibrate
from pdd.sim.hardware import get_profile
from pdd.sim.model_shape import ModelShape

FIELDS = ("mfu", "mbu", "overhead_s", "per_seq_s", "attn_cost")
# A role group needs this many steps alone on a core for a fit of its own.
MIN_ROLE_RECORDS = 30


@dataclass(frozen=True)
class ThreadFit:
    mfu: float
    mbu: float
    overhead_s: float
    per_seq_s: float
    num_records: int = 0
    rmse_s: float = 0.0
    r2: float = 0.0
    instances: tuple[str, ...] = ()
    # Robust sigma of log(measured / fitted) over the fitted steps: the
    # scatter the simulator draws each step's time from (`step_jitter`).
    jitter: float = 0.0
    # A step of n tokens takes row_factors[row_bucket(n) - 1] x the fit (1.0
    # past the end): what the roofline's smooth curve in the rows misses.
    row_factors: tuple[float, ...] = ()
    # A decoder's step that decodes nothing (a new sequence's first step:
    # the partial block it recomputes, or an extend, alone) takes this x its
    # row class's time (`lone_chunk_factor`).
    lone_chunk: float = 1.0
    # One attention FLOP's cost in weight-matmul FLOPs (`CostModel.attn_cost`);
    # calibrations saved before it read 1.0.
    attn_cost: float = 1.0


@dataclass(frozen=True)
class CpuCalibration:
    model: str
    fits: dict[int, ThreadFit] = field(default_factory=dict)
    # Per run (the folder a steps.jsonl sits in, i.e. the bench mode): weighted mean
    # measured / fitted step time of its instances that had a core alone.
    # Other processes on this shared machine slow a whole run down at once.
    load: dict[str, float] = field(default_factory=dict)
    # Per run and link ("local" / "wan"): KV bytes per second of transfer
    # time as P measured them (metrics/*.prom); "all" pools the runs. Sender,
    # receiver and relay share the cores with the engines, so a transfer is
    # slower than its line.
    transfer: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per role group ("prefill", "decode", "colocated") and thread count.
    role_fits: dict[str, dict[int, ThreadFit]] = field(default_factory=dict)
    # Per instance alone on its core ("run/name"): weighted mean measured / fitted
    # step time of its own steps against its role's fit. Replaying that run,
    # the instance runs at this speed (others at their run's `load`).
    instance_load: dict[str, float] = field(default_factory=dict)
    # Throughput of a core two busy engines time-slice, relative to one
    # engine alone (`core_sharing`); 1.0 without shared-core steps to tell.
    core_sharing: float = 1.0
    # Per run and link: bytes of other transfers a handshake's frames met in
    # the line's buffers beyond what the simulated line holds, on average
    # (`calibration_steps.handshake_queues`); "all" pools the runs.
    handshake_queue: dict[str, dict[str, float]] = field(default_factory=dict)
    # Per instance ("run/name"): its own factor by row class over its role's
    # (`_instance_row_factors`); replaying that run, its steps of a class run
    # at role factor x this.
    instance_rows: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def fit_for(self, num_threads: int, role: str | None = None) -> ThreadFit | None:
        """The role's own fit at this thread count, else the pooled one.

        An unmeasured thread count borrows the nearest measured one's
        efficiencies (the pool's chips already scale the peaks by threads).
        """
        own = self.role_fits.get(role_group(role), {}) if role is not None else {}
        if num_threads in own:
            return own[num_threads]
        if not self.fits:
            return None
        return self.fits[min(self.fits, key=lambda t: (abs(t - num_threads), t))]

    def coefficients(self, num_threads: int, role: str | None = None) -> dict:
        """Pool coefficients for an engine with `num_threads` threads in `role`."""
        f = self.fit_for(num_threads, role)
        return {} if f is None else {name: getattr(f, name) for name in FIELDS}

    def time_scale(self, run: str | None, instance: str | None = None) -> float:
        if run is None:
            return 1.0
        own = self.instance_load.get(f"{run}/{instance}") if instance is not None else None
        return own if own is not None else self.load.get(run, 1.0)

    def transfer_bytes_s(self, link: str, run: str | None) -> float | None:
        """Measured KV throughput of one transfer on `link`: the run's, else pooled."""
        for key in (run, "all"):
            if key is not None and link in self.transfer.get(key, {}):
                return self.transfer[key][link]
        return None

    def row_factors(self, num_threads: int, role: str, run: str | None = None,
                    instance: str | None = None) -> tuple[float, ...]:
        """A step's factor by row class on `instance` of `run`: its role's,
        times the instance's own where measured."""
        f = self.fit_for(num_threads, role)
        base = f.row_factors if f is not None else ()
        own = self.instance_rows.get(f"{run}/{instance}", ()) if run is not None and instance else ()
        if not own:
            return base
        n = max(len(base), len(own))
        at = lambda v, k: v[k] if k < len(v) else 1.0
        return tuple(round(at(base, k) * at(own, k), 4) for k in range(n))

    def handshake_queue_bytes(self, link: str, run: str | None) -> float:
        """Bytes ahead of a handshake on `link` (the run's, else pooled; 0 unmeasured)."""
        for key in (run, "all"):
            if key is not None and link in self.handshake_queue.get(key, {}):
                return self.handshake_queue[key][link]
        return 0.0

    def to_dict(self) -> dict:
        dump = lambda fits: {str(k): {**vars(f), "instances": list(f.instances),
                                      "row_factors": list(f.row_factors)}
                             for k, f in sorted(fits.items())}
        return {"model": self.model, "hardware": "cpu", "fits": dump(self.fits),
                "role_fits": {g: dump(f) for g, f in sorted(self.role_fits.items())},
                "load": dict(self.load), "instance_load": dict(self.instance_load),
                "core_sharing": self.core_sharing, "transfer": self.transfer,
                "handshake_queue": self.handshake_queue,
                "instance_rows": {k: list(v) for k, v in self.instance_rows.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "CpuCalibration":
        read = lambda fits: {int(k): ThreadFit(**{**v, "instances": tuple(v.get("instances", ())),
                                                  "row_factors": tuple(v.get("row_factors", ()))})
                             for k, v in fits.items()}
        return cls(d.get("model", "?"), read(d.get("fits", {})), dict(d.get("load", {})),
                   dict(d.get("transfer", {})),
                   {g: read(f) for g, f in d.get("role_fits", {}).items()},
                   dict(d.get("instance_load", {})), float(d.get("core_sharing", 1.0)),
                   dict(d.get("handshake_queue", {})),
                   {k: tuple(v) for k, v in d.get("instance_rows", {}).items()})

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> "CpuCalibration":
        return cls.from_dict(json.loads(Path(path).read_text()))


def core_sharing(recs: list[dict], model_of) -> float | None:
    """Throughput of a core time-sliced between two busy engines, as a
    fraction of one engine's alone (1.0: a perfect processor sharing).

    Over the steps that overlapped a neighbour's: a step of A seconds alone
    that overlapped neighbours' steps for O seconds takes A + O (1 - e s)
    when it runs at e s while both do (s: its share of the core, "share",
    1/2 for two engines of equal priority). Pooled: e = (sum O - sum(W - A))
    / sum(O s). `model_of(rec)` is the step's alone time, fit x instance speed.
    Measured here for MD and RLD on one core: e ~ 0.9, two processes
    sharing a core lose ~10% to switching and to each other's caches.
    """
    extra = overlap = weighted = 0.0
    for r in recs:
        o = r.get("overlap_s") or 0.0
        if r["alone"] or o < 0.2 * r["wall_s"]:
            continue
        extra += r["wall_s"] - model_of(r)
        overlap += o
        weighted += o * r.get("share", 0.5)
    if overlap < 5.0:
        return None
    return min(1.0, max(0.5, (overlap - extra) / weighted))


def fit(paths: list[Path], model: ModelShape, hardware: str = "cpu",
        drop_outliers: float = 0.02) -> CpuCalibration:
    """One roofline fit per engine thread count, and per role group where it has data.

    After a first fit, the `drop_outliers` share of steps with the largest
    relative error is dropped and the fit repeated: the first steps of a
    process (lazy allocations) and steps slowed by a foreign process would
    otherwise pull every coefficient.

    Then, in order: each instance's speed (`instance_load`), each role fit's
    row factors (`row_factors`, against the instances' speeds),
    the instances' speeds again with those factors, and what a shared core
    keeps (`core_sharing`).
    """
    fits: dict[int, ThreadFit] = {}
    role_fits: dict[str, dict[int, ThreadFit]] = {}
    # Per run: (measured / fitted, weight), weighed as `_weight` says.
    every = read_records(paths)
    by_threads = load_records(every)
    models: dict[tuple[int, str], CostModel] = {}     # (threads, group) -> its fitted model
    pooled_models: dict[int, CostModel] = {}
    for threads, recs in by_threads.items():
        if len(recs) < 3:
            continue
        base = CostModel(model, get_profile(hardware), chips=threads)
        fits[threads], pooled = _fit_group(recs, base, drop_outliers)
        pooled_models[threads] = pooled
        groups: dict[str, list[dict]] = {}
        for r in recs:
            # a decoder's lone chunks have a factor of their own (`_lone_chunk_factors`):
            # in its role's fit they would bend the compute term that the
            # decode steps leave free
            if r["alone"] and not _lone_chunk(r):
                groups.setdefault(r["group"], []).append(r)
        own = {}
        for group, grecs in sorted(groups.items()):
            if len(grecs) >= MIN_ROLE_RECORDS:
                role_fits.setdefault(group, {})[threads], own[group] = _fit_group(grecs, base, drop_outliers)
        for group in ("prefill", "decode", "colocated"):
            models[threads, group] = own.get(group, pooled)
    load, alone = _alone_speeds(by_threads, pooled_models, models)
    instance_load = _instance_speeds(alone, {})
    factors = _row_factors(alone, instance_load)
    for (group, threads), rf in factors.items():
        if threads in role_fits.get(group, {}):
            role_fits[group][threads] = replace(role_fits[group][threads], row_factors=rf)
    rows = {(g, t): f.row_factors for g, byt in role_fits.items() for t, f in byt.items()}
    instance_load = _instance_speeds(alone, rows)
    for (group, threads), lone in _lone_chunk_factors(alone, instance_load, rows).items():
        if threads in role_fits.get(group, {}):
            role_fits[group][threads] = replace(role_fits[group][threads], lone_chunk=lone)
        elif threads in fits:        # the decoders use the pooled fit (the factor is theirs only)
            fits[threads] = replace(fits[threads], lone_chunk=lone)

    instance_rows = _instance_row_factors(alone, instance_load, rows)

    def alone_s(r: dict) -> float:
        m = models.get((r["threads"], r["group"]))
        if m is None:
            return math.inf
        speed = instance_load.get(r["instance"], load.get(r["run"], 1.0))
        return (speed * m.step_time(StepShape.from_record(r)) * _row_factor(r, rows)
                * _own_row_factor(r, instance_rows))
    sharing = core_sharing([r for r in every if (r["threads"], r["group"]) in models], alone_s)
    return CpuCalibration(model.name, fits, load, transfer_rates(paths), role_fits, instance_load,
                          1.0 if sharing is None else sharing, handshake_queues(paths), instance_rows)


def _alone_speeds(by_threads: dict[int, list[dict]], pooled: dict[int, CostModel],
                  models: dict[tuple[int, str], CostModel]) -> tuple[dict[str, float], list[dict]]:
    """Each run's load (its steps' measured / fitted time against one
    reference for all runs: the pooled fit), and the steps that had their
    core alone, each with `fitted_s` by its own role's model."""
    ratios: dict[str, list[tuple[float, float]]] = {}
    alone: list[dict] = []
    for threads, recs in by_threads.items():
        if threads not in pooled:
            continue
        for r in recs:
            if r["alone"]:
                shape = StepShape.from_record(r)
                t = pooled[threads].step_time(shape)
                ratios.setdefault(r["run"], []).append((r["wall_s"] / t, _weight(r, t)))
                r["fitted_s"] = models[threads, r["group"]].step_time(shape)
                alone.append(r)
    return {run: _speed_factor(v) for run, v in sorted(ratios.items()) if len(v) >= 10}, alone


def with_run_speeds(cal: CpuCalibration, paths: list[Path], model: ModelShape,
                    hardware: str = "cpu") -> CpuCalibration:
    """`cal`'s fits (the roofline's coefficients per role, their row factors,
    the shared core's efficiency) with the speed of each run and instance in
    `paths` measured on its own steps against those fits.

    Replaying a run with a profile fitted on another one, the fits carry over
    (what a step costs for its shape) but the machine's state does not: this
    shared machine ran the same engine 5-15% faster or slower from one hour to
    the next, and the calibration run's speeds, applied to the replayed run's
    instances of the same names, read as a TPOT error of that size. The speeds
    come from the replayed run's engine steps, not from its TTFT or TPOT."""
    by_threads = load_records(read_records(paths))
    pooled: dict[int, CostModel] = {}
    models: dict[tuple[int, str], CostModel] = {}
    for threads in by_threads:
        if cal.fit_for(threads) is None:
            continue
        base = CostModel(model, get_profile(hardware), chips=threads)
        pooled[threads] = apply(base, cal.fit_for(threads))
        for group in ("prefill", "decode", "colocated"):
            models[threads, group] = apply(base, cal.fit_for(threads, group))
    load, alone = _alone_speeds(by_threads, pooled, models)
    rows = {(g, t): f.row_factors for g, byt in cal.role_fits.items() for t, f in byt.items()}
    speeds = _instance_speeds(alone, rows)
    return replace(cal, load=dict(cal.load) | load, instance_load=dict(cal.instance_load) | speeds,
                   instance_rows=dict(cal.instance_rows) | _instance_row_factors(alone, speeds, rows))


def _fit_group(recs: list[dict], base: CostModel, drop_outliers: float) -> tuple[ThreadFit, CostModel]:
    cal = calibrate(recs, base, balance=True)
    if drop_outliers > 0 and len(recs) > 50:
        err = [abs(cal.model.step_time(StepShape.from_record(r)) - r["wall_s"]) / r["wall_s"]
               for r in recs]
        cut = sorted(err)[int(len(err) * (1 - drop_outliers)) - 1]
        cal = calibrate([r for r, e in zip(recs, err) if e <= cut], base, balance=True)
    m = cal.model
    logs = sorted(math.log(r["wall_s"] / m.step_time(StepShape.from_record(r))) for r in recs)
    mid = statistics.median(logs)
    jitter = 1.4826 * statistics.median(abs(x - mid) for x in logs)    # MAD -> sigma
    return ThreadFit(m.mfu, m.mbu, m.overhead_s, m.per_seq_s, cal.num_records, cal.rmse_s, cal.r2,
                     tuple(sorted({r["instance"] for r in recs})), min(jitter, 0.5),
                     attn_cost=m.attn_cost), m


def apply(cost: CostModel, fit_: ThreadFit) -> CostModel:
    return replace(cost, **{name: getattr(fit_, name) for name in FIELDS})
