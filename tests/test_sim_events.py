"""The simulator's events are typed records that a run can log and compare
(`pdd.sim.events`, `pdd sim --event-log`)."""

from __future__ import annotations

import dataclasses
import io
import json
import random
import statistics
from pathlib import Path

import pytest

from pdd.measure import agentic
from pdd.measure.metrics import Sla
from pdd.measure.workload import Workload, WorkloadRequest
from pdd.sim import cluster as cluster_mod
from pdd.sim import events
from pdd.sim.events import EventLog
from pdd.sim.runner import simulate
from pdd.sim.runtime import RuntimeMode, run_runtime_mode
from pdd.sim.scenario import load

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "examples" / "sim" / "tiny.toml"
PDD = ROOT / "examples" / "pdd.toml"
# The example as it was when these tests were written (fp32, 100 Mbit/s, the
# default start-up loan): with today's bf16 P, 60 Mbit/s and a loan of one
# answer, the quick workload relays too little to hand anything over.
AS_WRITTEN = {"engine": {"dtype": "float32"}, "links": {"bandwidth_mbps": 100.0}, "policy": {"relay_startup_loan": 8}}


def pdd_as_written(path: Path) -> Path:
    """examples/pdd.toml with RLD back on MD's core at MD's priority, where it
    was when the lifecycle paths and the shared-core calibration were counted
    (session 21 moved it to P's core at nice 5), written to `path`."""
    text = PDD.read_text()
    i = text.index('role = "relay"')
    text = text[:i] + text[i:].replace("cpu = 0", "cpu = 1", 1).replace("nice = 5", "nice = 0", 1)
    path = Path(path)
    path.write_text(text)
    return path


def _tiny(seed: int = 3):
    sc = load([TINY])
    return dataclasses.replace(sc, workload=dataclasses.replace(sc.workload, duration_s=20.0, seed=seed))


def _log_of(scenario) -> tuple[str, dict]:
    buf = io.StringIO()
    summary = simulate(scenario, event_log=EventLog(buf))
    return buf.getvalue(), summary


def test_a_run_logs_the_same_events_twice():
    a, summary = _log_of(_tiny())
    b, _ = _log_of(_tiny())
    assert a == b
    lines = [json.loads(line) for line in a.splitlines()]
    # Every processed event of every mode, in order, and nothing else.
    for name, m in summary["modes"].items():
        assert sum(1 for e in lines if e["mode"] == name) == m["sim"]["num_events"] > 100
    assert [e["t"] for e in lines if e["mode"] == "pdd"] == sorted(e["t"] for e in lines if e["mode"] == "pdd")
    # ... and the log tells runs apart: another workload seed, another log.
    c, _ = _log_of(_tiny(seed=4))
    assert c != a


class StrictLog:
    """An `EventLog` that refuses any event not a frozen record of plain values."""

    def __init__(self) -> None:
        self.log = EventLog(io.StringIO())
        self.types: set[str] = set()
        self.n = 0

    def for_mode(self, mode: str) -> StrictLog:
        return self

    def write(self, time: float, record) -> None:
        cls = type(record)
        assert cls.__module__ == "pdd.sim.events", cls
        assert dataclasses.is_dataclass(record) and cls.__dataclass_params__.frozen, cls
        for f in dataclasses.fields(record):
            v = getattr(record, f.name)
            assert v is None or type(v) in (str, int, float, bool), (cls.__name__, f.name, v)
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(record, dataclasses.fields(record)[0].name, None)
        self.log.write(time, record)
        line = json.loads(self.log.out.getvalue().splitlines()[-1])
        assert line == {"t": time, "kind": record.KIND.name, "type": cls.__name__,
                        **{f.name: getattr(record, f.name) for f in dataclasses.fields(record)}}
        self.log.out.seek(0)
        self.log.out.truncate()
        self.types.add(cls.__name__)
        self.n += 1


def test_every_event_of_the_example_pdd_deployment_is_a_plain_record(monkeypatch):
    run = cluster_mod.Cluster.run

    def run_with_cuts(self, until_s):          # also the failure records
        self.cut_link("wan", 3.0, 6.0)
        self.cut_link("wan", 20.0, 20.5)
        return run(self, until_s)
    monkeypatch.setattr(cluster_mod.Cluster, "run", run_with_cuts)
    wl = agentic.generate(dataclasses.replace(agentic.PRESETS["quick"], num_requests=30))
    log = StrictLog()
    entry, records, _ = run_runtime_mode(RuntimeMode("pdd", str(PDD), AS_WRITTEN), wl, Sla(10.0, 1.0), event_log=log)
    assert log.n == entry["sim"]["num_events"]
    assert {"Arrival", "CoreDone", "TransferDone", "BeginArrives", "HaveArrives", "FlowTailArrives",
            "MdReadyReachesRld", "ExtendReachesMd", "LinkCut", "LinkRestored"} <= log.types
    assert any(r.pipeline == "relay" for r in records)
    # Every record type the simulator defines is a frozen dataclass.
    for obj in vars(events).values():
        if isinstance(obj, type) and hasattr(obj, "KIND"):
            assert obj.__dataclass_params__.frozen, obj


