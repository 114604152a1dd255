"""Fit the CPU profile to engine steps measured by `pdd bench`.

Input: `steps.jsonl` files (one engine step a line, with its "instance"),
each read with the `deploy.toml` saved beside it, which says how many threads
each instance ran and which core it was pinned to. Steps are grouped by
thread count and fitted with `cost_model.calibrate`, one `CostModel` per
group. Instances pinned to a core they share with another instance are left
out while any other data exists: their wall times include the neighbour's
time slices, which the simulator adds back by itself.

The Prometheus text saved beside (metrics/*.prom) adds what KV transfers
really achieve per link: bytes sent over seconds spent, per run.

Output: a `CpuCalibration`, saved as JSON, which `pdd sim --calibration`
reads and `deployment.mode_from_spec` applies per instance and link.
"""

from __future__ import annotations

import json
import re
import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from pdd.sim.cost_model import CostModel, StepShape, calibrate
from pdd.sim.hardware import get_profile
from pdd.sim.model_shape import ModelShape

FIELDS = ("mfu", "mbu", "overhead_s", "per_seq_s")
_PROM = re.compile(r"^(?P<name>pdd_kv_sent_bytes_total|pdd_kv_transfer_seconds_sum)"
                   r"\{(?P<labels>[^}]*)\}\s+(?P<value>\S+)$")
_LINK = re.compile(r'link="([^"]+)"')


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


@dataclass(frozen=True)
class CpuCalibration:
    model: str
    fits: dict[int, ThreadFit] = field(default_factory=dict)
    # Per run (the folder a steps.jsonl sits in, i.e. the bench mode): median
    # measured / fitted step time of its instances that had a core alone.
    # Other processes on this shared machine slow a whole run down at once.
    load: dict[str, float] = field(default_factory=dict)
    # Per run and link ("local" / "wan"): KV bytes per second of transfer
    # time as P measured them (metrics/*.prom); "all" pools the runs. Sender,
    # receiver and relay share the cores with the engines, so a transfer is
    # slower than its line.
    transfer: dict[str, dict[str, float]] = field(default_factory=dict)

    def coefficients(self, num_threads: int) -> dict:
        """Pool coefficients for an engine with `num_threads` threads.

        An unmeasured thread count borrows the nearest measured one's
        efficiencies (the pool's chips already scale the peaks by threads).
        """
        if not self.fits:
            return {}
        k = min(self.fits, key=lambda t: (abs(t - num_threads), t))
        f = self.fits[k]
        return {name: getattr(f, name) for name in FIELDS}

    def time_scale(self, run: str | None) -> float:
        return self.load.get(run, 1.0) if run is not None else 1.0

    def transfer_bytes_s(self, link: str, run: str | None) -> float | None:
        """Measured KV throughput of one transfer on `link`: the run's, else pooled."""
        for key in (run, "all"):
            if key is not None and link in self.transfer.get(key, {}):
                return self.transfer[key][link]
        return None

    def to_dict(self) -> dict:
        return {"model": self.model, "hardware": "cpu",
                "fits": {str(k): {**vars(f), "instances": list(f.instances)}
                         for k, f in sorted(self.fits.items())},
                "load": dict(self.load), "transfer": self.transfer}

    @classmethod
    def from_dict(cls, d: dict) -> "CpuCalibration":
        fits = {int(k): ThreadFit(**{**v, "instances": tuple(v.get("instances", ()))})
                for k, v in d.get("fits", {}).items()}
        return cls(d.get("model", "?"), fits, dict(d.get("load", {})), dict(d.get("transfer", {})))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def read(cls, path: Path) -> "CpuCalibration":
        return cls.from_dict(json.loads(Path(path).read_text()))


def step_files(paths: list[Path]) -> list[Path]:
    """steps.jsonl files named directly or found under directories."""
    out: list[Path] = []
    for p in map(Path, paths):
        out += sorted(p.rglob("steps.jsonl")) if p.is_dir() else [p]
    if not out:
        raise ValueError(f"no steps.jsonl under {[str(p) for p in paths]}")
    return out


