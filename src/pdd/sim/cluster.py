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
its instances interleave, each running at 1/n speed while n are busy.
"""

from __future__ import annotations

from pdd.policy import (
    ClusterView, Complete, HandoffSession, HandoffState, LinkEstimator, NoRouteError, Pipeline,
    RequestFacts, Role, SendBatch, choose_handoff_mode, choose_pipeline, pick_instance,
    should_cancel_wan,
)
from pdd.sim.cost_model import CostModel
from pdd.sim.hardware import get_profile
from pdd.sim.instance import Job, JobKind, Seq, SimInstance
from pdd.sim.link import Link
from pdd.sim.loop import Event, EventKind, EventLoop
from pdd.sim.request import SimRequest
from pdd.sim.scenario import ModeSpec, Scenario

DECODERS = (Role.MAIN, Role.DECODE)


class Cluster:
    def __init__(self, mode: ModeSpec, scenario: Scenario, stream) -> None:
        self.mode, self.scenario, self.stream = mode, scenario, stream
        self.cfg = mode.policy
        self.model = scenario.model
        self.block_size = stream.block_size
        self.stride = scenario.settings.token_stride
        self.instances: dict[str, SimInstance] = {}
        cores = [p.core for p in mode.pools if p.core is not None for _ in range(p.count)]
        shared = {c for c in cores if cores.count(c) > 1}
        self.core_of: dict[str, str] = {}
        for pool in mode.pools:
            cost = CostModel(self.model, get_profile(pool.hardware), pool.chips,
                             pool.mfu, pool.mbu, pool.overhead_s, pool.per_seq_s, pool.time_scale)
            blocks = pool.kv_blocks or cost.kv_capacity_tokens(pool.mem_fraction) // self.block_size
            cache = pool.prefix_cache and (pool.role is not Role.RELAY)
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
                    self.block_size, blocks, cache, macro, pool.chunk_packing == "single")
                if pool.core in shared:
                    self.core_of[iid] = f"core{pool.core}"
        self.cores = {c: Link(c, 1.0, 0.0, 1.0) for c in sorted(set(self.core_of.values()))}
        self.colocated = [i for i in self.instances.values() if i.role is Role.COLOCATED]
        dcs = sorted({i.datacenter for i in self.instances.values()})
        self.links = {f"rdma-{dc}": Link(f"rdma-{dc}", mode.rdma.bandwidth_bytes_s, mode.rdma.rtt_s,
                                         _bytes(mode.rdma.max_flow_gbps)) for dc in dcs}
        if mode.wan is not None:
            self.links["wan"] = Link("wan", mode.wan.bandwidth_bytes_s, mode.wan.rtt_s,
                                     _bytes(mode.wan.max_flow_gbps))
        self.estimators = {name: LinkEstimator.from_line(l.bandwidth_bytes_s * 8, l.rtt_s / 2)
                           for name, l in self.links.items()}
        md_dc = next((i.datacenter for i in self.instances.values() if i.role in DECODERS), None)
        p_dc = next((i.datacenter for i in self.instances.values() if i.role is Role.PREFILL), None)
        self.md_link = self._link_name(p_dc, md_dc) if p_dc and md_dc else None
        # flow id -> (request, "rld" | "md", destination id, start time, bytes, link name)
        self.flows: dict[str, tuple[SimRequest, str, str, float, int, str]] = {}
        self.flow_steps: dict[str, int] = {}      # flow id -> receiver's step count at its start
        self.pending: dict[str, list] = {iid: [] for iid in self.instances}
        self.requests: list[SimRequest] = []
        self.loop = EventLoop()
        self.loop.on(EventKind.ARRIVAL, self._on_arrival)
        self.loop.on(EventKind.STEP_END, self._on_step_end)
        self.loop.on(EventKind.TRANSFER_DONE, self._on_transfer_done)
        self.loop.on(EventKind.CORE_DONE, self._on_core_done)
        self.loop.on(EventKind.MESSAGE, lambda ev: ev.data(ev.time))
        self.router_delay_s = 0.0
        sv = mode.serving
        self.manifest_wait = sv is not None and sv.manifest_after_step
        self.import_wait = sv is not None and sv.import_per_step
        if sv is not None:
            for inst in self.instances.values():
                inst.deliver_s = sv.token_s + self._one_way_dc(sv.router_datacenter, inst.datacenter)
            asked = [i for i in self.instances.values() if i.role in (Role.PREFILL, Role.MAIN)]
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
        return Event(spec.arrival_s + self.router_delay_s, EventKind.ARRIVAL, spec.request_id, spec)

    def _later(self, delay: float, key: str, fn) -> Event:
        return Event(self.loop.now + delay, EventKind.MESSAGE, key, fn)

    def _one_way(self, a: SimInstance, b: SimInstance) -> float:
        return self.links[self._link_name(a.datacenter, b.datacenter)].rtt_s / 2

    def _kick(self, inst: SimInstance, now: float) -> list[Event]:
        if inst.busy:
            t = inst.interrupt(now)
            return [] if t is None else [Event(t, EventKind.STEP_END, inst.instance_id, inst.version)]
        evs = self._run_pending(inst, now)
        t = inst.start_step(now)
        evs += self._on_admitted(inst, now)
        if t is None:
            for fn in inst.pop_waiters():      # an idle engine runs commands at once
                evs += fn(now)
            return evs
        core = self.core_of.get(inst.instance_id)
        if core is None:
            evs.append(Event(t, EventKind.STEP_END, inst.instance_id, inst.version))
        else:
            nxt = self.cores[core].add(now, inst.instance_id, max(t - now, 1e-9))
            if nxt:
                evs.append(Event(nxt[0], EventKind.CORE_DONE, core, nxt[1]))
        return evs

    def _on_core_done(self, ev: Event) -> list[Event]:
        done, nxt = self.cores[ev.key].complete(ev.time, ev.data)
        evs = [Event(nxt[0], EventKind.CORE_DONE, ev.key, nxt[1])] if nxt else []
        for flow in done:
            evs += self._step_done(self.instances[flow.flow_id], ev.time)
        return evs

    def _deliver(self, inst: SimInstance, now: float, fn) -> list[Event]:
        """Run `fn(now)` on `inst` at a step boundary (now, or the next one)."""
        self.pending[inst.instance_id].append(fn)
        return self._kick(inst, now)

    def _run_pending(self, inst: SimInstance, now: float) -> list[Event]:
        evs: list[Event] = []
        todo = self.pending[inst.instance_id]
        while todo:
            evs += todo.pop(0)(now) or []
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
        req = SimRequest(ev.data, self.stride)
        self.requests.append(req)
        if self.colocated:
            views = [i.view() for i in self.colocated]
            matched = {i.instance_id: self._matched(i, req) for i in self.colocated}
            iid = pick_instance(views, matched, req.spec.prompt_tokens, now, self.cfg)
            req.pipeline = "colocated"
            return self._start_prefill(req, self.instances[iid], matched[iid], now)
        insts = list(self.instances.values())
        matched = {i.instance_id: self._matched(i, req) for i in insts if i.cache is not None}
        wan = self.estimators[self.md_link].estimate(now) if self.md_link else None
        if wan is not None and not self.links[self.md_link].up:
            wan = type(wan)(wan.throughput_bytes_s, wan.rtt_s, up=False)
        view = ClusterView(tuple(i.view() for i in insts), matched, wan, now)
        try:
            d = choose_pipeline(self._facts(req), view, self.cfg)
        except NoRouteError as e:
            return self._finish(req, now, error=str(e))
        req.decision = d
        req.pipeline = ("relay_filtered" if d.pipeline is Pipeline.RELAY_ONLY and d.reason != "wan down"
                        else d.pipeline.value)
        return self._start_prefill(req, self.instances[d.p_id], matched.get(d.p_id, 0), now)

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
        inst = self.instances[ev.key]
        if ev.data != inst.version or not inst.busy:
            return []       # truncated macro step: a newer end is queued
        return self._step_done(inst, ev.time)

    def _step_done(self, inst: SimInstance, now: float) -> list[Event]:
        due = inst.tick_waiters(inst.current_num_steps)
        out = inst.end_step(now)
        evs: list[Event] = []
        for fn in due:
            evs += fn(now)
        for job in out.jobs_done:
            evs += (self._on_prefill_done(inst, job, now) if job.kind is JobKind.PREFILL
                    else self._on_extend_done(inst, job, now))
        for seq in out.seqs_ended:
            evs += self._on_seq_ended(inst, seq, now)
        if inst.role is Role.RELAY:
            for seq in list(inst.decoding):
                evs += self._maybe_cancel(seq.req, inst, now)
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
                return self._finish(req, now, cache_on=p)
            p.add_seq(Seq(req, s.prompt_tokens + 1, job.num_blocks, relay=False))
            return []
        d = req.decision
        req.prefill_done_s = now
        req.p_blocks = job.num_blocks
        full = self._facts(req).missing_kv_bytes(0)

        def send(t: float) -> list[Event]:
            evs: list[Event] = []
            if d.rld_id is not None:
                evs += self._transfer(req, "rld", p, self.instances[d.rld_id], full, t)
            if d.start_wan:
                evs += self._transfer(req, "md", p, self.instances[d.md_id], d.missing_bytes, t)
            return evs
        if self.manifest_wait:
            p.wait_boundaries(1, send)     # the KV manifest is read after P's next step
            return []
        return send(now)

    # --- transfers ----------------------------------------------------------
    def _transfer(self, req: SimRequest, kind: str, src: SimInstance, dst: SimInstance,
                  num_bytes: int, now: float) -> list[Event]:
        name = self._link_name(src.datacenter, dst.datacenter)
        link = self.links[name]
        flow_id = f"{req.spec.request_id}/{kind}"
        self.flows[flow_id] = (req, kind, dst.instance_id, now, num_bytes, name)
        self.flow_steps[flow_id] = dst.num_steps
        req.pending_transfers += 1
        if kind == "md":
            req.wan_flow = flow_id

        def join(t: float) -> list[Event]:
            if flow_id not in self.flows:
                return []       # cancelled during the handshake
            nxt = link.add(t, flow_id, num_bytes)
            return [Event(nxt[0], EventKind.TRANSFER_DONE, name, nxt[1])] if nxt else []
        return [self._later(link.rtt_s, name, join)]

    def _on_transfer_done(self, ev: Event) -> list[Event]:
        link = self.links[ev.key]
        done, nxt = link.complete(ev.time, ev.data)
        evs = [Event(nxt[0], EventKind.TRANSFER_DONE, ev.key, nxt[1])] if nxt else []
        for flow in done:
            dst = self.instances[self.flows[flow.flow_id][2]]
            landed = self._landed(flow.flow_id, ev.key)
            started = self.flow_steps.get(flow.flow_id, dst.num_steps)
            if self.import_wait and dst.busy:
                # One import command per block (plus BEGIN), one per step of a
                # busy receiver; those that ran while bytes flowed are done.
                blocks = -(-flow.num_bytes // (self.block_size * self.model.kv_bytes_per_token))
                dst.wait_boundaries(max(1, int(blocks) + 1 - (dst.num_steps - started)), landed)
                t = dst.interrupt(ev.time)
                if t is not None:
                    evs.append(Event(t, EventKind.STEP_END, dst.instance_id, dst.version))
            else:
                evs += landed(ev.time)
        return evs

    def _landed(self, flow_id: str, link_name: str):
        """The receiver holds the whole KV: the transfer's end, as the sender sees it."""
        def fn(now: float) -> list[Event]:
            if flow_id not in self.flows:
                return []       # cancelled while its blocks were being imported
            req, kind, dst_id, start, num_bytes, _ = self.flows.pop(flow_id)
            self.flow_steps.pop(flow_id, None)
            self.estimators[link_name].observe(now, num_bytes, now - start)
            if link_name == "wan":
                req.wan_bytes += num_bytes
            evs = self._release_p(req, now)
            dst = self.instances[dst_id]
            return evs + (self._rld_kv_ready(req, dst, now) if kind == "rld"
                          else self._md_kv_ready(req, dst, now))
        return fn

    def _cancel(self, req: SimRequest, now: float) -> list[Event]:
        fid = req.wan_flow
        if fid is None or fid not in self.flows:
            return []
        name = self.flows.pop(fid)[5]
        nxt = self.links[name].cancel(now, fid)
        evs = [Event(nxt[0], EventKind.TRANSFER_DONE, name, nxt[1])] if nxt else []
        return evs + self._release_p(req, now)

    def _release_p(self, req: SimRequest, now: float) -> list[Event]:
        req.pending_transfers -= 1
        if req.pending_transfers:
            return []
        p = self.instances[req.p_id]
        p.release(req.p_blocks)
        return self._kick(p, now)

    # --- decoders -----------------------------------------------------------
    def _rld_kv_ready(self, req: SimRequest, rld: SimInstance, now: float) -> list[Event]:
        if req.done_s is not None:
            return []
        req.emit([now], relay=True, delay_s=rld.deliver_s)
        if req.finished:
            return self._end_on_rld(req, now)
        s = req.spec
        req.rld_seq = Seq(req, s.prompt_tokens + 1, rld.blocks_for(s.prompt_tokens + s.max_tokens),
                          relay=True)
        rld.add_seq(req.rld_seq)
        evs = self._kick(rld, now)
        if req.md_ready_pending is not None:
            fn, req.md_ready_pending = req.md_ready_pending, None
            return evs + self._deliver(rld, now, fn)
        return evs + self._maybe_cancel(req, rld, now)

    def _maybe_cancel(self, req: SimRequest, rld: SimInstance, now: float) -> list[Event]:
        """The live filter, as the router runs it while RLD streams eager tokens."""
        if req.session is not None or req.done_s is not None or req.wan_flow not in self.flows:
            return []
        remaining = max(0.0, req.decision.est_wan_s - (now - req.prefill_done_s))
        tpot = rld.step_time_s or self.cfg.rld_tpot_prior_s
        if should_cancel_wan(now, req.spec.max_tokens - req.num_generated, remaining, tpot, self.cfg):
            req.pipeline = "relay_cancelled"
            return self._cancel(req, now)
        return []

    def _md_kv_ready(self, req: SimRequest, md: SimInstance, now: float) -> list[Event]:
        s = req.spec
        if md.cache is not None:
            md.cache.insert(s.block_ids)     # DRC keeps the prefix, whatever happens next
        if req.done_s is not None:
            return []
        blocks = md.blocks_for(s.prompt_tokens + s.max_tokens)
        if req.decision.pipeline is Pipeline.DIRECT:
            req.emit([now], relay=False, delay_s=md.deliver_s)
            if req.finished:
                return self._finish(req, now, cache_on=md)
            req.md_seq = Seq(req, s.prompt_tokens + 1, blocks, relay=False)
        else:
            req.md_seq = Seq(req, s.prompt_tokens, blocks, relay=False, decoding=False)
        md.add_seq(req.md_seq)
        return self._kick(md, now)

    def _md_ready(self, md: SimInstance, seq: Seq, now: float) -> list[Event]:
        req = seq.req
        rld = self.instances[req.decision.rld_id]

        def at_rld(t: float) -> list[Event]:
            if req.done_s is not None:
                md.remove_seq(seq)
                return self._kick(md, t)
            if req.rld_seq is None:
                # MD beat RLD's own copy: as the router does, start the handoff
                # once RLD has streamed its first token.
                req.md_ready_pending = at_rld
                return []
            mode = choose_handoff_mode(req.num_generated, rld.view(), self.cfg)
            req.session = HandoffSession(req.spec.request_id, mode, self.cfg)
            req.handoff_mode = mode.value
            return self._apply(req, rld, md, req.session.on_md_ready(t, req.num_generated), t)
        return [self._later(self._one_way(md, rld), rld.instance_id,
                            lambda t: self._deliver(rld, t, at_rld))]

    def _apply(self, req: SimRequest, rld: SimInstance, md: SimInstance, action, now: float) -> list[Event]:
        if isinstance(action, Complete):
            rld.remove_seq(req.rld_seq)
            return []
        assert isinstance(action, SendBatch)
        if action.final:
            req.rld_seq.stop_at = action.end
            rld.stop_decoding(req.rld_seq)
        job = Job(req, JobKind.EXTEND, action.num_tokens, req.spec.prompt_tokens + action.start, 0,
                  data=action)

        def at_md(t: float) -> list[Event]:
            if req.done_s is not None:
                return []
            if job.num_tokens == 0:
                return self._on_extend_done(md, job, t)
            md.add_job(job)
            return self._kick(md, t)
        return [self._later(self._one_way(rld, md), md.instance_id, at_md)]

    def _on_extend_done(self, md: SimInstance, job: Job, now: float) -> list[Event]:
        req, batch = job.req, job.data
        seq = req.md_seq
        seq.context += job.num_tokens
        evs: list[Event] = []
        if batch.final:
            md.start_decoding(seq)
            evs += self._kick(md, now) if job.num_tokens == 0 else []
        rld = self.instances[req.decision.rld_id]

        def at_rld(t: float) -> list[Event]:
            sess = req.session
            if sess.state.terminal or sess.state is HandoffState.AWAITING_MD:
                return []
            # RLD's own count: after a final batch MD may already have streamed more.
            stop = req.rld_seq.stop_at
            act = sess.on_batch_extended(t, batch.end, req.num_generated if stop is None else stop)
            return self._apply(req, rld, md, act, t)
        evs.append(self._later(self._one_way(md, rld), rld.instance_id,
                               lambda t: self._deliver(rld, t, at_rld)))
        return evs

    def _on_seq_ended(self, inst: SimInstance, seq: Seq, now: float) -> list[Event]:
        req = seq.req
        if not req.finished:
            return []                        # RLD parked at its final batch
        if seq.relay:
            return self._end_on_rld(req, now)
        return self._finish(req, now, cache_on=inst)

    def _end_on_rld(self, req: SimRequest, now: float) -> list[Event]:
        req.ended_on_rld = True
        sess = req.session
        if sess is not None and sess.state in (HandoffState.AWAITING_MD, HandoffState.EXTENDING):
            sess.on_rld_finished(now, req.num_generated)
        evs = self._cancel(req, now)
        if req.md_seq is not None:
            md = self.instances[req.decision.md_id]
            md.remove_seq(req.md_seq)
            evs += self._kick(md, now)
        return evs + self._finish(req, now)

    def _finish(self, req: SimRequest, now: float, error: str | None = None,
                cache_on: SimInstance | None = None) -> list[Event]:
        req.done_s = now + req.last_delay_s      # when the user saw the end
        if error is not None:
            req.failed, req.error = True, error
        if cache_on is not None and cache_on.cache is not None:
            cache_on.cache.insert(req.spec.full_block_ids)
        nxt = self.stream.next_after(req.spec, req.done_s, req.failed)
        if nxt is None:
            return []
        return [self._arrival(n) for n in (nxt if isinstance(nxt, list) else [nxt])]


def _bytes(gbps: float | None) -> float | None:
    return None if gbps is None else gbps * 1e9 / 8
