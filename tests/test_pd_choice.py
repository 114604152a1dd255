"""The PD baselines' P and D: the router and the simulator choose alike.

Both call `pdd.policy.choose_pipeline` (the router through
`server.flows.choose_pd`, the simulator on every arrival): cache affinity
against load, D's cache counted only under DRC. Here one cluster state is
set up twice, in process and without a model: in the simulator's instances
(queued and running sequences, prefix caches) and in the router's members
(the load a poll would report, the cache index fed by the KV events a poll
would bring). The test checks that both sides hand the policy the same
loads and cached prefixes, and that they pick the same P and D.
"""

from __future__ import annotations

import dataclasses
import random
import time
import tomllib
from pathlib import Path

import pytest

from pdd.deploy.spec import parse_spec
from pdd.engine.hashing import hash_blocks
from pdd.engine.kv_events import STORED
from pdd.engine.request import SamplingParams
from pdd.measure.metrics import Sla
from pdd.measure.workload import Workload, WorkloadRequest
from pdd.policy import PolicyConfig, Role
from pdd.server import flows
from pdd.server.cluster import Cluster as RouterCluster
from pdd.server.flows import RequestContext, choose_pd
from pdd.server.trace import RequestTrace
from pdd.sim import cluster as sim_cluster
from pdd.sim.bench_stream import BenchStream, chained_block_ids, to_spec
from pdd.sim.deployment import mode_from_spec, model_shape
from pdd.sim.instance import Seq
from pdd.sim.events import Arrival
from pdd.sim.loop import Event
from pdd.sim.request import RequestSpec, SimRequest
from pdd.sim.scenario import Scenario, SimSettings

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BS = 16
NAMESPACE = "smollm2-test"


def two_of_each(example: str):
    """The example deployment with a second P (p1) and a second D (d1)."""
    doc = tomllib.loads((EXAMPLES / f"{example}.toml").read_text())
    extra = []
    for inst in doc["instances"]:
        twin = dict(inst, name=inst["name"][0] + "1", port=inst["port"] + 10, kv_port=inst["kv_port"] + 10)
        extra.append(twin)
    doc["instances"] += extra
    return parse_spec(doc)


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40_000) for _ in range(n)]


class World:
    """One cluster state, as the simulator holds it and as the router sees it."""

    def __init__(self, example: str, monkeypatch):
        self.spec = two_of_each(example)
        self.mode = self.spec.mode
        sim_mode = mode_from_spec(self.spec, example)
        shape = model_shape(self.spec)
        self.kv_bytes_per_token = shape.kv_bytes_per_token
        scenario = Scenario(shape, None, Sla(60.0, 1.0), (sim_mode,), SimSettings(drain_s=1e6))
        self.sim = sim_cluster.Cluster(sim_mode, scenario, BenchStream(Workload("none", []), BS))
        self.router = RouterCluster(self.spec, None, PolicyConfig.from_dict(self.spec.policy))
        self.now = time.monotonic()
        self.seen = {"sim": [], "router": []}      # (view, decision) each side gave and got
        self._events: dict[str, list[bytes]] = {}   # instance -> hashes of the blocks it cached
        self._seqs: list[SimRequest] = []

        def spy(side, real):
            def call(facts, view, cfg, budgets=None):
                d = real(facts, view, cfg, budgets)
                self.seen[side].append((view, d))
                return d
            return call
        monkeypatch.setattr(sim_cluster, "choose_pipeline", spy("sim", sim_cluster.choose_pipeline))
        monkeypatch.setattr(flows, "choose_pipeline", spy("router", flows.choose_pipeline))

    def load(self, name: str, running: int = 0, waiting: int = 0) -> None:
        """Sequences on `name`'s decode queue: `running` admitted, `waiting` not yet."""
        inst = self.sim.instances[name]

        def add() -> None:
            r = SimRequest(RequestSpec(f"{name}-{len(self._seqs)}", 0.0, 64, 8, 8, ()))
            self._seqs.append(r)
            inst.add_seq(Seq(r, 64, 4, relay=False))
        for _ in range(running):
            add()
        inst._admit()
        for _ in range(waiting):
            add()

    def cache(self, name: str, ids: list[int]) -> None:
        """`name` holds the full blocks of `ids` in its prefix cache."""
        inst = self.sim.instances[name]
        if inst.cache is not None:     # a decoder without DRC keeps none in the simulator
            inst.cache.insert(chained_block_ids(ids, BS))
        self._events.setdefault(name, []).extend(hash_blocks(ids, BS, NAMESPACE.encode()))

    def poll(self) -> None:
        """What the router's next poll brings: each instance's load and its KV events."""
        for name, m in self.router.members.items():
            v = self.sim.instances[name].view()
            m.view = dataclasses.replace(m.view, num_running=v.num_running, num_waiting=v.num_waiting,
                                         kv_free_blocks=v.kv_free_blocks, kv_total_blocks=v.kv_total_blocks)
            events = [[STORED, h.hex()] for h in self._events.get(name, [])]
            m.index.apply({"epoch": "e", "seq": len(events), "events": events, "block_size": BS,
                           "namespace": NAMESPACE}, self.now)

    def choose(self, ids: list[int], max_tokens: int = 32) -> tuple[tuple[str, str], tuple[str, str]]:
        """(router's (P, D), simulator's (P, D)) for one request."""
        self.poll()
        ctx = RequestContext("q", ids, SamplingParams(max_tokens=max_tokens), RequestTrace("q", self.mode, len(ids)),
                             self.now + 60, self.kv_bytes_per_token, BS)
        p, d = choose_pd(ctx, self.router, self.now)
        spec = to_spec(WorkloadRequest("q", 0.0, ids, max_tokens), BS)
        self.sim.arriving["q"] = spec
        self.sim._on_arrival(Event(0.0, Arrival("q")))
        (_, sim_d), = self.seen["sim"][-1:]
        return (p.spec.name, d.spec.name), (sim_d.p_id, sim_d.md_id)

    def views_agree(self) -> None:
        """Both sides gave the policy the same loads and the same cached prefixes
        of the instances it reads them for."""
        (rv, _), (sv, _) = self.seen["router"][-1], self.seen["sim"][-1]
        load = lambda v: {i.instance_id: (i.role, i.num_running, i.num_waiting) for i in v.instances}
        assert load(rv) == load(sv)
        drc = self.router.policy.enable_drc
        read = [i.instance_id for i in sv.instances if i.role is Role.PREFILL or drc]
        assert {n: rv.matched(n) for n in read} == {n: sv.matched(n) for n in read}


