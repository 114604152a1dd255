"""One request through PDD: the driver of `pdd.policy.RequestLifecycle`.

The lifecycle (pure, in `pdd.policy.lifecycle`) holds every rule of a PDD
request after routing: eager tokens, the extend handoff, the live filter,
the warm push, failover, RLD or MD lost. This module only moves bytes:

    decide (policy.choose_pipeline, plan_warm) -> RequestLifecycle (counts it in the budgets)
    loop: next NDJSON event (P, RLD, MD), a stall or the lifecycle's wake
          time (`wake_s`: a paced handoff's next token) -> one fact -> commands
          -> HTTP calls (open a decode, send / cancel / release, extend, abort),
             tokens to the user, trace events
    Finish -> the flow ends (FlowError for an error); P stays open while a copy
      for MD's prefix cache still lands (`warming`).
The commands, a word per decision (`policy.lifecycle_log`), end in the
trace as one "lifecycle" event: the simulator's replay logs the same words.
A stream the lifecycle watches (RLD with its KV, MD owning the stream or
extending a batch) that says nothing for stream_stall_s, while its instance
also leaves the router's load polls unanswered, becomes a `PeerGone` fact.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import secrets
import time
from typing import AsyncIterator

from pdd.deploy.spec import Role
from pdd.policy import PipelineDecision, RequestFacts, choose_pipeline, plan_warm, stalled
from pdd.policy import lifecycle_io as io
from pdd.policy.lifecycle import RequestLifecycle
from pdd.policy.lifecycle_log import DecisionLog
from pdd.server.cluster import Cluster, Member
from pdd.server.flows import (
    FlowError, RequestContext, Streams, control, decode_body, note_prefill, note_transfer, prefill_body,
    release, target,
)
from pdd.server.wire import InternalClient

_ENDS = {r.value: r for r in io.EndReason}


def _laned(cmd) -> bool:
    """A control call sent in order per instance, off the fact loop (`PddRun.in_lane`).
    P's release and a cancelled copy too: nothing waits for their answer, and
    any call to P can be slow to come back; awaited in the loop, they held
    every token that came meanwhile (an MD's first tokens reached the user
    together up to 1.4 s late, `results/wan-bound-68`, `ab-s36-c1`: "What
    session 36 found"; P's prefill handler then held the connection such a
    call went out on until P's step ended, mended in session 37)."""
    return (isinstance(cmd, (io.ExtendMd, io.PauseRld, io.ResumeRld, io.ReleaseP, io.CancelTransfer))
            or isinstance(cmd, io.Abort) and cmd.background)


class PddRun:
    def __init__(self, ctx: RequestContext, cluster: Cluster, client: InternalClient):
        self.ctx, self.cluster, self.client = ctx, cluster, client
        self.streams = Streams(client)
        self.lc: RequestLifecycle | None = None
        self.decision: PipelineDecision | None = None
        self.members: dict[io.Leg, Member] = {}      # the instance behind each open leg
        self.out: list[int] = []                     # tokens committed by the last fact, to yield
        self.background: set[asyncio.Task] = set()
        self.lanes: dict[str, asyncio.Task] = {}     # instance -> its last control call (in order)
        self.log = DecisionLog()                     # the commands, for the trace ("lifecycle")
        self.p_counted: str | None = None            # P counts this request as its own until it prefilled it
        self.ahead_ids: list[int] = []               # the user's tokens from index 1 on, sent to MD ahead
        self.ahead_taken = 1                         # ... of which MD holds this many (with P's first)
        self.ahead_task: asyncio.Task | None = None

    def facts(self) -> RequestFacts:
        ctx = self.ctx
        return RequestFacts(ctx.request_id, len(ctx.prompt_ids), ctx.sampling.max_tokens,
                            ctx.kv_bytes_per_token, ctx.block_size)

    # -- setup ---------------------------------------------------------------
    async def decide(self) -> RequestLifecycle:
        c, ctx = self.cluster, self.ctx
        facts = self.facts()
        names = [m.spec.name for m in c.members.values()
                 if m.view.role.value in ("prefill", "main", "relay")]
        matched = await c.matched_tokens(names, ctx.prompt_ids)
        view = c.view(matched, time.monotonic())
        d = choose_pipeline(facts, view, c.policy, c.relay_budgets)
        self.decision = d
        ctx.trace.pipeline, ctx.trace.pipeline_reason = io.Outcome.of(d).value, d.reason
        w = view.wan
        ctx.trace.event("pipeline", pipeline=d.pipeline.value, reason=d.reason,
                        missing_bytes=d.missing_bytes, est_wan_s=d.est_wan_s, wait_s=d.wait_s,
                        rld_wait_s=d.rld_wait_s if math.isfinite(d.rld_wait_s) else None,
                        # the line as the decision saw it
                        wan=None if w is None else {"rtt_s": w.rtt_s, "bytes_s": w.throughput_bytes_s,
                                                    "overhead_s": w.overhead_s, "queued_bytes": w.queued_bytes,
                                                    "queued_background_bytes": w.queued_background_bytes})
        self.members[io.Leg.P] = c.members[d.p_id]
        return RequestLifecycle(facts, d, c.policy, c.relay_budgets, self.plan_warm(d, matched), c.copies)

    def plan_warm(self, d: PipelineDecision, matched: dict[str, int]) -> int:
        """Count this request's shared prefix; a filtered one may still warm MD
        with it: the blocks to push."""
        ctx, bs = self.ctx, self.ctx.block_size
        key = lambda n: hashlib.blake2b(repr(ctx.prompt_ids[:n]).encode(), digest_size=16).digest()
        tokens, reuses = plan_warm(d, matched, key, self.cluster.prefix_reuses, bs, self.cluster.policy)
        if tokens:
            ctx.trace.event("warm_md", tokens=tokens, reuses=reuses)
        return tokens // bs

    # -- main loop -------------------------------------------------------------
    async def run(self) -> AsyncIterator[int]:
        s = self.ctx.sampling
        if s.temperature > 0 and s.seed is None:
            # RLD and MD must draw alike for an overlap handoff to check MD's
            # tokens against RLD's (the sampler seeds by (seed, position)): an
            # unseeded sampled request gets a random seed of its own here.
            self.ctx.sampling = dataclasses.replace(s, seed=secrets.randbits(63))
        self.lc = await self.decide()
        try:
            await self.apply(self.lc.start(time.monotonic()))
            while self.lc.done is None:
                # The user's tokens go out before the calls the same fact asks
                # for: the token that triggers a final batch must not wait for
                # MD's extend and RLD's pause to be answered across the WAN.
                rest = self.emit_first(self.lc.handle(await self.next_fact()))
                out, self.out = self.out, []
                for tok in out:
                    yield tok
                await self.apply(rest, logged=True)
                out, self.out = self.out, []
                for tok in out:
                    yield tok
            done = self.lc.done
            if done.reason is io.FinishReason.ERROR:
                raise FlowError(done.error)
            self.ctx.finish_reason = done.reason.value
        finally:
            if self.lc.done is None:          # the client went away
                for cmd in self.lc.handle(io.ClientGone(time.monotonic())):
                    self.log.add(cmd)
                    if _laned(cmd):
                        self.in_lane(cmd)     # behind a pause still on its way; nothing awaited here
            t = self.ctx.trace
            t.eager_tokens = t.rld_tokens
            t.handoff_batches = self.lc.handoff_batches
            t.pipeline = self.lc.outcome.value          # the filter may have cancelled, failover moved
            t.event("lifecycle", log=list(self.log.words))    # what `pdd sim --validate` compares
            self.uncount_p()
            for leg in (io.Leg.RLD, io.Leg.MD):
                if leg in self.members:
                    self.cluster.dispatched(self.members[leg].spec.name, -1)
            if self.lc.warming:
                # The user has the answer; P keeps the prompt KV (its stream
                # open) until the shared prefix has reached MD.
                self.streams.close("rld")
                asyncio.get_running_loop().create_task(self.finish_warm())
            else:
                self.streams.close_all()

    async def next_fact(self):
        """The next stream event as a fact, or `PeerGone` for a watched stream
        silent past stream_stall_s, or `DeadlinePassed`, or `Wake` once the
        lifecycle's wake time has come."""
        stall_s = self.cluster.spec.stream_stall_s
        while True:
            now = time.monotonic()
            if now >= self.ctx.deadline_s:
                return io.DeadlinePassed(now)
            wait = self.ctx.deadline_s - now
            wake = self.lc.wake_s()
            if wake is not None:
                if now >= wake:
                    return io.Wake(now)
                wait = min(wait, wake - now)
            for leg, since in self.lc.watched():
                member = self.members[leg]
                if stalled(since, now, stall_s, member.answered_s):
                    why = f"{member.spec.name} sent nothing for {stall_s:g} s (stream_stall_s)"
                    return io.PeerGone(now, leg, why, self.healthy())
                wait = min(wait, since + stall_s - now + 0.05)
            try:
                src, ev = await asyncio.wait_for(self.streams.queue.get(), max(0.001, wait))
            except asyncio.TimeoutError:
                continue
            fact = self.to_fact(src, ev, time.monotonic())
            if fact is not None:
                return fact

    def to_fact(self, src: str, ev: dict, now: float):
        kind = ev.get("event")
        if src == "p":
            if kind == "prefilled":
                note_prefill(self.ctx, ev)
                self.uncount_p()
                return io.Prefilled(now, ev["token"], bool(ev.get("stop")))
            if kind == "transfer":
                note_transfer(self.ctx, ev, self.cluster)
                return io.TransferEnded(now, ev["target"], bool(ev.get("ok")), ev.get("error") or "",
                                        self.healthy())
            if kind in ("finished", "closed"):
                self.uncount_p()
                return io.PrefillEnded(now, ev.get("error") or "")
            return None
        leg = io.Leg(src)
        if kind == "token":
            return io.DecodeToken(now, leg, ev["i"], ev["t"], self.rld_view())
        if kind in ("finished", "closed"):
            reason = io.EndReason.CLOSED if kind == "closed" else _ENDS.get(ev.get("reason"), io.EndReason.CLOSED)
            return io.DecodeEnded(now, leg, reason, ev.get("error") or "", self.healthy())
        if leg is io.Leg.RLD:
            self.lc.seen_s[leg] = now       # RLD's own kv_ready / extended: alive, nothing to decide
            return None
        if kind == "kv_ready":
            md = self.members.get(io.Leg.MD)
            have = ev.get("have")
            return io.KvReady(now, self.rld_view(), ev.get("payload_bytes"),
                              self.cluster._view(md) if md is not None else None,
                              have if isinstance(have, int) and have > 1 else None)
        if kind == "extended":
            return io.Extended(now, ev["upto"])
        return None

    def rld_view(self):
        m = self.members.get(io.Leg.RLD)
        return self.cluster._view(m) if m is not None else None

    def healthy(self):
        """Live RLD and MD instances, for a failover or a resend."""
        return tuple(self.cluster._view(m) for m in self.cluster.members.values()
                     if m.healthy and m.spec.role in (Role.RELAY, Role.MAIN))

    async def finish_warm(self) -> None:
        try:
            async with asyncio.timeout(self.cluster.spec.kv_deadline_s):
                while self.lc.warming:
                    src, ev = await self.streams.queue.get()
                    if src != "p":
                        continue
                    fact = self.to_fact(src, ev, time.monotonic())
                    if fact is not None:
                        # Notes the transfer and releases P's KV once the last one ended.
                        await self.apply(self.lc.handle(fact))
        except Exception as e:  # noqa: BLE001 - best effort: the request is already answered
            self.ctx.trace.event("warm_md_failed", error=repr(e))
        finally:
            self.streams.close_all()

    # -- commands -> calls ---------------------------------------------------------
    def emit_first(self, cmds: list) -> list:
        """Log the commands, emit their tokens now; the rest, in order."""
        rest = []
        for cmd in cmds:
            self.log.add(cmd)
            if isinstance(cmd, io.Emit):
                self.emit(cmd.token, cmd.source.value, cmd.held)
            elif isinstance(cmd, io.EmitRun):
                for tok in cmd.tokens:
                    self.emit(tok, cmd.source.value)
            else:
                rest.append(cmd)
        return rest

    async def apply(self, cmds: list, logged: bool = False) -> None:
        for cmd in cmds if not logged else ():
            self.log.add(cmd)
        for cmd in cmds:
            if isinstance(cmd, io.ExtendAhead):
                self.send_ahead(cmd)
            elif _laned(cmd):
                self.in_lane(cmd)
            else:
                await self.carry_out(cmd)

    def send_ahead(self, cmd: io.ExtendAhead) -> None:
        """RLD's tokens for MD ahead of its KV: one call to MD at a time, each
        with every token MD has not taken yet, off the fact loop (RLD's tokens
        come every few tens of ms, a call takes a WAN round trip). MD's answer
        says what it holds; once its KV has landed it takes no more, and its
        kv_ready says what it took (`KvReady.md_have`). Best effort: a token
        MD lacks is one it decodes itself and the router checks."""
        del self.ahead_ids[cmd.start - 1:]
        self.ahead_ids.extend(cmd.token_ids)
        if self.ahead_task is None or self.ahead_task.done():
            t = asyncio.get_running_loop().create_task(self.ahead_calls(self.cluster.members[cmd.instance_id]))
            self.ahead_task = t
            self.background.add(t)
            t.add_done_callback(self.background.discard)

    async def ahead_calls(self, md: Member) -> None:
        ctx = self.ctx
        while self.ahead_taken < 1 + len(self.ahead_ids) and self.lc.md_ready_s is None and self.lc.done is None:
            start = self.ahead_taken
            try:
                r = await self.client.post(md.http.url, "/internal/extend",
                                           {"request_id": ctx.request_id, "ahead": True, "start": start,
                                            "token_ids": self.ahead_ids[start - 1:]},
                                           timeout_s=min(10.0, ctx.remaining_s()))
            except Exception as e:  # noqa: BLE001 - best effort (above)
                ctx.trace.event("control_error", instance=md.spec.name, path="/internal/extend", error=repr(e))
                return
            have = r.get("have")
            if not isinstance(have, int) or have <= start:
                return          # landed, gone, or not waiting yet: the next token tries again
            self.ahead_taken = have

    def in_lane(self, cmd) -> None:
        """An extend, pause, resume or background abort goes out behind the calls
        already made to the same instance, without holding up the next fact: the instance
        answers it only between two engine steps (a whole step of MD's batch),
        and meanwhile RLD's tokens must keep reaching the user. A final batch's
        extend and RLD's pause thus go out together."""
        # the instance the call goes to: P for its release and its copies' cancels
        iid = (self.members[io.Leg.P].spec.name if isinstance(cmd, (io.ReleaseP, io.CancelTransfer))
               else cmd.instance_id)
        before = self.lanes.get(iid)

        async def go() -> None:
            if before is not None:
                await asyncio.wait({before})
            await self.carry_out(cmd)
        t = asyncio.get_running_loop().create_task(go())
        self.lanes[iid] = t
        self.background.add(t)
        t.add_done_callback(self.background.discard)

    async def carry_out(self, cmd) -> None:
        ctx, c, rid = self.ctx, self.cluster, self.ctx.request_id
        if isinstance(cmd, io.Emit):
            self.emit(cmd.token, cmd.source.value, cmd.held)
        elif isinstance(cmd, io.EmitRun):            # only for `DecodeTokens`, which we never send
            for tok in cmd.tokens:
                self.emit(tok, cmd.source.value)
        elif isinstance(cmd, io.Note):
            self.note(cmd)
        elif isinstance(cmd, io.OpenDecode):
            self.open_decode(cmd)
        elif isinstance(cmd, io.StartPrefill):
            self.start_prefill(cmd)
        elif isinstance(cmd, io.StartTransfer):
            m, p = c.members[cmd.instance_id], self.members[io.Leg.P]
            try:
                await self.client.post(p.http.url, "/internal/send", {"request_id": rid,
                                                                        "target": target(c, p, m, ctx)})
            except Exception as e:
                raise FlowError(f"P could not send the KV to {m.spec.name} ({self.lc.owner.value} "
                                f"takes the request over): {e}") from None
        elif isinstance(cmd, io.CancelTransfer):
            await self.post(self.members[io.Leg.P], "/internal/cancel",
                            {"request_id": rid, "target": cmd.instance_id, "reason": cmd.reason})
        elif isinstance(cmd, io.ExtendMd):
            # Timed on the trace: a handoff's stall is this call's trip across the
            # WAN, MD's step under way and its extend (`docs/DESIGN.md`).
            t0 = time.monotonic()
            await self.post(c.members[cmd.instance_id], "/internal/extend",
                            {"request_id": rid, "token_ids": list(cmd.token_ids), "final": cmd.final})
            ctx.trace.event("extend_sent", tokens=len(cmd.token_ids), final=cmd.final,
                            answered_s=round(time.monotonic() - t0, 4))
        elif isinstance(cmd, io.PauseRld):
            await self.post(c.members[cmd.instance_id], "/internal/extend",
                            {"request_id": rid, "token_ids": [], "final": False}
                            | ({} if cmd.at is None else {"hold_at": cmd.at}))
        elif isinstance(cmd, io.ResumeRld):
            await self.post(c.members[cmd.instance_id], "/internal/extend", {"request_id": rid, "token_ids": []})
        elif isinstance(cmd, io.Abort):
            # A background abort runs in its instance's lane (`in_lane`), bounded:
            # a stopped instance would hold the call until its timeout.
            await control(self.client, c.members[cmd.instance_id], "/internal/abort",
                          {"request_id": rid} | ({"keep_kv": True} if cmd.keep_kv else {}), ctx,
                          timeout_s=5.0 if cmd.background else 10.0)
        elif isinstance(cmd, io.CloseStream):
            self.streams.close(cmd.leg.value)
        elif isinstance(cmd, io.ReleaseP):
            t0 = time.monotonic()
            await release(self.client, self.members[io.Leg.P], ctx)
            ctx.trace.event("p_released", answered_s=round(time.monotonic() - t0, 4))
        elif isinstance(cmd, io.WanFailed):
            c.wan.observe_failure(time.monotonic())

    def open_decode(self, cmd: io.OpenDecode) -> None:
        ctx, m = self.ctx, self.cluster.members[cmd.instance_id]
        old = self.members.get(cmd.leg)
        if old is None or old.spec.name != m.spec.name:
            if old is not None:
                self.cluster.dispatched(old.spec.name, -1)
            self.cluster.dispatched(m.spec.name, +1)
        self.members[cmd.leg] = m
        ctx.trace.instances[cmd.leg.value] = m.spec.name
        self.streams.open(cmd.leg.value, m, "/internal/decode", decode_body(ctx, hold=cmd.hold), ctx.remaining_s())

    def start_prefill(self, cmd: io.StartPrefill) -> None:
        ctx, c, p = self.ctx, self.cluster, self.members[io.Leg.P]
        ctx.trace.instances["p"] = p.spec.name
        body = prefill_body(ctx, c, p, [])
        for t in cmd.targets:
            dest = target(c, p, c.members[t.instance_id], ctx, background=t.background, stream=t.streamed)
            body["targets"].append(dest | ({"warm_blocks": t.warm_blocks} if t.warm_blocks else {}))
        self.streams.open("p", p, "/internal/prefill", body, ctx.remaining_s())
        if self.p_counted is None:      # as the PD flows and the simulator count it
            self.p_counted = p.spec.name
            c.dispatched(p.spec.name, +1)

    def uncount_p(self) -> None:
        if self.p_counted is not None:
            self.cluster.dispatched(self.p_counted, -1)
            self.p_counted = None

    def emit(self, tok: int, source: str, held: bool = False) -> None:
        """The user's next token. The handoff's gap (`handoff_gap_s`) is the
        largest before MD's first token after RLD's and before each of RLD's
        tokens a paced handoff held back."""
        t = self.ctx.trace
        switch = source == "md" and t.token_sources[-1:] == ["rld"]
        if t.token_times_s and (held or switch):
            gap = time.time() - t.token_times_s[-1]
            t.handoff_gap_s = gap if t.handoff_gap_s is None else max(t.handoff_gap_s, gap)
        self.out.append(self.ctx.emit(tok, source))

    def note(self, cmd: io.Note) -> None:
        t = self.ctx.trace
        t.event(cmd.event, **cmd.fields)
        if cmd.event == "md_ready":
            t.handoff_mode = cmd.fields["mode"]
        elif cmd.event == "handoff_complete":
            t.handoff_s = self.lc.handoff_s
        elif cmd.event == "failover":
            t.pipeline = io.Outcome.FAILOVER.value

    async def post(self, m: Member, path: str, body: dict) -> None:
        await control(self.client, m, path, body, self.ctx)


async def pdd_flow(ctx: RequestContext, cluster: Cluster, client: InternalClient) -> AsyncIterator[int]:
    async for tok in PddRun(ctx, cluster, client).run():
        yield tok