def _instances(steps_path: Path) -> dict[str, tuple[int, bool]]:
    """instance -> (engine threads, alone on its core), from the deploy.toml beside it."""
    deploy = steps_path.parent / "deploy.toml"
    if not deploy.is_file():
        return {}
    from pdd.deploy.spec import load_spec

    spec = load_spec(deploy)
    cores = Counter(i.cpu for i in spec.instances if i.cpu is not None)
    return {i.name: (i.engine.num_threads, i.cpu is None or cores[i.cpu] == 1) for i in spec.instances}


def load_records(paths: list[Path]) -> dict[int, list[dict]]:
    """Step records grouped by thread count, shared-core instances last resort.

    Each record gains "run" (its folder), "instance" ("run/name") and "alone".
    """
    alone: dict[int, list[dict]] = {}
    shared: dict[int, list[dict]] = {}
    for f in step_files(paths):
        info = _instances(f)
        tag = f.parent.name
        for line in f.read_text().splitlines():
            if not line.strip():
                continue
            rec = json.loads(line)
            threads, solo = info.get(rec.get("instance"), (1, True))
            rec.update(run=tag, instance=f"{tag}/{rec.get('instance')}", alone=solo)
            (alone if solo else shared).setdefault(threads, []).append(rec)
    return {t: alone.get(t) or shared[t] for t in sorted(set(alone) | set(shared))}


def fit(paths: list[Path], model: ModelShape, hardware: str = "cpu",
        drop_outliers: float = 0.02) -> CpuCalibration:
    """One roofline fit per engine thread count.

    After a first fit, the `drop_outliers` share of steps with the largest
    relative error is dropped and the fit repeated: the first steps of a
    process (lazy allocations) and steps slowed by a foreign process would
    otherwise pull every coefficient.
    """
    fits: dict[int, ThreadFit] = {}
    ratios: dict[str, list[float]] = {}
    for threads, recs in load_records(paths).items():
        if len(recs) < 3:
            continue
        base = CostModel(model, get_profile(hardware), chips=threads)
        cal = calibrate(recs, base, balance=True)
        if drop_outliers > 0 and len(recs) > 50:
            err = [abs(cal.model.step_time(StepShape.from_record(r)) - r["wall_s"]) / r["wall_s"]
                   for r in recs]
            cut = sorted(err)[int(len(err) * (1 - drop_outliers)) - 1]
            cal = calibrate([r for r, e in zip(recs, err) if e <= cut], base, balance=True)
        m = cal.model
        fits[threads] = ThreadFit(m.mfu, m.mbu, m.overhead_s, m.per_seq_s, cal.num_records,
                                  cal.rmse_s, cal.r2,
                                  tuple(sorted({r["instance"] for r in recs})))
        for r in recs:
            if r["alone"]:
                ratios.setdefault(r["run"], []).append(
                    r["wall_s"] / m.step_time(StepShape.from_record(r)))
    load = {run: statistics.median(v) for run, v in sorted(ratios.items()) if len(v) >= 10}
    return CpuCalibration(model.name, fits, load, transfer_rates(paths))


def transfer_rates(paths: list[Path]) -> dict[str, dict[str, float]]:
    """{run: {link: bytes/s}} from the prefill instances' Prometheus text."""
    totals: dict[str, dict[str, list[float]]] = {}
    for f in step_files(paths):
        for prom in sorted((f.parent / "metrics").glob("*.prom")):
            for line in prom.read_text().splitlines():
                m = _PROM.match(line)
                if m is None or 'role="prefill"' not in m["labels"]:
                    continue
                link = _LINK.search(m["labels"])
                if link is None:
                    continue
                k = 0 if m["name"] == "pdd_kv_sent_bytes_total" else 1
                for run in (f.parent.name, "all"):
                    totals.setdefault(run, {}).setdefault(link[1], [0.0, 0.0])[k] += float(m["value"])
    return {run: {link: b / s for link, (b, s) in links.items() if b > 0 and s > 0}
            for run, links in totals.items()}


def apply(cost: CostModel, fit_: ThreadFit) -> CostModel:
    return replace(cost, **{name: getattr(fit_, name) for name in FIELDS})
