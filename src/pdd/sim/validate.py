"""`pdd sim --validate RUN`: replay a `pdd bench` run in the simulator.

For every mode of RUN (results/<bench run>) it simulates that mode's saved
deploy.toml (+ overrides) on the saved workload.json with the run's SLA and
the CPU profile calibrated from the run's own steps.jsonl files, and writes
RUN/validation.json with signed relative errors, (sim - real) / real:

    {"modes": {mode: {"ttft_p50", "ttft_p90", "tpot_mean", "goodput_rps",
                      "real": {...}, "sim": {...}, "sim_range": {...},
                      "decisions": {...}, "samples": {"real": ..., "sim": ...}}},
     "targets": {...}, ...}

The replay sends every request when the run's client sent it (`arrivals`
"recorded", the default: each record's `arrival_s`), a closed-loop turn never
before its predecessor has ended in the simulation (`BenchStream`; such
turns are counted, "arrivals_held"). This is a replay of the run's trace: it
tests what the cluster did with the requests it got, in the phases it got
them. `arrivals="closed-loop"` closes the loop on the simulated times
instead, as `pdd sim -c` does for a new workload: each simulated end moves
its session's later turns, so a timing error of one request moves the phase
of every later one against the cold prompts on P, and the errors mix that
chance in (wan-bound runs `-69`, `-71`..`-75`: the five seeds' PDD TTFT p50
spread over 0.04-0.13 s closed, 0.01-0.08 s recorded; README, session 38).

Step times are drawn with the scatter the calibration measured (a real run
is one draw of a noisy machine), so every mode is simulated with `seeds`
seeds: "sim" holds the median over seeds (the prediction, which the errors
use), "sim_range" each metric's [min, max] over seeds. On a closed-loop
workload of ~40 requests a percentile that falls between two clusters of
requests moves by 20-40% with whether one warm turn more lands behind a
cold prefill, in the real run as in the simulated one (the validate preset
is shaped so that p50 and p90 do not).

`summarize` reads several validations of one workload: per mode and metric
the real spread, the errors and counts within target, and the percentiles
pooled over every run's requests ("samples": each request's TTFT and TPOT,
real and over all seeds), which compare the two systems rather than two
draws of them.

`decisions` compares, request by request, the pipeline the real router chose
(records.jsonl) with the simulator's: how many agree, and the pairs that
differ ("relay -> direct": real relay, simulated direct). `lifecycle` goes
further: per PDD request, the outcome and the lifecycle's decisions in order
(`pdd.policy.lifecycle_log`: the router's logged commands, or its notes).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path

from pdd.deploy.spec import load_spec
from pdd.measure.files import load_workload, read_records, write_json
from pdd.measure.metrics import Sla, distribution
from pdd.measure.records import RequestRecord
from pdd.policy.lifecycle_log import notes_only, trace_log
from pdd.sim.calibration import CpuCalibration, fit, with_run_speeds
from pdd.sim.deployment import RuntimeOptions, model_shape
from pdd.sim.runtime import RuntimeMode, run_runtime_mode

METRICS = {
    "ttft_p50": ("ttft_s", "p50"),
    "ttft_p90": ("ttft_s", "p90"),
    "tpot_mean": ("tpot_s", "mean"),
    "goodput_rps": ("goodput_rps", None),
}
TARGETS = {"ttft_p50": 0.10, "ttft_p90": 0.10, "tpot_mean": 0.05}
ARRIVALS = ("recorded", "closed-loop")


def _get(entry: dict, key: str, sub: str | None) -> float | None:
    v = entry.get(key)
    if sub is not None:
        v = (v or {}).get(sub)
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def rel_error(sim: float | None, real: float | None) -> float | None:
    if sim is None or real is None or real == 0:
        return None
    return (sim - real) / real


def modes_of(run: Path, summary: dict) -> list[RuntimeMode]:
    out = []
    for name, real in summary.get("modes", {}).items():
        if "error" in real:
            continue
        deploy = run / name / "deploy.toml"
        path = deploy if deploy.is_file() else Path(real.get("config", ""))
        if not path.is_file():
            continue
        out.append(RuntimeMode(name, str(path), real.get("overrides"), run=name))
    return out


def validate(run: Path, calibration: CpuCalibration | None = None,
             opts: RuntimeOptions = RuntimeOptions(), seeds: int = 5, run_speeds: bool = False,
             arrivals: str = "recorded") -> dict:
    """`run_speeds` (with a `calibration`): keep its fits, measure the
    machine's speed per instance on the replayed run's own steps
    (`calibration.with_run_speeds`); `arrivals`: "recorded" (send each
    request when the run sent it) or "closed-loop" (module docstring)."""
    if arrivals not in ARRIVALS:
        raise ValueError(f"arrivals: one of {', '.join(ARRIVALS)}, not {arrivals!r}")
    run = Path(run)
    summary = json.loads((run / "summary.json").read_text())
    sla = Sla(**summary["sla"])
    workload = load_workload(run / "workload.json")
    modes = modes_of(run, summary)
    if not modes:
        raise ValueError(f"{run}: no mode with a deploy.toml to replay")
    if calibration is None:
        calibration = fit([run], model_shape(load_spec(modes[0].config_path)))
    elif run_speeds:
        calibration = with_run_speeds(calibration, [run], model_shape(load_spec(modes[0].config_path)))
    out: dict = {"run": str(run), "sla": summary["sla"], "targets": TARGETS,
                 "calibration": calibration.to_dict(),
                 "options": vars(opts), "run_speeds": run_speeds, "arrivals": arrivals,
                 "seeds": seeds if opts.step_jitter else 1, "modes": {}}
    for m in modes:
        real = summary["modes"][m.name]
        # The bench's warm-up requests went through the same router first
        # (one by default; runs before the field was recorded used the default).
        warmup = int(real.get("warmup_requests", 1))
        real_path = run / m.name / "records.jsonl"
        real_records = read_records(real_path) if real_path.is_file() else []
        sent = ({r.request_id: r.arrival_s for r in real_records}
                if arrivals == "recorded" and real_records else None)
        runs = [run_runtime_mode(m, workload, sla, calibration, dataclasses.replace(opts, seed=opts.seed + k),
                                 warmup=warmup, arrivals=sent)
                for k in range(out["seeds"])]
        row: dict = {"real": {k: _get(real, *v) for k, v in METRICS.items()}, "sim": {}, "sim_range": {}}
        for metric, (key, sub) in METRICS.items():
            vals = [v for v in (_get(entry, key, sub) for entry, _, _ in runs) if v is not None]
            row["sim"][metric] = statistics.median(vals) if vals else None
            row["sim_range"][metric] = [min(vals), max(vals)] if vals else None
            row[metric] = rel_error(row["sim"][metric], row["real"][metric])
        sim, records, _ = runs[0]
        row["sim"]["pipelines"] = sim["sim"]["pipelines"]
        if sent is not None:
            row["sim"]["arrivals_held"] = max(entry["sim"]["arrivals_held"] for entry, _, _ in runs)
        # Every request's TTFT and TPOT, real and over all seeds, for the
        # summary over several runs (`summarize`: pooled percentiles).
        row["samples"] = {"real": _samples(real_records),
                          "sim": _samples([r for _, recs, _ in runs for r in recs])}
        # Decisions of the first seed's replay, request by request.
        row["decisions"] = compare_decisions(real_records, records)
        row["lifecycle"] = compare_lifecycles(real_records, records)
        out["modes"][m.name] = row
    write_json(run / "validation.json", out)
    return out


def _samples(records: list[RequestRecord]) -> dict:
    ok = [r for r in records if not r.failed and r.ttft_s is not None]
    return {"ttft_s": [round(r.ttft_s, 6) for r in ok],
            "tpot_s": [round(r.tpot_s, 6) for r in ok if r.tpot_s is not None]}


# Both sides label by `pdd.policy.lifecycle_io.Outcome`. Runs recorded
# before that labelled a filtered request "relay_only" (the name WAN-down
# requests keep) and a cancelled one "relay".
_LEGACY = {("relay_only", "relay_filtered"), ("relay", "relay_cancelled")}


def compare_decisions(real_records: list[RequestRecord], sim_records: list) -> dict | None:
    real = {r.request_id: r.pipeline for r in real_records}
    agree, differ, n = 0, {}, 0
    for r in sim_records:
        if r.request_id not in real or real[r.request_id] is None:
            continue         # baselines: the router records no pipeline
        n += 1
        want = real[r.request_id]
        if want == r.pipeline or (want, r.pipeline) in _LEGACY:
            agree += 1
        else:
            key = f"{want} -> {r.pipeline}"
            differ[key] = differ.get(key, 0) + 1
    return {"compared": n, "agree": agree, "differ": differ} if n else None


def _log_of(record: RequestRecord) -> tuple[str, ...] | None:
    """The router's (or the simulator's) "lifecycle" event: its command words."""
    return next((tuple(e["log"]) for e in record.events if e.get("name") == "lifecycle"), None)


def compare_lifecycles(real_records: list[RequestRecord], sim_records: list) -> dict | None:
    """Per PDD request, the outcome and the lifecycle's decisions in order
    (`policy.lifecycle_log`): the command words where the run logged them,
    else the lifecycle's notes in its trace (runs recorded before the log)."""
    real = {r.request_id: r for r in real_records if r.pipeline is not None}
    agree, n, basis, differ = 0, 0, set(), []
    for r in sim_records:
        want, got = real.get(r.request_id), _log_of(r)
        if want is None or got is None:
            continue
        full = _log_of(want)
        basis.add("commands" if full is not None else "notes")
        want_log = (want.pipeline,) + (full if full is not None else trace_log(want.events))
        got_log = (r.pipeline,) + (got if full is not None else notes_only(got))
        n += 1
        if want_log == got_log or (want_log[0], got_log[0]) in _LEGACY and want_log[1:] == got_log[1:]:
            agree += 1
        elif len(differ) < 5:
            differ.append({"request_id": r.request_id, "real": list(want_log), "sim": list(got_log)})
    return {"compared": n, "agree": agree, "basis": sorted(basis), "differ": differ} if n else None


