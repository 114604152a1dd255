"""One deployment (a mode) under one workload: the simulator's control plane.

The simulator decides nothing itself: routing, pipeline, filter, handoff
mode and handoff batches all come from `pdd.policy`, called with views built
from the simulated instances and a `LinkEstimator` fed with the simulated
transfers, exactly as the router would call them.

A request's path, as modelled:

* P prefills the uncached part of the prompt (chunked, with the other
  requests) and samples the first token, which travels with the KV; the
  decoder that receives the KV streams it. So TTFT = queue + prefill + the
  transfer to the first decoder (RLD over RDMA, or MD over the WAN).
* P keeps the prompt KV until every transfer out of it ended.
* RELAY: RLD decodes eagerly; when MD holds the prompt KV (and a slot), a
  message reaches RLD, which opens a `HandoffSession`; its batches travel as
  token ids (latency only) and MD extends them as prefill-like chunks; after
  the final one MD decodes the rest.
* The filter acts at routing time (RELAY_ONLY, no WAN bytes) and again at
  every RLD step until MD holds the KV (`should_cancel_wan`, fed what the
  router knows: the routing-time estimate minus the time since prefill).

A mode read from a runtime deployment file (`mode.serving` set) adds what the
real servers add around their engines: the router's own latency before a
request reaches P, each token's trip from its instance to the user, and CPU
cores shared by several instances. A shared core is a processor-sharing
server (the `Link` arithmetic with seconds of work for bytes): the steps of
its instances interleave, each running at e/n speed while n > 1 are busy,
where e (`ModeSpec.core_sharing`, calibrated, ~0.9 here) is what switching
between processes leaves of the core; an instance with a nice value gets the
kernel's smaller share of it (`link.cfs_weight`).

Arrival, routing, prefill and steps live here; KV flows in `transfers.py`
(`TransfersMixin`); a PDD request's rules (eager tokens, live filter,
handoff, P's release, its outcome) in `pdd.policy.RequestLifecycle`, which
`lifecycle_driver.py` (`LifecycleDriverMixin`) drives and times.
"""

from __future__ import annotations

import dataclasses
import zlib

from pdd.policy import (
    ClusterView, LinkEstimator, NoRouteError, PrefixReuseCounter, RelayBudgets, RequestFacts,
    Role, choose_pipeline, note_decision, pick_instance, plan_warm,
)
from pdd.policy.copies_ahead import DispatchedCopies
from pdd.policy.lifecycle_io import Prefilled
from pdd.policy.line_order import copy_pace_bytes_s
from pdd.engine.kv_codec import stream_parts
from pdd.sim.cost_model import CostModel
from pdd.sim.hardware import get_profile
from pdd.sim.instance import Job, JobKind, Seq, SimInstance
from pdd.sim.lifecycle_driver import LifecycleDriverMixin
from pdd.sim.link import Link, cfs_weight
from pdd.sim.events import Arrival, CoreDone, StepEnd
from pdd.sim.loop import Event, EventLoop
from pdd.sim.request import SimRequest
from pdd.sim.scenario import ModeSpec, Scenario
from pdd.sim.transfers import TransfersMixin

DECODERS = (Role.MAIN, Role.DECODE)


