"""The simulator decides nothing itself about a PDD request's life (faults
included: a WAN cut): every
command it carried out is what a fresh `RequestLifecycle` returns for the
facts the simulator fed it, replayed in the run's order with the same
routing decisions and relay budgets; and each record's decision log is
those commands' log (what `pdd sim --validate` compares with the router's).

The real side of the comparison is tests/test_sim_shared_decisions.py
(slow: real processes): the router's logged commands against the
simulator's, request by request.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

import pdd.sim.cluster as cluster_mod
import pdd.sim.lifecycle_driver as driver_mod
from pdd.measure import agentic
from pdd.measure.metrics import Sla
from pdd.policy import RelayBudgets
from pdd.policy.lifecycle import RequestLifecycle
from pdd.policy.lifecycle_log import decision_log, entry
from pdd.sim.runtime import RuntimeMode, run_runtime_mode
from test_sim_events import AS_WRITTEN, pdd_as_written   # the example as these paths were counted on (fp32, 100 Mbit/s, loan 8)


# 100 requests each, ~1 s: the paths below; "quick+cuts": the WAN cut for
# 3 s every 20 s (copies fail, DIRECT fails over to RLD, routing sees it down);
# "wan-bound+slow": the AMD-sized preset on an 18 Mbit/s line (its own is
# 24), where relays end on RLD with MD's copy still landing (parked), as in
# the real runs; "full+paused": pacing off (`handoff_pace_ratio` 0) and no
# tokens sent ahead of MD's KV (`extend_ahead` off), so one-shot and
# catch-up final batches pause RLD.
RUNS = ("full", "wan-bound-xeon", "quick+cuts", "wan-bound+slow", "full+paused")
CUTS = [(t, t + 3.0) for t in (10.0, 30.0, 50.0, 70.0, 90.0, 110.0)]
SLOW = {**AS_WRITTEN, "links": {"bandwidth_mbps": 18.0}}
PAUSED = {**AS_WRITTEN, "policy": {**AS_WRITTEN["policy"], "handoff_pace_ratio": 0, "extend_ahead": False}}
OVERRIDES = {"slow": SLOW, "paused": PAUSED}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    path = pdd_as_written(tmp_path_factory.mktemp("pdd") / "pdd.toml")
    for name in RUNS:
        with pytest.MonkeyPatch.context() as mp:
            variant = name.partition("+")[2]
            out[name] = record_run(mp, name.split("+")[0], path, cuts=CUTS if variant == "cuts" else (),
                                   overrides=OVERRIDES.get(variant, AS_WRITTEN))
    return out


def record_run(monkeypatch, preset: str, path: Path, num_requests: int = 100, cuts=(), overrides=AS_WRITTEN):
    """Simulate examples/pdd.toml (`path`: as written) on an agentic workload,
    keeping every routing decision, lifecycle creation, fact and command in order."""
    calls: list[tuple] = []

    class Recording(RequestLifecycle):
        def __init__(self, req, d, cfg, budgets=None, warm_blocks=0, copies=None):
            super().__init__(req, d, cfg, budgets, warm_blocks, copies)
            calls.append(("new", req, d, cfg, warm_blocks))

        def start(self, now):
            cmds = super().start(now)
            calls.append(("start", self.req.request_id, now, cmds))
            return cmds

        def handle(self, fact):
            cmds = super().handle(fact)
            calls.append(("handle", self.req.request_id, fact, cmds))
            return cmds

    run = cluster_mod.Cluster.run

    def run_with_cuts(self, until_s):
        for at_s, restore_s in cuts:
            self.cut_link("wan", at_s, restore_s)
        return run(self, until_s)
    monkeypatch.setattr(driver_mod, "RequestLifecycle", Recording)
    monkeypatch.setattr(cluster_mod.Cluster, "run", run_with_cuts)
    wl = agentic.generate(dataclasses.replace(agentic.PRESETS[preset], num_requests=num_requests))
    entry_, records, _ = run_runtime_mode(RuntimeMode("pdd", str(path), overrides), wl,
                                          Sla(10.0, 1.0))
    return calls, records


@pytest.mark.parametrize("name", RUNS)
def test_simulated_commands_equal_a_replay_of_its_facts(runs, name):
    calls, records = runs[name]
    cfg = next(c[3] for c in calls if c[0] == "new")
    budgets, lcs, words = RelayBudgets(cfg), {}, {}
    num_facts = 0
    for c in calls:
        if c[0] == "new":
            _, req, d, _, warm = c
            lcs[req.request_id] = RequestLifecycle(req, d, cfg, budgets, warm)
            words[req.request_id] = []
        else:
            kind, rid, arg, cmds = c
            got = lcs[rid].start(arg) if kind == "start" else lcs[rid].handle(arg)
            assert got == cmds, (rid, arg)
            words[rid] += [entry(cmd) for cmd in got]
            num_facts += kind == "handle"
    assert num_facts > 10 * len(lcs)
    by_id = {r.request_id: r for r in records}
    for rid, lc in lcs.items():
        r = by_id[rid]
        assert not r.failed, r.error
        assert r.pipeline == lc.outcome.value and lc.done is not None
        (logged,) = [e["log"] for e in r.events if e["name"] == "lifecycle"]
        assert tuple(logged) == decision_log(words[rid])
        # The user's stream: every index once, in order (the lifecycle's Emit).
        assert r.output_tokens == len(lc.tokens)


def test_the_replayed_runs_cover_the_lifecycle_paths(runs):
    """The workloads above are worth replaying: direct and relayed requests,
    filtered ones, handoffs of every mode that complete (paced, and paused
    with pacing off), relays that end on
    RLD with MD's copy still landing (parked) or cancelled (dropped); with
    the WAN cut, DIRECT requests whose copy failed fail over to RLD (P sends
    its KV again) and requests routed meanwhile stay on RLD."""
    records = [r for _, recs in runs.values() for r in recs]
    logs = [tuple(e["log"]) for r in records for e in r.events if e["name"] == "lifecycle"]
    assert len(logs) == len(records) == 100 * len(RUNS)
    outcomes = Counter(r.pipeline for r in records)
    for outcome in ("direct", "relay", "relay_filtered", "direct_failover_relay", "relay_only"):
        assert outcomes[outcome] > 0, outcome
    for r in runs["quick+cuts"][1]:
        assert not r.failed, r.error
        if r.pipeline in ("direct_failover_relay", "relay_only"):
            assert r.rld_tokens == r.output_tokens and r.wan_bytes == 0
    words = Counter(w for log in logs for w in set(log))
    for w in ("note:md_ready:one_shot", "note:md_ready:catch_up", "extend", "extend_final", "pause_at:rld",
              "note:handoff_complete", "emit:md", "note:md_parked", "abort:md:keep_kv", "note:md_dropped",
              "abort:rld", "note:failover", "start_transfer", "note:md_ready:paced", "note:paced",
              "note:md_ready:overlap", "extend_ahead"):
        assert words[w] > 0, w