def print_table(v: dict) -> None:
    w = 32
    print(f"{'mode':<12}" + "".join(f"{m:>{w}}" for m in METRICS))
    print(f"{'':<12}" + "".join(f"{'real -> sim (err) [sim range]':>{w}}" for _ in METRICS))
    for name, row in v["modes"].items():
        cells = []
        for metric in METRICS:
            r, s, e = row["real"][metric], row["sim"][metric], row[metric]
            lo_hi = (row.get("sim_range") or {}).get(metric)
            unit = 1e3 if metric == "tpot_mean" else 1.0
            txt = "n/a" if e is None else f"{r * unit:.3g}->{s * unit:.3g} ({e:+.0%})"
            if e is not None and lo_hi and v.get("seeds", 1) > 1:
                txt += f" [{lo_hi[0] * unit:.3g}-{lo_hi[1] * unit:.3g}]"
            cells.append(f"{txt:>{w}}")
        print(f"{name:<12}" + "".join(cells))
    print(f"TTFT in s, TPOT in ms, goodput in req/s; sim: median of {v.get('seeds', 1)} jitter seed(s); "
          "targets: |err| <= 10% TTFT, 5% TPOT")
    arrivals = v.get("arrivals", "closed-loop")
    held = {name: row["sim"].get("arrivals_held") for name, row in v["modes"].items()}
    print(f"arrivals: {arrivals}" + ("" if arrivals != "recorded" else
          " (the run's send times; turns held past theirs until their predecessor ended: "
          + ", ".join(f"{n} {h}" for n, h in held.items() if h is not None) + ")"))
    for name, row in v["modes"].items():
        d = row.get("decisions")
        if d:
            print(f"{name}: pipeline decisions agree on {d['agree']}/{d['compared']} requests"
                  + (f" (real -> sim: {d['differ']})" if d["differ"] else ""))
        lc = row.get("lifecycle")
        if lc:
            print(f"{name}: lifecycle decisions ({'+'.join(lc['basis'])}) agree on "
                  f"{lc['agree']}/{lc['compared']} requests")


