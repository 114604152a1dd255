"""One request through PDD: pipeline choice, eager tokens, extend handoff.

Lifecycle (the router is the only arbiter of which token the user sees):
    decide (policy.choose_pipeline) -> open streams (RLD, MD, P with KV targets)
    RLD streams eager tokens 0..k while MD's KV crosses the WAN
    MD kv_ready -> HandoffSession: SendBatch* (token ids only) -> MD extends
      final batch: RLD is paused at `stop_at`; tokens it made past that are
      held back; MD's first sampled token is index `stop_at` -> MD owns the
      stream (Complete), RLD's slot is freed
    failures: MD or WAN fails before Complete -> Abandon: RLD resumes and
      finishes (degraded, not lost). DIRECT (P->MD) whose transfer fails
      before a token -> failover: P sends the KV to an RLD, which decodes.
      RLD gone before the final batch (its stream ends abnormally, its KV
      never lands, or it is silent past [timeouts] stream_stall_s) ->
      policy.on_rld_lost: MD takes over by one final extend of the tokens
      the user already has (as in a handoff), once its KV is ready; P
      re-sends the KV to MD when MD had no copy; else a clear error.
    stall: a stream that should be producing (RLD with its KV, MD once it
      owns the stream or extends a batch) and says nothing for
      stream_stall_s counts as gone for this request.
    filter: RLD finishing first (or predicted to) -> the WAN transfer is
      cancelled (or never started) for the filter's class only; a skipped
      request's hot shared prefix still goes to MD, to warm its cache
      (policy.warm_after_skip). Any other relayed request that RLD finishes
      before MD holds its KV keeps its WAN copy landing (policy.keep_wan_copy):
      MD's request is dropped, its prefix cache still learns the context.
Every decision is taken by pdd.policy objects; this module only moves bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import AsyncIterator

from pdd.policy import (
    Abandon, Complete, HandoffSession, Pipeline, PipelineDecision, RequestFacts, RldLossAction, RldLossFacts,
    SendBatch, cancel_wan, choose_handoff_mode, choose_pipeline, convert_to_relay_only, keep_wan_copy,
    note_decision, on_rld_lost, plan_warm, stalled,
)
from pdd.server.cluster import Cluster, Member
from pdd.server.flows import (
    FlowError, RequestContext, Streams, control, decode_body, finish, note_prefill, note_transfer,
    prefill_body, release, target,
)
from pdd.server.wire import InternalClient


class PddRun:
    def __init__(self, ctx: RequestContext, cluster: Cluster, client: InternalClient):
        self.ctx, self.cluster, self.client = ctx, cluster, client
        self.streams = Streams(client)
        self.p: Member | None = None
        self.rld: Member | None = None
        self.md: Member | None = None
        self.owner = "md"
        self.session: HandoffSession | None = None
        self.stop_at: int | None = None
        self.held: dict[int, int] = {}          # RLD tokens past stop_at
        self.md_ready_pending = False
        self.md_live = False
        self.transfers: dict[str, bool | None] = {}   # target -> ok (None: in flight)
        self.md_ready_s: float | None = None
        self.wan_started_s: float | None = None
        self.decision: PipelineDecision | None = None
        self.first_token: int | None = None
        self.out: list[int] = []                 # tokens committed by the last event, to yield
        self.warm: tuple[Member, int] | None = None   # (MD, blocks) of a shared prefix to push
        # The MD whose incoming copy still lands after the user's answer (a warm
        # push, or a relayed request's copy kept for MD's prefix cache).
        self.landing_after: Member | None = None
        self.md_upto = 1                          # tokens MD holds: P's first, then what we extended
        self.last_seen: dict[str, float] = {}     # source -> last event (or since it should stream)
        self.lost: set[str] = set()               # instances that failed this request
        self.rld_lost: str | None = None          # why RLD is gone, once it is
        self.takeover_pending = False             # MD owns the stream once its KV is ready
        self.p_released = False
        self.background: set[asyncio.Task] = set()

    # -- setup ---------------------------------------------------------------
    async def decide(self) -> Pipeline:
        c, ctx = self.cluster, self.ctx
        facts = RequestFacts(ctx.request_id, len(ctx.prompt_ids), ctx.sampling.max_tokens,
                             ctx.kv_bytes_per_token, ctx.block_size)
        names = [m.spec.name for m in c.members.values()
                 if m.view.role.value in ("prefill", "main", "relay")]
        matched = await c.matched_tokens(names, ctx.prompt_ids)
        d = choose_pipeline(facts, c.view(matched, time.monotonic()), c.policy, c.relay_budgets)
        note_decision(c.relay_budgets, d, facts)
        self.decision = d
        ctx.trace.pipeline, ctx.trace.pipeline_reason = d.pipeline.value, d.reason
        ctx.trace.event("pipeline", pipeline=d.pipeline.value, reason=d.reason,
                        missing_bytes=d.missing_bytes, est_wan_s=d.est_wan_s)
        self.p = c.members[d.p_id]
        self.rld = c.members[d.rld_id] if d.rld_id and d.pipeline != Pipeline.DIRECT else None
        self.md = c.members[d.md_id] if d.md_id and d.start_wan else None
        self.owner = "md" if d.pipeline == Pipeline.DIRECT else "rld"
        self.plan_warm(d, matched)
        return d.pipeline

    def plan_warm(self, d, matched: dict[str, int]) -> None:
        """Count this request's shared prefix; a filtered one may still warm MD with it."""
        ctx, bs = self.ctx, self.ctx.block_size
        key = lambda n: hashlib.blake2b(repr(ctx.prompt_ids[:n]).encode(), digest_size=16).digest()
        tokens, reuses = plan_warm(d, matched, key, self.cluster.prefix_reuses, bs, self.cluster.policy)
        if tokens:
            self.warm = (self.cluster.members[d.md_id], tokens // bs)
            self.landing_after = self.warm[0]
            ctx.trace.event("warm_md", tokens=tokens, reuses=reuses)

    def start(self, pipeline: Pipeline) -> None:
        ctx, t = self.ctx, self.ctx.trace
        targets = []
        if self.rld is not None:
            self.streams.open("rld", self.rld, "/internal/decode", decode_body(ctx), ctx.remaining_s())
            self.cluster.dispatched(self.rld.spec.name, +1)
            targets.append(self.rld)
            t.instances["rld"] = self.rld.spec.name
        if self.md is not None:
            hold = pipeline == Pipeline.RELAY
            self.streams.open("md", self.md, "/internal/decode", decode_body(ctx, hold=hold), ctx.remaining_s())
            self.cluster.dispatched(self.md.spec.name, +1)
            self.md_live = True
            targets.append(self.md)
            t.instances["md"] = self.md.spec.name
        t.instances["p"] = self.p.spec.name
        self.transfers = {m.spec.name: None for m in targets}
        body = prefill_body(ctx, self.cluster, self.p, targets)
        if self.warm is not None:
            md, blocks = self.warm
            body["targets"].append(target(self.cluster, self.p, md, ctx) | {"warm_blocks": blocks})
            self.transfers[md.spec.name] = None
        self.streams.open("p", self.p, "/internal/prefill", body, ctx.remaining_s())

    # -- main loop -------------------------------------------------------------
    async def run(self) -> AsyncIterator[int]:
        pipeline = await self.decide()
        self.start(pipeline)
        try:
            while True:
                src, ev = await self.next_event()
                await self.on_event(src, ev)
                out, self.out = self.out, []
                for tok in out:
                    yield tok
                if self.ctx.finish_reason is not None:
                    return
        finally:
            self.ctx.trace.eager_tokens = self.ctx.trace.rld_tokens
            for m in (self.rld, self.md):
                if m is not None:
                    self.cluster.dispatched(m.spec.name, -1)
            if self.warming():
                # The user has the answer; P keeps the prompt KV (its stream
                # open) until the shared prefix has reached MD.
                self.streams.close("rld")
                asyncio.get_running_loop().create_task(self.finish_warm())
            else:
                self.streams.close_all()

    async def next_event(self) -> tuple[str, dict]:
        """The next stream event, or a synthetic `stalled` one for a stream
        that should be producing and has been silent for stream_stall_s."""
        stall_s = self.cluster.spec.stream_stall_s
        while True:
            now = time.monotonic()
            if now >= self.ctx.deadline_s:
                raise FlowError("request deadline exceeded")
            wait = self.ctx.deadline_s - now
            for src, since in self.watched():
                member = self.rld if src == "rld" else self.md
                if stalled(since, now, stall_s, member.answered_s):
                    name = member.spec.name
                    return src, {"event": "stalled", "reason": "error",
                                 "error": f"{name} sent nothing for {stall_s:g} s (stream_stall_s)"}
                wait = min(wait, since + stall_s - now + 0.05)
            try:
                src, ev = await asyncio.wait_for(self.streams.queue.get(), max(0.01, wait))
            except asyncio.TimeoutError:
                continue
            self.last_seen[src] = time.monotonic()
            return src, ev

    def watched(self) -> list[tuple[str, float]]:
        """(source, silent since) of the streams that should be producing now.
        RLD waits legitimately for its KV and while paused for a final batch;
        MD while its KV crosses the WAN and while held between batches."""
        out = []
        rld_kv_s = self.last_seen.get("rld_kv")
        if (self.owner == "rld" and self.stop_at is None and "rld" in self.streams.tasks
                and rld_kv_s is not None):
            out.append(("rld", max(rld_kv_s, self.last_seen.get("rld", 0.0))))
        md_busy = self.owner == "md" and not self.takeover_pending or (
            self.session is not None and self.session.in_flight is not None)
        if self.md_live and "md" in self.streams.tasks and self.md_ready_s is not None and md_busy:
            out.append(("md", max(self.md_ready_s, self.last_seen.get("md", 0.0),
                                  self.last_seen.get("md_extend", 0.0))))
        return out

    def warming(self) -> bool:
        return (self.landing_after is not None and self.transfers.get(self.landing_after.spec.name) is None
                and "p" in self.streams.tasks and self.first_token is not None)

    async def finish_warm(self) -> None:
        name = self.landing_after.spec.name
        try:
            async with asyncio.timeout(self.cluster.spec.kv_deadline_s):
                while self.transfers.get(name) is None:
                    src, ev = await self.streams.queue.get()
                    if src != "p":
                        continue
                    if ev.get("event") in ("finished", "closed"):
                        return
                    # Notes the transfer and releases P's KV once the last one ended.
                    await self.on_prefill_event(ev.get("event"), ev)
        except Exception as e:  # noqa: BLE001 - best effort: the request is already answered
            self.ctx.trace.event("warm_md_failed", error=repr(e))
        finally:
            self.streams.close_all()

    def emit(self, tok: int, source: str) -> None:
        if source == "md" and self.ctx.trace.rld_tokens and self.ctx.trace.handoff_gap_s is None:
            self.ctx.trace.handoff_gap_s = time.time() - self.ctx.trace.token_times_s[-1]
        self.out.append(self.ctx.emit(tok, source))

    async def on_event(self, src: str, ev: dict) -> None:
        kind = ev.get("event")
        if src == "p":
            await self.on_prefill_event(kind, ev)
            if kind == "prefilled" and (ev.get("stop") or self.ctx.sampling.max_tokens == 1):
                self.ctx.finish_reason = "stop" if ev.get("stop") else "length"
                self.emit(ev["token"], "p")
        elif src == "rld":
            await self.on_rld_event(kind, ev)
        else:
            await self.on_md_event(kind, ev)

    async def on_prefill_event(self, kind: str, ev: dict) -> None:
        if kind == "prefilled":
            note_prefill(self.ctx, ev)
            self.first_token = ev["token"]
            self.wan_started_s = time.monotonic()
            await self.try_takeover()
        elif kind == "transfer":
            note_transfer(self.ctx, ev, self.cluster)
            self.transfers[ev["target"]] = bool(ev.get("ok"))
            if self.md is not None and ev["target"] == self.md.spec.name and not ev.get("ok"):
                self.cluster.wan.observe_failure(time.monotonic())
                await self.md_failed(f"WAN KV transfer failed: {ev.get('error')}")
            if self.rld is not None and ev["target"] == self.rld.spec.name and self.owner == "rld":
                if ev.get("ok"):
                    self.last_seen["rld_kv"] = time.monotonic()    # from now on RLD should stream
                elif self.stop_at is None and self.rld_lost is None:
                    # RLD's decode would wait for KV that never comes.
                    await self.rld_gone(f"KV transfer to {self.rld.spec.name} failed: {ev.get('error')}")
            md_ok = self.md is None or self.transfers.get(self.md.spec.name) or not self.md_live
            if (all(v is not None for v in self.transfers.values()) and (self.owner == "rld" or md_ok)
                    and not self.p_released):
                self.p_released = True
                await release(self.client, self.p, self.ctx)
        elif kind in ("finished", "closed") and self.first_token is None:
            raise FlowError(f"prefill failed: {ev.get('error') or 'stream closed'}")

    # -- RLD ---------------------------------------------------------------------
    async def on_rld_event(self, kind: str, ev: dict) -> None:
        ctx = self.ctx
        if kind == "token" and self.owner == "rld":
            i = ev["i"]
            if self.stop_at is not None and i >= self.stop_at:
                self.held[i] = ev["t"]
                return
            if i != len(ctx.tokens):
                raise FlowError(f"relay stream out of order: token {i}, expected {len(ctx.tokens)}")
            self.emit(ev["t"], "rld")
            if self.md_ready_pending:
                self.md_ready_pending = False
                await self.do(self.new_session())
            await self.maybe_cancel_wan()
        elif kind in ("finished", "closed", "stalled") and self.owner == "rld" and not self.ended_normally(ev):
            why = ev.get("error") or f"stream ended without finishing ({kind})"
            if self.stop_at is not None:
                # Paused for the final batch: MD is already taking over. Remember
                # it, in case MD fails too and would hand the stream back.
                self.rld_lost = why
                self.streams.close("rld")
            elif self.rld_lost is None:
                await self.rld_gone(why)
        elif kind in ("finished", "closed") and self.owner == "rld" and self.stop_at is None:
            if self.session is not None and not self.session.state.terminal:
                self.session.on_rld_finished(time.monotonic(), len(ctx.tokens))
            if self.md_live:
                if keep_wan_copy(self.decision) and self.transfers.get(self.md.spec.name) is None:
                    await self.park_md()
                else:
                    await self.drop_md("request finished on RLD first")
            finish(ctx, ev)

    @staticmethod
    def ended_normally(ev: dict) -> bool:
        return ev.get("event") == "finished" and ev.get("reason") not in (None, "error", "abort")

    async def rld_gone(self, why: str) -> None:
        """RLD cannot finish this request: hand it to MD at the token the user
        is at (policy.on_rld_lost), or fail naming RLD."""
        from pdd.deploy.spec import Role

        ctx, name = self.ctx, self.rld.spec.name
        self.rld_lost = why
        self.lost.add(name)
        self.streams.close("rld")
        self.abort_later(self.rld)
        ctx.trace.event("rld_lost", instance=name, reason=why, tokens=len(ctx.tokens))
        if self.session is not None and not self.session.state.terminal:
            self.session.on_failed(time.monotonic(), f"RLD lost: {why}")
        self.md_ready_pending = False
        mds = [m for m in self.cluster.role(Role.MAIN) if m.healthy and m.spec.name not in self.lost]
        md_name = self.md.spec.name if self.md is not None else None
        p_task = self.streams.tasks.get("p")
        facts = RldLossFacts(
            md_live=self.md_live, md_available=bool(mds),
            p_holds_kv=p_task is not None and not p_task.done() and not self.p_released
            and self.first_token is not None,
            md_copy_settled=md_name is None or self.transfers.get(md_name, False) is not None)
        action = on_rld_lost(facts)
        ctx.trace.event("rld_lost_action", action=action.value)
        if action is RldLossAction.FAIL:
            raise FlowError(f"relay decode instance {name} was lost ({why}) and no main-decode instance "
                            f"holds or can receive this request's KV (md live: {facts.md_live}, "
                            f"P still holds the KV: {facts.p_holds_kv})")
        if action is RldLossAction.RESEND:
            await self.resend_to_md(min(mds, key=lambda m: m.view.num_running + m.view.num_waiting
                                        + m.in_flight))
        self.owner = "md"
        self.takeover_pending = True
        await self.try_takeover()

    async def resend_to_md(self, md: Member) -> None:
        """MD had no copy (relay-only, or the filter cancelled it): P sends it now."""
        ctx = self.ctx
        if self.md is None or self.md.spec.name != md.spec.name:
            if self.md is not None:
                self.cluster.dispatched(self.md.spec.name, -1)
            self.md = md
            self.cluster.dispatched(md.spec.name, +1)
        self.landing_after = None if self.landing_after is md else self.landing_after
        self.md_live, self.md_ready_s, self.md_upto = True, None, 1
        ctx.trace.instances["md"] = md.spec.name
        ctx.trace.event("rld_lost_resend", md=md.spec.name)
        self.streams.open("md", md, "/internal/decode", decode_body(ctx, hold=True), ctx.remaining_s())
        self.transfers[md.spec.name] = None
        try:
            await self.client.post(self.p.http.url, "/internal/send", {
                "request_id": ctx.request_id, "target": target(self.cluster, self.p, md, ctx)})
        except Exception as e:
            raise FlowError(f"relay decode instance {self.rld.spec.name} was lost ({self.rld_lost}) and "
                            f"P could not send the KV to {md.spec.name}: {e}") from None

    async def try_takeover(self) -> None:
        """MD continues at index len(ctx.tokens): one final extend of what the
        user has past P's first token, as the last batch of a handoff."""
        ctx = self.ctx
        if not self.takeover_pending or self.md_ready_s is None or not self.md_live:
            return
        if not ctx.tokens:
            if self.first_token is None:
                return
            self.emit(self.first_token, "p")     # MD was told to hold it back (hold=True)
        self.takeover_pending = False
        if len(ctx.tokens) >= ctx.sampling.max_tokens:
            ctx.finish_reason = "length"
            return
        toks = ctx.tokens[self.md_upto:]
        self.md_upto = len(ctx.tokens)
        self.last_seen["md_extend"] = time.monotonic()
        ctx.trace.event("md_takeover", at=len(ctx.tokens), extend_tokens=len(toks))
        await self.post(self.md, "/internal/extend", {"request_id": ctx.request_id, "token_ids": toks,
                                                      "final": True})

    def abort_later(self, m: Member) -> None:
        """Best effort, off the user's path: a stopped instance would hold the
        call until its timeout; a dead one refuses it."""
        async def go() -> None:
            await control(self.client, m, "/internal/abort", {"request_id": self.ctx.request_id}, self.ctx,
                          timeout_s=5.0)
        t = asyncio.get_running_loop().create_task(go())
        self.background.add(t)
        t.add_done_callback(self.background.discard)

    async def maybe_cancel_wan(self) -> None:
        """The live filter: RLD will finish before the WAN copy lands."""
        if not self.md_live or self.session is not None or self.wan_started_s is None:
            return
        c, now = self.cluster, time.monotonic()
        left = self.ctx.sampling.max_tokens - len(self.ctx.tokens)
        if cancel_wan(self.decision, c.relay_budgets, now, now - self.wan_started_s, left,
                      c._view(self.rld), c.policy):
            convert_to_relay_only(c.relay_budgets)
            self.ctx.trace.event("filter_cancel", tokens_left=left,
                                 remaining_wan_s=max(0.0, self.decision.est_wan_s - (now - self.wan_started_s)))
            await self.drop_md("abnormal traffic: RLD finishes first")

    async def drop_md(self, why: str) -> None:
        """Cancel the P->MD transfer and MD's request (the filter, or a failure)."""
        self.md_live = False
        self.ctx.trace.event("md_dropped", reason=why)
        name = self.md.spec.name
        if self.transfers.get(name) is None:
            await self.post(self.p, "/internal/cancel", {"request_id": self.ctx.request_id, "target": name,
                                                          "reason": why})
        self.streams.close("md")
        self.abort_later(self.md)     # a stalled MD must not hold up RLD's stream

    async def park_md(self) -> None:
        """RLD finished first: drop MD's request but let its KV copy land, so
        MD's prefix cache learns the context P holds (the next turn of the
        conversation then lacks only its new tokens on MD as on P)."""
        self.md_live = False
        self.landing_after = self.md
        self.ctx.trace.event("md_parked", reason="request finished on RLD first; its KV still lands on MD")
        self.streams.close("md")
        await self.post(self.md, "/internal/abort", {"request_id": self.ctx.request_id, "keep_kv": True})

    # -- MD ------------------------------------------------------------------------
    def new_session(self) -> SendBatch:
        ctx = self.ctx
        mode = choose_handoff_mode(len(ctx.tokens), self.cluster._view(self.rld), self.cluster.policy)
        self.session = HandoffSession(ctx.request_id, mode, self.cluster.policy)
        ctx.trace.handoff_mode = mode.value
        ctx.trace.event("md_ready", eager_tokens=len(ctx.tokens), mode=mode.value)
        return self.session.on_md_ready(time.monotonic(), len(ctx.tokens))

    async def on_md_event(self, kind: str, ev: dict) -> None:
        ctx = self.ctx
        if not self.md_live:
            return
        if kind == "kv_ready":
            self.md_ready_s = time.monotonic()
            ctx.trace.event("kv_ready", instance=self.md.spec.name, payload_bytes=ev.get("payload_bytes"))
            if self.takeover_pending:
                await self.try_takeover()
            elif self.owner == "rld":
                if ctx.tokens:
                    await self.do(self.new_session())
                else:
                    self.md_ready_pending = True
        elif kind == "extended" and self.session is not None:
            batch = self.session.in_flight
            if batch is not None and not batch.final and ev["upto"] == batch.end:
                await self.do(self.session.on_batch_extended(time.monotonic(), batch.end, len(ctx.tokens)))
        elif kind == "token":
            i = ev["i"]
            if self.owner == "rld" and self.stop_at is not None and i == self.stop_at:
                self.session.on_batch_extended(time.monotonic(), i, i)
                await self.complete()
            if self.owner == "md":
                if i != len(ctx.tokens):
                    raise FlowError(f"main-decode stream out of order: token {i}, expected {len(ctx.tokens)}")
                self.emit(ev["t"], "md")
        elif kind == "stalled":
            await self.md_failed(ev["error"])
        elif kind in ("finished", "closed"):
            if self.owner == "md":
                if self.rld_lost is not None and not self.ended_normally(ev):
                    raise FlowError(f"main decode on {self.md.spec.name} failed ({ev.get('error') or kind}) "
                                    f"after relay decode {self.rld.spec.name} was lost ({self.rld_lost})")
                if ev.get("reason") == "error" and not ctx.tokens and await self.failover(ev.get("error")):
                    return
                finish(ctx, ev)
            else:
                await self.md_failed(ev.get("error") or "main-decode stream ended")

    async def do(self, act: SendBatch | Complete | Abandon) -> None:
        rid = self.ctx.request_id
        while isinstance(act, SendBatch):
            self.ctx.trace.handoff_batches += 1
            toks = self.ctx.tokens[max(act.start, 1): act.end]     # MD already holds token 0 (from P)
            self.md_upto = max(self.md_upto, act.end)
            if toks or act.final:
                self.last_seen["md_extend"] = time.monotonic()
                calls = [self.post(self.md, "/internal/extend", {"request_id": rid, "token_ids": toks,
                                                                 "final": act.final})]
                if act.final:
                    # RLD's tokens past stop_at are held back from here on, so
                    # its pause need not come first: each call waits for its
                    # instance's step under way, and the two waits overlap.
                    self.stop_at = act.end
                    calls.append(self.post(self.rld, "/internal/extend",
                                           {"request_id": rid, "token_ids": [], "final": False}))
                await asyncio.gather(*calls)
                return
            act = self.session.on_batch_extended(time.monotonic(), act.end, len(self.ctx.tokens))
        if isinstance(act, Complete):
            await self.complete()

    async def complete(self) -> None:
        self.owner = "md"
        t = self.ctx.trace
        t.handoff_s = time.monotonic() - self.md_ready_s if self.md_ready_s else None
        t.event("handoff_complete", stop_at=self.stop_at, batches=t.handoff_batches)
        self.streams.close("rld")
        # Off the user's path: MD's first token goes out now, not after RLD's
        # step under way has ended and the abort has been answered.
        self.abort_later(self.rld)

    async def md_failed(self, why: str) -> None:
        """MD or the WAN failed before MD owned the stream: RLD carries on."""
        if not self.md_live:
            return
        self.lost.add(self.md.spec.name)
        if self.rld_lost is not None:
            raise FlowError(f"main decode on {self.md.spec.name} failed ({why}) after relay decode "
                            f"{self.rld.spec.name} was lost ({self.rld_lost})")
        if self.owner == "md":
            if not self.ctx.tokens and await self.failover(why):
                return
            raise FlowError(f"main decode failed: {why}")
        await self.drop_md(why)
        if self.session is not None and not self.session.state.terminal:
            self.session.on_failed(time.monotonic(), why)
        if self.stop_at is not None:       # RLD was paused for the final batch: resume it
            self.stop_at = None
            self.last_seen["rld"] = time.monotonic()
            await self.post(self.rld, "/internal/extend", {"request_id": self.ctx.request_id, "token_ids": []})
            for i in sorted(self.held):
                if i == len(self.ctx.tokens):
                    self.emit(self.held[i], "rld")
            self.held.clear()

    async def failover(self, why: str | None) -> bool:
        """DIRECT failed before any token: send P's KV to an RLD instead."""
        from pdd.deploy.spec import Role

        rlds = [m for m in self.cluster.role(Role.RELAY) if m.healthy and m.spec.name not in self.lost]
        if not rlds or self.first_token is None:
            return False
        self.md_live = False
        self.streams.close("md")
        self.rld = min(rlds, key=lambda m: m.view.num_running + m.view.num_waiting + m.in_flight)
        self.owner = "rld"
        self.rld_lost = None
        self.ctx.trace.pipeline = "direct_failover_relay"
        self.ctx.trace.event("failover", reason=why, rld=self.rld.spec.name)
        self.ctx.trace.instances["rld"] = self.rld.spec.name
        self.streams.open("rld", self.rld, "/internal/decode", decode_body(self.ctx), self.ctx.remaining_s())
        self.cluster.dispatched(self.rld.spec.name, +1)
        self.transfers[self.rld.spec.name] = None
        try:
            await self.client.post(self.p.http.url, "/internal/send", {
                "request_id": self.ctx.request_id, "target": target(self.cluster, self.p, self.rld, self.ctx)})
        except Exception as e:
            raise FlowError(f"main decode failed ({why}) and failover could not start: {e}") from None
        return True

    async def post(self, m: Member, path: str, body: dict) -> None:
        await control(self.client, m, path, body, self.ctx)


async def pdd_flow(ctx: RequestContext, cluster: Cluster, client: InternalClient) -> AsyncIterator[int]:
    async for tok in PddRun(ctx, cluster, client).run():
        yield tok
