"""The simulator's driver of `pdd.policy.RequestLifecycle`: one PDD request's
rules (eager tokens, handoff batches, the live filter and WAN cancel, the
warm push, failover, P's release, the outcome) come from the same object
the router's `PddRun` drives; this module only times them.

    simulated event (KV landed, a step's tokens, MD ready at RLD's step
      boundary, an extend done, the lifecycle's wake time) -> a fact with
      `now` -> commands
    commands -> simulated work: a transfer on a link, a sequence on a
      decoder, an extend job after one-way latency, a pause, an abort,
      the user's token at its time, the request's end

A mixin of `pdd.sim.cluster.Cluster`. As in the servers, messages between
RLD and MD (MD ready, a batch of token ids, an extend done) take one-way
link latency and run on the receiving engine at a step boundary; each is an
event record (`pdd.sim.events`) naming the request and the instances by id.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.policy import lifecycle_io as io
from pdd.policy.lifecycle import RequestLifecycle
from pdd.policy.views import Role
from pdd.sim.events import (
    AheadReachesMd, ExtendedReachesRld, ExtendReachesMd, LifecycleWake, MdReadyReachesRld, MdTokensReachRouter,
    StepEnd,
)
from pdd.sim.instance import Job, JobKind, Seq, SimInstance
from pdd.sim.loop import Event
from pdd.sim.request import SimRequest

_KIND = {Role.RELAY: "rld"}          # a transfer's kind by its receiver's role ("md" otherwise)


@dataclass(frozen=True)
class ExtendBatch:
    """An extend job's data: MD holds `end` output tokens once it ran."""
    final: bool
    end: int