def summarize(runs: list[dict]) -> dict:
    """Several validations of one workload: per mode and metric, the real
    values' spread across runs (the machine's own repeatability), the signed
    errors, how many are within target, and how many real values fall inside
    the simulator's seed range."""
    out: dict = {"runs": [v["run"] for v in runs], "modes": {},
                 "arrivals": sorted({v.get("arrivals", "closed-loop") for v in runs})}
    for name in dict.fromkeys(n for v in runs for n in v["modes"]):
        rows = [v["modes"][name] for v in runs if name in v["modes"]]
        cell = {}
        for metric in METRICS:
            real = [r["real"][metric] for r in rows if r["real"][metric] is not None]
            errs = [r[metric] for r in rows if r[metric] is not None]
            inside = [lo <= r["real"][metric] <= hi for r in rows
                      if r["real"][metric] is not None and (r.get("sim_range") or {}).get(metric)
                      for lo, hi in [r["sim_range"][metric]]]
            target = TARGETS.get(metric)
            cell[metric] = {
                "real_min": min(real) if real else None, "real_max": max(real) if real else None,
                "errors": errs,
                "within_target": None if target is None else sum(abs(e) <= target for e in errs),
                "real_in_sim_range": sum(inside), "n": len(errs)}
        out["modes"][name] = cell
    # Pooled: every request of every run against every simulated request of
    # every replay (all seeds), per mode. A single run's median moves with
    # which requests queued behind which; pooling N runs averages that out
    # on both sides, so this compares the two systems, not two draws.
    out["pooled"] = {}
    for name in out["modes"]:
        samples = [v["modes"][name].get("samples") for v in runs if name in v["modes"]]
        if not samples or any(x is None for x in samples):
            continue
        row = {"runs": len(samples)}
        for metric in TARGETS:      # the same statistics as summarize_mode's
            key, sub = METRICS[metric]
            real = [x for smp in samples for x in smp["real"][key]]
            sim = [x for smp in samples for x in smp["sim"][key]]
            if real and sim:
                r, m = distribution(real)[sub], distribution(sim)[sub]
                row[metric] = {"real": r, "sim": m, "error": rel_error(m, r)}
        out["pooled"][name] = row
    # Over every mode: how many within target, and the median |error|.
    out["totals"] = {}
    for metric, target in TARGETS.items():
        errs = [e for cell in out["modes"].values() for e in cell[metric]["errors"]]
        if errs:
            out["totals"][metric] = {"within_target": sum(abs(e) <= target for e in errs),
                                     "n": len(errs),
                                     "median_abs_error": statistics.median(abs(e) for e in errs)}
    return out