def _own_cores_pdd(tmp_path: Path, mode: str = "catch_up", pace: float = 0) -> Path:
    """examples/pdd.toml with every instance on a core of its own (their steps
    are StepEnd events of their own) and the handoff `mode` forced (the
    paused catch-up unless told otherwise)."""
    text = PDD.read_text()
    i = text.index('name = "rld0"')
    text = text[:i] + text[i:].replace("cpu = 0", "cpu = 2", 1)
    text = text.replace('handoff_mode = "auto"', f'handoff_mode = "{mode}"\nhandoff_pace_ratio = {pace}')
    path = tmp_path / "pdd.toml"
    path.write_text(text)
    return path


def test_the_log_of_one_relayed_request_tells_its_story(tmp_path):
    rng = random.Random(1)
    prompt = [rng.randrange(100, 40000) for _ in range(1536)]
    wl = Workload("one", [WorkloadRequest("r1", 0.0, prompt, 200)], block_size=16)
    buf = io.StringIO()
    _, records, _ = run_runtime_mode(RuntimeMode("pdd", str(_own_cores_pdd(tmp_path)), AS_WRITTEN), wl, Sla(10.0, 1.0),
                                     event_log=EventLog(buf))
    (rec,) = records
    assert (rec.pipeline, rec.handoff_mode, rec.failed) == ("relay", "catch_up", False)
    log = [json.loads(line) for line in buf.getvalue().splitlines()]
    types = [e["type"] for e in log]

    def at(type_: str, **fields) -> list[int]:
        return [i for i, e in enumerate(log) if e["type"] == type_
                and all(e.get(k) == v for k, v in fields.items())]

    def steps(iid: str) -> list[int]:
        """The step ends that ran: a macro step cut short at a boundary leaves
        its first planned end queued under an older version (ignored)."""
        live, newest = [], -1
        for i in at("StepEnd", instance_id=iid):
            if log[i]["version"] >= newest:
                live.append(i)
                newest = log[i]["version"]
        return live

    assert types[0] == "Arrival" and log[0]["request_id"] == "r1"
    # P's two copies: to MD over the WAN, yielding the line (a relay's copy
    # is background), streamed while P computes, so a BEGIN, a HAVE and a
    # tail after the prefill; to RLD over the local RDMA line once the
    # prefill is over (`PolicyConfig.stream_relay_copy` off), a BEGIN and a
    # HAVE after P's last step and no tail.
    (b_rld,), (h_rld,) = (at(t, flow_id="r1/rld/rld0", link="rdma-A") for t in ("BeginArrives", "HaveArrives"))
    assert not at("FlowTailArrives", flow_id="r1/rld/rld0")
    (b_md,), (h_md,), (t_md,) = (at(t, flow_id="r1/md/md0", link="wan")
                                 for t in ("BeginArrives", "HaveArrives", "FlowTailArrives"))
    assert b_rld < h_rld and b_md < h_md < t_md
    assert log[b_md]["background"] and not log[b_rld]["background"]
    assert steps("p0") and b_md < min(steps("p0")) and max(steps("p0")) < b_rld
    assert max(steps("p0")) < t_md                          # the prefill is over before the tail
    # MD holds the KV: RLD hears it; the handoff's batches go to MD as
    # extends that continue one another from the prompt's end; RLD hears
    # of each but the final one, after which MD decodes the rest alone.
    (ready,) = at("MdReadyReachesRld", request_id="r1", md_id="md0", to_id="rld0")
    assert t_md < ready
    extends = at("ExtendReachesMd", request_id="r1", to_id="md0")
    assert len(extends) >= 2 and ready < extends[0]
    assert [log[i]["final"] for i in extends] == [False] * (len(extends) - 1) + [True]
    ctx = 1536
    for i in extends:
        assert log[i]["ctx_start"] == ctx
        ctx += log[i]["num_tokens"]
        assert log[i]["end"] == ctx - 1536
    heard = at("ExtendedReachesRld", request_id="r1", to_id="rld0")
    assert [log[i]["end"] for i in heard] == [log[i]["end"] for i in extends[:-1]]
    for ext, back in zip(extends, heard):
        assert ext < min(s for s in steps("md0") if s > ext) < back    # MD ran the batch, then said so
    # RLD made the tokens up to the handoff, MD the rest, and nothing after.
    assert any(h_rld < s < extends[-1] for s in steps("rld0"))
    assert not any(s > extends[-1] for s in steps("rld0"))
    assert len([s for s in steps("md0") if s > extends[-1]]) >= 2
    assert types[-1] == "StepEnd" and log[-1]["instance_id"] == "md0"
    assert not any(t in types for t in ("CopyFailed", "CancelTaken", "LinkCut"))