@pytest.fixture
def world(request, monkeypatch):
    return World(request.param, monkeypatch)


@pytest.mark.parametrize("world", ["pd-local", "pd-wan-drc"], indirect=True)
def test_cached_prefix_outweighs_some_load_on_both_sides(world):
    ids = prompt(1, 2048)
    world.cache("p1", ids[:1024])          # 1024 tokens of prefill saved on p1 ...
    world.load("p1", running=2)             # ... against 512 tokens of load penalty
    world.cache("d1", ids[:1024])
    world.load("d1", running=1)
    router, sim = world.choose(ids)
    world.views_agree()
    assert router == sim == ("p1", "d1")    # least loaded would have been (p0, d0)


@pytest.mark.parametrize("world", ["pd-wan"], indirect=True)
def test_without_drc_d_goes_by_load_alone_on_both_sides(world):
    ids = prompt(2, 2048)
    world.cache("p1", ids[:1024])
    world.load("p1", running=2)
    world.cache("d1", ids[:1024])           # the router's index knows it; the policy ignores it
    world.load("d1", running=1)
    router, sim = world.choose(ids)
    world.views_agree()
    assert router == sim == ("p1", "d0")


@pytest.mark.parametrize("world", ["pd-local"], indirect=True)
def test_a_queued_request_outweighs_a_short_prefix_on_both_sides(world):
    ids = prompt(3, 2048)
    world.cache("p1", ids[:1024])
    world.load("p1", waiting=1)             # 4096 tokens of penalty
    router, sim = world.choose(ids)
    world.views_agree()
    assert router == sim == ("p0", "d0")


@pytest.mark.parametrize("world", ["pd-local", "pd-wan", "pd-wan-drc"], indirect=True)
def test_router_and_simulator_agree_on_random_states(world):
    rng = random.Random(world.mode + str(world.router.policy.enable_drc))
    ids = prompt(4, 4096)
    picks = set()
    for name in ("p0", "p1", "d0", "d1"):
        world.cache(name, ids[: rng.randrange(0, 4096, BS)])
    for _ in range(25):
        name = rng.choice(("p0", "p1", "d0", "d1"))
        world.load(name, running=rng.randrange(0, 3), waiting=rng.randrange(0, 2))
        n = rng.randrange(BS, 4096)
        router, sim = world.choose(ids[:n])
        world.views_agree()
        assert router == sim, (n, router, sim)
        picks.add(router)
    assert len({p for p, _ in picks}) == 2     # the states were varied enough to move P