def print_summary(s: dict) -> None:
    print(f"== {len(s['runs'])} runs: real min-max | signed errors | within target | real inside sim range")
    for name, cell in s["modes"].items():
        for metric, c in cell.items():
            if not c["n"]:
                continue
            unit = 1e3 if metric == "tpot_mean" else 1.0
            errs = " ".join(f"{e:+.0%}" for e in c["errors"])
            tgt = "-" if c["within_target"] is None else f"{c['within_target']}/{c['n']}"
            print(f"{name:<10} {metric:<12} {c['real_min'] * unit:8.3g}-{c['real_max'] * unit:<8.3g} "
                  f"{errs:<24} {tgt:>5} {c['real_in_sim_range']}/{c['n']}")
    if s.get("pooled"):
        print("== pooled over the runs (each mode's requests of all runs; sim: all seeds)")
        for name, row in s["pooled"].items():
            cells = []
            for metric in TARGETS:
                c = row.get(metric)
                if c:
                    unit = 1e3 if metric == "tpot_mean" else 1.0
                    cells.append(f"{metric} {c['real'] * unit:.3g}->{c['sim'] * unit:.3g} ({c['error']:+.0%})")
            print(f"{name:<10} " + "  ".join(cells))
    print("all modes: " + "; ".join(
        f"{metric} within {TARGETS[metric]:.0%}: {t['within_target']}/{t['n']} "
        f"(median |error| {t['median_abs_error']:.1%})" for metric, t in s.get("totals", {}).items()))