def test_pdd_sim_event_log_flag(tmp_path):
    from pdd.cli import main

    out = tmp_path / "events.jsonl"
    assert main(["sim", "-c", str(TINY), "--duration", "10", "--no-plots", "--event-log", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert {e["mode"] for e in lines} == {"pdd", "naive-xdc", "colocated"}
    assert lines[0]["type"] == "Arrival"


def test_an_overlap_handoff_in_the_simulator_keeps_rld_decoding_past_the_final_batch(tmp_path):
    """The overlap handoff forced where MD is no faster than RLD (each on a
    core of its own): the final batch does not stop RLD, which decodes on
    beside MD until `overlap_max_lag` tokens past it; then it pauses and MD's
    own tokens catch up and take the stream. Every token reaches the user once."""
    path = _own_cores_pdd(tmp_path, "overlap")
    rng = random.Random(1)
    prompt = [rng.randrange(100, 40000) for _ in range(1536)]
    wl = Workload("one", [WorkloadRequest("r1", 0.0, prompt, 200)], block_size=16)
    buf = io.StringIO()
    _, records, _ = run_runtime_mode(RuntimeMode("pdd", str(path), AS_WRITTEN), wl, Sla(10.0, 1.0),
                                     event_log=EventLog(buf))
    (rec,) = records
    assert (rec.pipeline, rec.handoff_mode, rec.failed) == ("relay", "overlap", False)
    assert rec.output_tokens == 200 and len(rec.token_times_s) == 200
    assert all(a <= b for a, b in zip(rec.token_times_s, rec.token_times_s[1:]))
    words = rec.events[0]["log"]
    assert "extend_final" in words and "note:overlap_pause" in words and "pause_at:rld" not in words
    assert words.index("extend_final") < words.index("note:overlap_pause") < words.index("note:handoff_complete")
    log = [json.loads(line) for line in buf.getvalue().splitlines()]
    final = [i for i, e in enumerate(log) if e["type"] == "ExtendReachesMd" and e["final"]]
    assert len(final) == 1
    assert any(e["type"] == "StepEnd" and e["instance_id"] == "rld0" for e in log[final[0]:])
    # RLD's tokens: those the final batch carried, then overlap_max_lag (8)
    # more; the first of them P's when it went out from P (RLD's copy due
    # within `first_token_max_stall_s`).
    assert rec.first_token_from_p
    assert rec.rld_tokens + rec.first_token_from_p == log[final[0]]["end"] + 8 and rec.handoff_gap_s is not None


def test_a_paced_handoff_in_the_simulator_lets_mds_tokens_catch_up_without_a_stall(tmp_path):
    """MD no faster than RLD (each on a core of its own) and the paced
    handoff forced: the final batch leaves RLD decoding, RLD's tokens reach
    the user at a stretched pace (the lifecycle's `LifecycleWake`s let them
    out) until MD's own tokens catch the user's stream up; RLD is never
    paused, every token reaches the user once, and the handoff's largest gap
    stays under twice the median gap, where the paused handoff of the same
    request stalls for longer."""
    rng = random.Random(1)
    prompt = [rng.randrange(100, 40000) for _ in range(1536)]
    wl = Workload("one", [WorkloadRequest("r1", 0.0, prompt, 200)], block_size=16)
    recs = {}
    for mode, pace in (("paced", 1.5), ("one_shot", 0)):
        buf = io.StringIO()
        _, records, _ = run_runtime_mode(RuntimeMode("pdd", str(_own_cores_pdd(tmp_path, mode, pace)), AS_WRITTEN),
                                         wl, Sla(10.0, 1.0), event_log=EventLog(buf))
        (rec,) = records
        recs[mode] = rec
        assert (rec.pipeline, rec.handoff_mode, rec.failed) == ("relay", mode, False)
        assert rec.output_tokens == 200 and len(rec.token_times_s) == 200
        assert all(a <= b for a, b in zip(rec.token_times_s, rec.token_times_s[1:]))
        log = [json.loads(line) for line in buf.getvalue().splitlines()]
        if mode == "paced":
            words = rec.events[0]["log"]
            assert "extend_final" in words and "note:paced" in words and "note:handoff_complete" in words
            assert not {"pause:rld", "pause_at:rld", "note:overlap_pause"} & set(words)
            assert any(e["type"] == "LifecycleWake" for e in log)
            final = [i for i, e in enumerate(log) if e["type"] == "ExtendReachesMd" and e["final"]]
            assert any(e["type"] == "StepEnd" and e["instance_id"] == "rld0" for e in log[final[0]:])
    paced, paused = recs["paced"], recs["one_shot"]
    assert paced.handoff_gap_s is not None and paused.handoff_gap_s is not None
    assert paced.handoff_gap_s < 2 * statistics.median(paced.itls_s), (paced.handoff_gap_s, statistics.median(paced.itls_s))
    assert paced.handoff_gap_s < paused.handoff_gap_s