class Cluster(TransfersMixin, LifecycleDriverMixin):
    def __init__(self, mode: ModeSpec, scenario: Scenario, stream, event_log=None) -> None:
        self.mode, self.scenario, self.stream = mode, scenario, stream
        self.cfg = mode.policy
        self.model = scenario.model
        self.block_size = stream.block_size
        self.stride = scenario.settings.token_stride
        self.instances: dict[str, SimInstance] = {}
        cores = [p.core for p in mode.pools if p.core is not None for _ in range(p.count)]
        shared = {c for c in cores if cores.count(c) > 1}
        self.core_of: dict[str, str] = {}
        self.core_weight: dict[str, float] = {}
        for pool in mode.pools:
            cost = CostModel(self.model, get_profile(pool.hardware), pool.chips,
                             pool.mfu, pool.mbu, pool.overhead_s, pool.per_seq_s, pool.time_scale,
                             attn_cost=pool.attn_cost)
            blocks = pool.kv_blocks or cost.kv_capacity_tokens(pool.mem_fraction) // self.block_size
            # Every engine keeps a prefix cache (RLD's skips the blocks it holds).
            cache = pool.prefix_cache
            if pool.role in DECODERS and not self.cfg.enable_drc:
                cache = False
            # A time-sliced step's end moves whenever a neighbour starts or ends
            # one, so shared cores run step by step (no macro steps).
            macro = 1 if pool.core in shared else scenario.settings.max_macro_steps
            for i in range(pool.count):
                if pool.name:
                    iid = pool.name if pool.count == 1 else f"{pool.name}-{i}"
                else:
                    iid = f"{pool.role.value}-{pool.datacenter}-{pool.hardware}-{i:03d}"
                self.instances[iid] = SimInstance(
                    iid, pool.role, pool.datacenter, cost, pool.max_batch, pool.token_budget,
                    self.block_size, blocks, cache, macro, pool.chunk_packing,
                    jitter=pool.step_jitter, seed=zlib.crc32(f"{mode.seed}/{iid}".encode()),
                    row_factors=pool.row_factors, lone_chunk_factor=pool.lone_chunk_factor,
                    step_overhead_tokens=pool.step_overhead_tokens)
                if pool.core in shared:
                    self.core_of[iid] = f"core{pool.core}"
                    self.core_weight[iid] = cfs_weight(pool.nice)
        self.cores = {c: Link(c, 1.0, 0.0, 1.0, shared_efficiency=mode.core_sharing)
                      for c in sorted(set(self.core_of.values()))}
        self.colocated = [i for i in self.instances.values() if i.role is Role.COLOCATED]
        dcs = sorted({i.datacenter for i in self.instances.values()})
        bound = self.cfg.copy_max_yield_s        # as P's sender orders its yielding copies
        self.links = {f"rdma-{dc}": Link(f"rdma-{dc}", mode.rdma.bandwidth_bytes_s, mode.rdma.rtt_s,
                                         _bytes(mode.rdma.max_flow_gbps), max_yield_s=bound) for dc in dcs}
        if mode.wan is not None:
            # P's senders pace their yielding copies on the line (`deploy.topology.copy_pace`)
            senders = sum(1 for i in self.instances.values() if i.role is Role.PREFILL)
            self.links["wan"] = Link("wan", mode.wan.bandwidth_bytes_s, mode.wan.rtt_s,
                                     _bytes(mode.wan.max_flow_gbps), max_yield_s=bound,
                                     buffer_bytes=mode.wan.buffer_bytes,
                                     yield_leak_bytes=mode.wan.yield_leak_bytes,
                                     tail_release_bytes=mode.wan.tail_release_bytes,
                                     handshake_queue_bytes=mode.wan.handshake_queue_bytes,
                                     background_pace_bytes_s=copy_pace_bytes_s(
                                         mode.wan.bandwidth_bytes_s, senders, self.cfg.copy_pace))
        self.estimators = {name: LinkEstimator.from_line(l.bandwidth_bytes_s * 8, l.rtt_s / 2)
                           for name, l in self.links.items()}
        md_dc = next((i.datacenter for i in self.instances.values() if i.role in DECODERS), None)
        p_dc = next((i.datacenter for i in self.instances.values() if i.role is Role.PREFILL), None)
        self.md_link = self._link_name(p_dc, md_dc) if p_dc and md_dc else None
        self.p_link = f"rdma-{p_dc}" if p_dc else None      # P -> RLD
        self.prefix_reuses = PrefixReuseCounter()
        self.copies = DispatchedCopies()
        self.relay_budgets = RelayBudgets(self.cfg, sum(
            i.max_batch for i in self.instances.values() if i.role is Role.RELAY))
        # flow id -> (request, "rld" | "md", destination id, start time, bytes, link name)
        self.flows: dict[str, tuple[SimRequest, str, str, float, int, str]] = {}
        self.flow_steps: dict[str, int] = {}      # flow id -> receiver's step count at its start
        self.flow_handshake: dict[str, float] = {}   # flow id -> BEGIN..HAVE seconds
        # flow id -> (the blocks it covers, how many of them the receiver held at
        # HAVE, up to which of them P held before (those land first, one by
        # one), in how many blocks at once the rest land)
        self.flow_span: dict[str, tuple[list, int, int, int]] = {}
        self.flow_yielded: dict[str, float] = {}     # flow id -> seconds it yielded the line
        self.flow_shared: set[str] = set()           # flows that shared their line with another
        self.flow_paced: dict[str, float] = {}       # flow id -> seconds it waited for P's KV
        self.flow_paced_since: dict[str, float] = {}  # flow id -> since when P paces it (streamed)
        self.flow_waiters: dict[str, list] = {}      # flow id -> callbacks when it ends (landed or cancelled)
        self.flow_begun: set[str] = set()            # flows whose BEGIN the receiver has taken
        # instance id -> messages waiting for its next step boundary (`_deliver`)
        self.pending: dict[str, list] = {iid: [] for iid in self.instances}
        self.requests: list[SimRequest] = []
        self.by_id: dict[str, SimRequest] = {}       # request id -> its request, once arrived
        self.arriving: dict = {}                     # request id -> spec of a scheduled Arrival
        self.loop = EventLoop(event_log)
        self.loop.on(Arrival, self._on_arrival)
        self.loop.on(StepEnd, self._on_step_end)
        self.loop.on(CoreDone, self._on_core_done)
        self._register_transfer_events()
        self._register_lifecycle_events()
        self.router_delay_s = 0.0
        sv = mode.serving
        self.manifest_wait = sv is not None and sv.manifest_after_step
        # P streams each block as its chunk is computed (the servers do):
        # transfers start with the prefill; one that has crossed lands only
        # after the prefill and its last chunk's bytes.
        self.stream_kv = sv is not None and sv.stream_kv and not self.manifest_wait
        self.after_prefill: dict[str, list] = {}     # request id -> flows done before its prefill
        # ... and, layer by layer, a chunk's KV while the chunk computes: only
        # the last layer's slice of the last chunk is left at the end.
        parts = stream_parts(self.block_size * self.model.kv_bytes_per_token, self.model.num_layers)
        self.kv_layer_slices = parts if self.stream_kv and sv.stream_kv_layers else 1
        for inst in self.instances.values():
            inst.streams_kv = self.stream_kv
            inst.kv_layer_slices = self.kv_layer_slices
        self.import_wait = sv.import_wait if sv is not None else "none"
        if sv is not None:
            for inst in self.instances.values():
                inst.deliver_s = sv.token_s + self._one_way_dc(sv.router_datacenter, inst.datacenter)
            # The router asks the instances of its own datacenter; those across
            # the WAN it reads from its index of their caches (no round trip).
            asked = [i for i in self.instances.values() if i.role in (Role.PREFILL, Role.MAIN, Role.RELAY)
                     and i.datacenter == sv.router_datacenter]
            rtt = max((2 * self._one_way_dc(sv.router_datacenter, i.datacenter) for i in asked),
                      default=0.0)
            self.router_delay_s = sv.request_s + (rtt if sv.match_round_trip else 0.0)

    # --- running -------------------------------------------------------------
    def run(self, until_s: float) -> list[SimRequest]:
        for spec in self.stream.initial():
            self.loop.push(self._arrival(spec))
        self.loop.run(until_s)
        for req in self.requests:
            if req.done_s is None:
                req.failed, req.error = True, "unfinished when the simulation ended"
        return self.requests

    # --- helpers -------------------------------------------------------------
    def _link_name(self, dc_a: str, dc_b: str) -> str:
        return f"rdma-{dc_a}" if dc_a == dc_b else "wan"

    def _one_way_dc(self, dc_a: str, dc_b: str) -> float:
        if dc_a == dc_b:
            return self.mode.rdma.rtt_s / 2
        return self.mode.wan.rtt_s / 2 if self.mode.wan is not None else 0.0

    def _arrival(self, spec) -> Event:
        # The router's own work (and prefix-match round trips) come before the
        # policy sees the request; the record keeps the user's send time.
        self.arriving[spec.request_id] = spec
        return Event(spec.arrival_s + self.router_delay_s, Arrival(spec.request_id))

    def _later(self, delay: float, record) -> Event:
        return Event(self.loop.now + delay, record)

    def _one_way(self, a: SimInstance, b: SimInstance) -> float:
        return self.links[self._link_name(a.datacenter, b.datacenter)].rtt_s / 2

    def _kick(self, inst: SimInstance, now: float) -> list[Event]:
        if inst.at_boundary:
            return []           # `_step_done` starts the next step once all it runs has run
        if inst.busy:
            t = inst.interrupt(now)
            return [] if t is None else [Event(t, StepEnd(inst.instance_id, inst.version))]
        evs = self._run_pending(inst, now)
        t = inst.start_step(now)
        evs += self._on_admitted(inst, now)
        if self.stream_kv and inst.role is Role.PREFILL:
            for job in inst.first_chunks():
                evs += self._on_prefill_started(inst, job, now)
        if t is None:
            for fn in inst.pop_waiters():      # an idle engine runs commands at once
                evs += fn(now)
            return evs
        core = self.core_of.get(inst.instance_id)
        if core is None:
            evs.append(Event(t, StepEnd(inst.instance_id, inst.version)))
        else:
            nxt = self.cores[core].add(now, inst.instance_id, max(t - now, 1e-9),
                                       weight=self.core_weight[inst.instance_id])
            if nxt:
                evs.append(Event(nxt[0], CoreDone(core, nxt[1])))
        return evs

    def _on_core_done(self, ev: Event) -> list[Event]:
        core = ev.record.core
        done, nxt = self.cores[core].complete(ev.time, ev.record.version)
        evs = [Event(nxt[0], CoreDone(core, nxt[1]))] if nxt else []
        for flow in done:
            evs += self._step_done(self.instances[flow.flow_id], ev.time)
        return evs

    def _deliver(self, inst: SimInstance, now: float, message) -> list[Event]:
        """Take `message` (an event's record) on `inst` at a step boundary
        (now, or the next one), as the server's engine takes a command."""
        self.pending[inst.instance_id].append(message)
        return self._kick(inst, now)

    def _run_pending(self, inst: SimInstance, now: float) -> list[Event]:
        evs: list[Event] = []
        todo = self.pending[inst.instance_id]
        while todo:
            evs += self._at_boundary(todo.pop(0), now)
        return evs

    def _facts(self, req: SimRequest) -> RequestFacts:
        s = req.spec
        return RequestFacts(s.request_id, s.prompt_tokens, s.max_tokens,
                            self.model.kv_bytes_per_token, self.block_size)

    def _matched(self, inst: SimInstance, req: SimRequest) -> int:
        if inst.cache is None:
            return 0
        return min(inst.cache.match(req.spec.block_ids) * self.block_size, req.spec.prompt_tokens)

    # --- arrival: the policy decides ----------------------------------------
    def _on_arrival(self, ev: Event) -> list[Event]:
        now = ev.time
        req = SimRequest(self.arriving.pop(ev.record.request_id), self.stride)
        self.requests.append(req)
        self.by_id[req.spec.request_id] = req
        if self.colocated:
            views = [i.view() for i in self.colocated]
            matched = {i.instance_id: self._matched(i, req) for i in self.colocated}
            iid = pick_instance(views, matched, req.spec.prompt_tokens, now, self.cfg)
            req.pipeline = "colocated"
            return self._start_prefill(req, self.instances[iid], matched[iid], now)
        matched = {i.instance_id: self._matched(i, req) for i in self.instances.values() if i.cache is not None}
        try:
            facts = self._facts(req)
            d = choose_pipeline(facts, self._view(matched, now), self.cfg, self.relay_budgets)
        except NoRouteError as e:
            return self._finish(req, now, error=str(e))
        self._plan_warm(req, d, matched)
        return self._begin(req, d, matched.get(d.p_id, 0), now)

    def _view(self, matched: dict[str, int], now: float) -> ClusterView:
        """What the router sees when it routes: instances, caches, the lines."""
        wan = self.estimators[self.md_link].estimate(now) if self.md_link else None
        if wan is not None and not self.links[self.md_link].up:
            wan = dataclasses.replace(wan, up=False)
        if wan is not None:
            # What P still has to push over the line, as its servers report it.
            line = self.links[self.md_link]
            wan = dataclasses.replace(wan, **line.backlog(now))
            # Copies routed but not yet on the line (P has not reached their
            # prompt): the router counts them from its own decisions.
            self.copies.reported(self.flows[f][0].spec.request_id for f in line.flows if f in self.flows)
            wan = self.copies.ahead(wan)
        local = self.estimators.get(self.p_link) if self.p_link else None
        return ClusterView(tuple(i.view() for i in self.instances.values()), matched, wan, now,
                           local=local.estimate(now) if local is not None else None)

    def route_warmup(self, requests: list[tuple[str, int, int]]) -> None:
        """Requests a bench sent before its run (`pdd bench --warmup`): its
        router routed them and counted them in the relay budgets, whose
        start-up loan is repaid by the number of decisions. Routed here on the
        idle cluster at time 0 and counted as they ended (what the decision
        gave RLD); not served: their prompts share nothing with the run.
        `requests`: (id, prompt tokens, output bound) each."""
        if self.colocated:
            return
        for rid, prompt_tokens, max_tokens in requests:
            facts = RequestFacts(rid, prompt_tokens, max_tokens, self.model.kv_bytes_per_token, self.block_size)
            d = choose_pipeline(facts, self._view({}, 0.0), self.cfg, self.relay_budgets)
            note_decision(self.relay_budgets, d, facts).ended(d.rld_tokens)

    def _plan_warm(self, req: SimRequest, d, matched: dict[str, int]) -> None:
        """As the router: count the shared prefix; a filtered request may warm MD with it."""
        key = lambda n: req.spec.block_ids[n // self.block_size - 1]    # chained: names the prefix
        tokens, _ = plan_warm(d, matched, key, self.prefix_reuses, self.block_size, self.cfg)
        req.warm_blocks = tokens // self.block_size

    def _start_prefill(self, req: SimRequest, p: SimInstance, matched: int, now: float) -> list[Event]:
        s = req.spec
        if p.cache is not None and matched:
            p.cache.insert(s.block_ids[: matched // self.block_size])   # pin by recency
        uncached = max(s.prompt_tokens - matched, 1)
        req.cached_tokens = s.prompt_tokens - uncached
        req.uncached_kv_bytes = uncached * self.model.kv_bytes_per_token
        req.p_id = p.instance_id
        total = s.prompt_tokens + (s.max_tokens if p.role is Role.COLOCATED else 0)
        p.add_job(Job(req, JobKind.PREFILL, uncached, s.prompt_tokens - uncached, p.blocks_for(total)))
        return self._kick(p, now)

    # --- steps --------------------------------------------------------------
    def _on_step_end(self, ev: Event) -> list[Event]:
        inst = self.instances[ev.record.instance_id]
        if ev.record.version != inst.version or not inst.busy:
            return []       # truncated macro step: a newer end is queued
        return self._step_done(inst, ev.time)

    def _step_done(self, inst: SimInstance, now: float) -> list[Event]:
        """A step boundary: what waited for it runs, then the next step starts.

        As the server's engine loop runs every queued command before its
        next step, nothing run here starts a step of `inst` (its `_kick`s
        wait): a request that lands and is submitted at this boundary joins
        the next step, whichever callback came first.
        """
        due = inst.tick_waiters(inst.current_num_steps)
        # P's chunks of the step that ends (`end_step` starts a new list): the
        # copies it streams learn its progress. Only P's: this runs every step.
        chunks = inst.last_chunks if inst.role is Role.PREFILL and self.stream_kv else ()
        out = inst.end_step(now)
        evs: list[Event] = []
        if chunks:
            for job, _ in chunks:
                if job.kind is JobKind.PREFILL and job.req.streamed and job.done < job.num_tokens:
                    evs += self._prefill_progress(job.req, job, inst.prefill_time_s(job.num_tokens - job.done, job.ctx_start + job.done), now)
        inst.at_boundary = True
        try:
            for fn in due:
                evs += fn(now)
            for job in out.jobs_done:
                evs += (self._on_prefill_done(inst, job, now) if job.kind is JobKind.PREFILL
                        else self._on_extend_done(inst, job, now))
            for seq, times in out.tokens:
                evs += self._on_tokens(inst, seq, times, now)
        finally:
            inst.at_boundary = False
        return evs + self._kick(inst, now)

    def _on_admitted(self, inst: SimInstance, now: float) -> list[Event]:
        evs: list[Event] = []
        for seq in inst.admitted:
            if not seq.decoding and not seq.relay:      # MD holds the KV of a relayed request
                evs += self._md_ready(inst, seq, now)
        inst.admitted.clear()
        return evs

    def _on_prefill_done(self, p: SimInstance, job: Job, now: float) -> list[Event]:
        req, s = job.req, job.req.spec
        if p.cache is not None:
            p.cache.insert(s.block_ids)
        if p.role is Role.COLOCATED:
            p.release(job.num_blocks)
            req.emit([now], relay=False, delay_s=p.deliver_s)
            if req.finished:
                p.unshare(job.shared)
                return self._finish(req, now, cache_on=p)
            p.add_seq(Seq(req, s.prompt_tokens + 1, job.num_blocks, relay=False, shared=job.shared))
            return []
        req.p_blocks, req.p_shared = job.num_blocks, job.shared
        req.prefill_done_s = now
        s = req.spec
        evs = self._feed(req, Prefilled(now, 0, stop=s.output_tokens <= 1 < s.max_tokens))
        if req.streamed:
            # The streamed copies left with the prefill (`_on_prefill_started`);
            # a warm push of MD's cache, and a copy not streamed, go now.
            evs += [e for t in req.targets if t.warm_blocks or not t.streamed for e in self._send(req, t, now)]
            return evs + self._tails_after_prefill(req, job, now)

        def send(t: float) -> list[Event]:
            # Only what the receiver lacks at its HAVE answer travels.
            return [e for target in req.targets for e in self._send(req, target, t)]
        if self.manifest_wait:
            p.wait_boundaries(1, send)     # the KV manifest is read after P's next step
            return evs
        return evs + send(now)


    def _on_prefill_started(self, p: SimInstance, job: Job, now: float) -> list[Event]:
        """P starts on the prompt: its streamed copies (StartPrefill's targets
        but a warm push and those `streamed=False`) start."""
        req = job.req
        if p.role is not Role.PREFILL or req.lc is None or req.streamed:
            return []
        req.streamed = True
        made_s = p.prefill_time_s(job.num_tokens, job.ctx_start) if self.kv_layer_slices > 1 else None
        if made_s:
            # Layer by layer, its KV crosses no faster than P makes it.
            req.kv_made_by_s = now + made_s
        return [e for t in req.targets if not t.warm_blocks and t.streamed for e in self._send(req, t, now)]


def _bytes(gbps: float | None) -> float | None:
    return None if gbps is None else gbps * 1e9 / 8
