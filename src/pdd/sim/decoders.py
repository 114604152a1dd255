"""The decoders of the simulated cluster: RLD's eager tokens, the live filter,
MD's readiness and the extend handoff, driven by `pdd.policy.HandoffSession`.

A mixin of `pdd.sim.cluster.Cluster`. Messages between RLD and MD (MD ready,
a batch of token ids, an extend done) take one-way link latency and run on
the receiving engine at a step boundary, as the servers' engine commands do.
"""

from __future__ import annotations

from pdd.policy import Complete, HandoffState, Pipeline, SendBatch
from pdd.policy import cancel_wan, convert_to_relay_only, keep_wan_copy, new_session
from pdd.policy.lifecycle_io import Outcome
from pdd.sim.instance import Job, JobKind, Seq, SimInstance
from pdd.sim.loop import Event
from pdd.sim.request import SimRequest


class DecodersMixin:
    def _rld_kv_ready(self, req: SimRequest, rld: SimInstance, now: float) -> list[Event]:
        if req.done_s is not None:
            return []
        req.emit([now], relay=True, delay_s=rld.deliver_s)
        if req.finished:
            return self._end_on_rld(req, now)
        s = req.spec
        if rld.cache is not None:
            rld.cache.insert(s.block_ids)
        shared = rld.pin_prefix(s.block_ids)     # the prompt's blocks, shared with RLD's cache
        req.rld_seq = Seq(req, s.prompt_tokens + 1,
                          rld.blocks_for(s.prompt_tokens + s.max_tokens) - len(shared),
                          relay=True, shared=shared)
        req.rld_seq.first = self._first_step_tokens(s.prompt_tokens)
        evs = self._submit(rld, req.rld_seq, now)
        if req.md_ready_pending is not None:
            fn, req.md_ready_pending = req.md_ready_pending, None
            return evs + self._deliver(rld, now, fn)
        return evs + self._maybe_cancel(req, rld, now)

    def _maybe_cancel(self, req: SimRequest, rld: SimInstance, now: float) -> list[Event]:
        """The live filter, as the router runs it while RLD streams eager tokens."""
        if req.session is not None or req.done_s is not None or req.wan_flow not in self.flows:
            return []
        if cancel_wan(req.decision, self.relay_budgets, now, now - req.prefill_done_s,
                      req.spec.max_tokens - req.num_generated, rld.view(), self.cfg):
            convert_to_relay_only(self.relay_budgets)
            req.pipeline = Outcome.RELAY_CANCELLED.value
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
        shared = md.pin_prefix(s.block_ids)      # imported blocks, pinned for the request
        blocks -= len(shared)
        if req.decision.pipeline is Pipeline.DIRECT:
            req.md_seq = Seq(req, s.prompt_tokens + 1, blocks, relay=False, shared=shared)
            req.md_seq.first = self._first_step_tokens(s.prompt_tokens)
        else:
            req.md_seq = Seq(req, s.prompt_tokens, blocks, relay=False, decoding=False, shared=shared)
        return self._submit(md, req.md_seq, now)

    def _first_step_tokens(self, prompt_tokens: int) -> int:
        """What a decoder's first step computes for a request whose KV it
        received: our servers send whole blocks only, so the prompt's
        partial last block is recomputed with P's first token (runtime
        deployment files; 1, a plain decode token, elsewhere)."""
        if self.mode.serving is None:
            return 1
        return prompt_tokens % self.block_size + 1

    def _submit(self, inst: SimInstance, seq: Seq, now: float) -> list[Event]:
        """The decode server submits the request to its engine once the KV has
        landed, as an engine command: a busy engine takes it at its next step
        boundary (the landing itself waited for the one before)."""
        def go(t: float) -> list[Event]:
            if seq.removed:                 # ended meanwhile (RLD finished, handoff done)
                inst.unshare(seq.shared)
                seq.shared = []
                return []
            inst.add_seq(seq)
            return self._kick(inst, t)
        if self.import_wait == "none" or not inst.busy:
            return go(now)
        inst.wait_boundaries(1, go)
        return self._kick(inst, now)        # busy: a macro step ends at the next boundary

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
            req.session = new_session(req.spec.request_id, req.num_generated, rld.view(), self.cfg)
            req.handoff_mode = req.session.mode.value
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
        # The WAN copy keeps landing into MD's cache unless the filter's class.
        evs = [] if keep_wan_copy(req.decision) else self._cancel(req, now)
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