class LifecycleDriverMixin:
    def _register_lifecycle_events(self) -> None:
        for record_type in (MdReadyReachesRld, ExtendedReachesRld):
            self.loop.on(record_type, self._on_reaches_rld)
        self.loop.on(ExtendReachesMd, self._on_extend_reaches_md)
        self.loop.on(AheadReachesMd, self._on_ahead_reaches_md)
        self.loop.on(LifecycleWake, self._on_wake)
        self.loop.on(MdTokensReachRouter, self._on_md_tokens_reach_router)

    # --- facts in ------------------------------------------------------------
    def _begin(self, req: SimRequest, d, matched: int, now: float) -> list[Event]:
        req.lc = RequestLifecycle(self._facts(req), d, self.cfg, self.relay_budgets, req.warm_blocks,
                                  self.copies)
        req.pipeline, req.pipeline_reason = req.lc.outcome.value, d.reason
        return self._carry(req, req.lc.start(now), now, matched=matched)

    def _feed(self, req: SimRequest, fact, times: list[float] = (), first: int = 0) -> list[Event]:
        """`times[k]`: when token `first + k` was made (a step's tokens); other
        tokens the fact releases were made at `fact.now`."""
        evs = self._carry(req, req.lc.handle(fact), fact.now, times, first)
        return evs + self._after_fact(req, fact.now)

    def _after_fact(self, req: SimRequest, now: float) -> list[Event]:
        """The lifecycle's wake time, as an event; RLD's and MD's sequences
        step one token at a time while their tokens race (an overlap or a
        paced handoff: the switch is decided token by token, as the router
        sees the two streams), in macro steps again once the race is over."""
        lc = req.lc
        evs: list[Event] = []
        racing = lc.racing and lc.done is None
        for iid, seq in req.seqs.values():
            if seq.single != racing:
                seq.single = racing
                inst = self.instances[iid]
                t = inst.interrupt(now) if racing and inst.busy else None
                if t is not None:            # a macro step under way ends at its next boundary
                    evs.append(Event(t, StepEnd(iid, inst.version)))
        wake = lc.wake_s()
        if wake is None or wake == req.wake_at:
            return evs
        req.wake_at = wake
        return evs + [Event(max(wake, now), LifecycleWake(req.spec.request_id, wake))]

    def _on_wake(self, ev: Event) -> list[Event]:
        req = self.by_id.get(ev.record.request_id)
        if req is None or req.lc is None or req.wake_at != ev.record.at:
            return []                        # stale: the lifecycle asked for another time since
        req.wake_at = None
        if req.lc.wake_s() is None:
            return []
        return self._feed(req, io.Wake(ev.time))

    def _on_tokens(self, inst: SimInstance, seq: Seq, times: list[float], now: float) -> list[Event]:
        """A step's tokens for `seq`: one fact for all of them, then the
        stream's end when it made the last one."""
        req = seq.req
        if req.lc is None:                   # colocated: no lifecycle
            req.emit(times, relay=False, delay_s=inst.deliver_s)
            return self._finish(req, now, cache_on=inst) if req.finished else []
        leg = io.Leg.RLD if seq.relay else io.Leg.MD
        if req.seqs.get(leg, (None, None))[1] is not seq:
            return []                        # closed meanwhile: the instance dropped them
        first = seq.next_index - len(times)
        if leg is io.Leg.MD and req.lc.racing:
            req.md_made.update(zip(range(first, seq.next_index), times))
            req.md_travels = req.md_travels or self._md_lag_s(req, inst) > 0
        if leg is io.Leg.MD and req.md_travels:
            req.md_in_flight[first] = list(times)
            msg = MdTokensReachRouter(req.spec.request_id, inst.instance_id, first, len(times), seq.finished)
            return [self._later(self._md_lag_s(req, inst), msg)]
        fact = io.DecodeTokens(now, leg, first, tuple(range(first, seq.next_index)),
                               inst.view() if seq.relay else None)
        evs = self._feed(req, fact, times, first)
        if seq.finished:
            evs += self._stream_ended(req, leg, now)
        return evs

    def _md_lag_s(self, req: SimRequest, md: SimInstance) -> float:
        """How much later MD's token reaches the router than RLD's made at
        the same time (the lifecycle's clock is the RLD side's)."""
        rld = self.instances.get(req.lc.rld_id) if req.lc.rld_id else None
        return max(0.0, md.deliver_s - (rld.deliver_s if rld is not None else 0.0))

    def _on_md_tokens_reach_router(self, ev: Event) -> list[Event]:
        msg, now = ev.record, ev.time
        req = self.by_id[msg.request_id]
        times = req.md_in_flight.pop(msg.first, [])
        md_id, seq = req.seqs.get(io.Leg.MD, (None, None))
        if req.lc.done is not None or seq is None or md_id != msg.md_id:
            return []                        # closed meanwhile: the router drops them
        fact = io.DecodeTokens(now, io.Leg.MD, msg.first, tuple(range(msg.first, msg.first + msg.count)))
        evs = self._feed(req, fact, times, msg.first)
        if msg.ends:
            evs += self._stream_ended(req, io.Leg.MD, now)
        return evs

    def _stream_ended(self, req: SimRequest, leg: io.Leg, now: float) -> list[Event]:
        s = req.spec
        reason = io.EndReason.LENGTH if s.output_tokens >= s.max_tokens else io.EndReason.STOP
        return self._feed(req, io.DecodeEnded(now, leg, reason))

    def _kv_landed(self, req: SimRequest, dst: SimInstance, now: float) -> list[Event]:
        """A transfer to a decoder landed: P hears of it, and the decoder's
        stream (if still open there) starts: token 0 (P's, sent with the KV)
        at once, unless MD holds it back for the handoff's extends."""
        s = req.spec
        if dst.cache is not None:
            dst.cache.insert(s.block_ids)    # DRC keeps the prefix, whatever happens next
        evs = self._feed(req, io.TransferEnded(now, dst.instance_id, True))
        leg = io.Leg.RLD if dst.role is Role.RELAY else io.Leg.MD
        if req.lc.done is not None or req.legs.get(leg, (None,))[0] != dst.instance_id:
            return evs
        hold = req.legs[leg][1]
        # MD took RLD's tokens sent ahead: it computes them with the prompt's
        # tail in its first step and decodes on (as the decode server does
        # unless they leave nothing to make).
        ahead = leg is io.Leg.MD and hold and 1 < req.md_have < min(s.max_tokens, s.output_tokens)
        seq = None
        if hold or s.output_tokens > 1:          # a one-token answer needs no decode step
            shared = dst.pin_prefix(s.block_ids)      # imported blocks, pinned for the request
            blocks = dst.blocks_for(s.prompt_tokens + s.max_tokens) - len(shared)
            if ahead:
                seq = Seq(req, s.prompt_tokens + req.md_have, blocks, relay=False, shared=shared)
                seq.next_index = req.md_context = req.md_have
                seq.first = self._first_step_tokens(s.prompt_tokens) + req.md_have - 1
            elif hold:
                seq = Seq(req, s.prompt_tokens, blocks, relay=False, decoding=False, shared=shared)
                seq.next_index = 0
            else:
                seq = Seq(req, s.prompt_tokens + 1, blocks, relay=leg is io.Leg.RLD, shared=shared)
                seq.next_index = 1
                seq.first = self._first_step_tokens(s.prompt_tokens)
            # Registered before token 0 goes out: the handoff may pause it at once.
            req.seqs[leg] = (dst.instance_id, seq)
        if ahead:
            rld = self.instances[req.lc.rld_id].view() if req.lc.rld_id in self.instances else None
            evs += self._feed(req, io.KvReady(now, rld, md=dst.view(), md_have=req.md_have))
        elif not hold:
            evs += self._feed(req, io.KvReady(now)) if leg is io.Leg.MD else []
            evs += self._feed(req, io.DecodeTokens(now, leg, 0, (0,), dst.view() if leg is io.Leg.RLD else None))
            if seq is None:
                return evs + self._stream_ended(req, leg, now)
        if req.seqs.get(leg, (None, None))[1] is not seq:
            return evs                         # closed by what token 0 decided (KV unpinned)
        return evs + self._submit(dst, seq, now)

    def _md_ready(self, md: SimInstance, seq: Seq, now: float) -> list[Event]:
        """MD admitted a held request: RLD hears of it (one way), at a step boundary."""
        req = seq.req
        rld = self.instances[req.lc.rld_id] if req.lc.rld_id else md
        msg = MdReadyReachesRld(rld.instance_id, req.spec.request_id, md.instance_id)
        return [self._later(self._one_way(md, rld), msg)]

    def _on_reaches_rld(self, ev: Event) -> list[Event]:
        """A message from MD reached RLD: it waits for RLD's step boundary."""
        return self._deliver(self.instances[ev.record.to_id], ev.time, ev.record)

    def _at_boundary(self, msg, now: float) -> list[Event]:
        """A message delivered to an instance takes effect at its step boundary."""
        req = self.by_id[msg.request_id]
        if isinstance(msg, ExtendedReachesRld):
            return self._feed(req, io.Extended(now, msg.end))
        # MdReadyReachesRld: unless MD has dropped the request meanwhile.
        md_id, seq = req.seqs.get(io.Leg.MD, (None, None))
        if seq is None or md_id != msg.md_id or seq.removed:
            return []
        return self._feed(req, io.KvReady(now, self.instances[msg.to_id].view(), md=self.instances[md_id].view()))

    def _on_extend_done(self, md: SimInstance, job: Job, now: float) -> list[Event]:
        req, batch = job.req, job.data
        if req.lc.done is not None or io.Leg.MD not in req.seqs:
            return []
        seq = req.seqs[io.Leg.MD][1]
        seq.context += job.num_tokens
        if batch.final:
            seq.next_index = batch.end
            if seq.finished:
                return self._stream_ended(req, io.Leg.MD, now)
            md.start_decoding(seq)
            return self._kick(md, now) if job.num_tokens == 0 else []
        rld = self.instances[req.lc.rld_id] if req.lc.rld_id else md
        msg = ExtendedReachesRld(rld.instance_id, req.spec.request_id, batch.end)
        return [self._later(self._one_way(md, rld), msg)]

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

    # --- commands out ----------------------------------------------------------
    def _carry(self, req: SimRequest, cmds: list, now: float, times: list[float] = (), first: int = 0,
               matched: int = 0) -> list[Event]:
        def made(i: int) -> float:
            return times[i - first] if 0 <= i - first < len(times) else now
        evs: list[Event] = []
        i, n = 0, len(cmds)
        while i < n:
            cmd = cmds[i]
            req.log.add(cmd)
            i += 1
            if isinstance(cmd, io.Emit):
                # A step's tokens come as a run of Emits from one source: one call.
                run = [cmd]
                while (i < n and isinstance(cmds[i], io.Emit) and cmds[i].source is cmd.source
                       and cmds[i].held == cmd.held):
                    run.append(cmds[i])
                    i += 1
                if cmd.held:
                    # A paced handoff let them out now (they were made before).
                    self._emit(req, cmd.source, [now] * len(run), held=True)
                elif cmd.source is io.Leg.MD and req.md_made and not 0 <= cmd.index - first < len(times):
                    self._emit_ahead(req, [c.index for c in run], now)
                else:
                    self._emit(req, cmd.source, [made(c.index) for c in run])
            elif isinstance(cmd, io.EmitRun):
                k = cmd.first_index - first
                if k == 0 and len(cmd.tokens) == len(times):
                    self._emit(req, cmd.source, times)         # the whole step, as made
                else:
                    self._emit(req, cmd.source, [made(cmd.first_index + j) for j in range(len(cmd.tokens))])
            elif isinstance(cmd, io.StartPrefill):
                req.targets = cmd.targets
                evs += self._start_prefill(req, self.instances[cmd.p_id], matched, now)
            elif isinstance(cmd, io.OpenDecode):
                req.legs[cmd.leg] = (cmd.instance_id, cmd.hold)
                if cmd.leg is io.Leg.MD:
                    req.md_have = 1            # a fresh decode call: nothing sent ahead to it yet
            elif isinstance(cmd, (io.CloseStream, io.Abort)):
                evs += self._close(req, cmd.leg, now)
            elif isinstance(cmd, io.StartTransfer):
                evs += self._send(req, io.Transfer(cmd.instance_id), now)
            elif isinstance(cmd, io.CancelTransfer):
                evs += self._cancel_to(req, cmd.instance_id, now)
            elif isinstance(cmd, io.ExtendMd):
                evs += self._extend(req, cmd)
            elif isinstance(cmd, io.ExtendAhead):
                md = self.instances[cmd.instance_id]
                rld = self.instances[req.lc.rld_id or req.p_id]
                msg = AheadReachesMd(md.instance_id, req.spec.request_id, cmd.start, cmd.start + len(cmd.token_ids))
                evs.append(self._later(self._one_way(rld, md), msg))
            elif isinstance(cmd, (io.PauseRld, io.ResumeRld)):
                evs += self._pause(req, cmd, now)
            elif isinstance(cmd, io.ReleaseP):
                evs += self._release_p(req, now)
            elif isinstance(cmd, io.WanFailed):
                if self.md_link is not None:
                    self.estimators[self.md_link].observe_failure(now)
            elif isinstance(cmd, io.Note):
                if cmd.event == "md_ready":
                    req.handoff_mode = cmd.fields["mode"]
            elif isinstance(cmd, io.Finish):
                evs += self._finish_lc(req, cmd, now)
        return evs

    def _emit(self, req: SimRequest, leg: io.Leg, times: list[float], held: bool = False) -> None:
        """The user's next tokens, made at `times`, reach the user from `leg`'s instance."""
        iid = (req.seqs.get(leg) or req.legs.get(leg) or (req.p_id,))[0] if leg is not io.Leg.P else req.p_id
        req.emit(times, relay=leg is io.Leg.RLD, delay_s=self.instances[iid].deliver_s, held=held,
                 from_p=leg is io.Leg.P)

    def _emit_ahead(self, req: SimRequest, indices: list[int], now: float) -> None:
        """MD's tokens that ran ahead of RLD's (an overlap handoff) go out when
        the stream moves to MD: each reaches the user when both it (from MD)
        and the fact that moved the stream (RLD's token, at `now`) have
        reached the router."""
        md = self.instances[req.lc.md_id]
        rld_id = req.lc.rld_id or req.p_id
        at = now + self.instances[rld_id].deliver_s
        times = [max(at, req.md_made.get(i, now) + md.deliver_s) for i in indices]
        req.emit(times, relay=False)
        req.last_delay_s = md.deliver_s
        req.md_made.clear()

    def _send(self, req: SimRequest, t: io.Transfer, now: float) -> list[Event]:
        dst = self.instances[t.instance_id]
        kind = "warm" if t.warm_blocks else _KIND.get(dst.role, "md")
        return self._transfer(req, kind, self.instances[req.p_id], dst, now, t.warm_blocks or None, t.background)

    def _close(self, req: SimRequest, leg: io.Leg, now: float) -> list[Event]:
        req.legs.pop(leg, None)
        iid, seq = req.seqs.pop(leg, (None, None))
        if seq is None:
            return []
        inst = self.instances[iid]
        # Out of the batch already: a busy engine's steps under way stand
        # (its next step admits what waits); an idle one starts one.
        parked = seq in inst.parked and inst.busy
        inst.remove_seq(seq)
        return [] if parked else self._kick(inst, now)

    def _extend(self, req: SimRequest, cmd: io.ExtendMd) -> list[Event]:
        """A batch of token ids travels to MD (one way) and runs there as a
        prefill-like chunk; the first also computes P's token (MD has only
        the prompt's KV)."""
        md = self.instances[cmd.instance_id]
        n = len(cmd.token_ids) + (1 if req.md_context == 0 else 0)
        msg = ExtendReachesMd(md.instance_id, req.spec.request_id, num_tokens=n,
                              ctx_start=req.spec.prompt_tokens + req.md_context,
                              final=cmd.final, end=req.md_context + n)
        req.md_context += n
        rld_id = req.lc.rld_id or req.p_id
        return [self._later(self._one_way(self.instances[rld_id], md), msg)]

    def _on_ahead_reaches_md(self, ev: Event) -> list[Event]:
        """Kept while MD's decode waits for its KV (the server's `add_ahead`);
        once the KV landed MD takes no more."""
        msg = ev.record
        req = self.by_id.get(msg.request_id)
        if (req is not None and req.lc is not None and req.lc.done is None and io.Leg.MD not in req.seqs
                and req.legs.get(io.Leg.MD, (None,))[0] == msg.to_id and msg.start <= req.md_have):
            req.md_have = max(req.md_have, msg.upto)
        return []

    def _on_extend_reaches_md(self, ev: Event) -> list[Event]:
        msg, t = ev.record, ev.time
        req, md = self.by_id[msg.request_id], self.instances[msg.to_id]
        if req.lc.done is not None:
            return []
        job = Job(req, JobKind.EXTEND, msg.num_tokens, msg.ctx_start, 0,
                  data=ExtendBatch(msg.final, msg.end))
        if job.num_tokens == 0:
            return self._on_extend_done(md, job, t)
        md.add_job(job)
        return self._kick(md, t)

    def _pause(self, req: SimRequest, cmd: io.PauseRld | io.ResumeRld, now: float) -> list[Event]:
        if io.Leg.RLD not in req.seqs:
            return []
        iid, seq = req.seqs[io.Leg.RLD]
        rld = self.instances[iid]
        if isinstance(cmd, io.PauseRld):
            seq.stop_at = req.lc.stop_at if cmd.at is None else cmd.at
            if cmd.at is None or seq.tokens_left() <= 0:
                rld.stop_decoding(seq)
                return []
            # Held once it has made `at` tokens: a macro step under way ends at
            # the next boundary; the next step's plan stops there.
            return self._kick(rld, now) if rld.busy else []
        seq.stop_at = None
        rld.start_decoding(seq)
        return self._kick(rld, now)

    def _finish_lc(self, req: SimRequest, cmd: io.Finish, now: float) -> list[Event]:
        """The user's stream is over: MD's cache keeps the answer when MD gave it."""
        req.pipeline = cmd.outcome.value
        failed = cmd.reason is io.FinishReason.ERROR
        md = req.seqs.get(io.Leg.MD, (None,))[0] if req.lc.owner is io.Leg.MD and not failed else None
        evs: list[Event] = []
        for leg in list(req.seqs):
            evs += self._close(req, leg, now)
        req.legs.clear()
        if failed and not req.lc.warming:       # the router closes P's stream too: P frees the KV
            evs += self._release_p(req, now)
        return evs + self._finish(req, now, error=cmd.error if failed else None,
                                  cache_on=self.instances[md] if md else None)

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
