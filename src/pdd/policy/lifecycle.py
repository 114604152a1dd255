"""One PDD request's life after routing, as a sans-I/O state machine.

`RequestLifecycle` takes facts (`lifecycle_io`: a stream event, a transfer's
end, a silence, the client leaving; each with `now`) and returns commands
(open a decode, start / cancel a transfer, extend MD, pause / resume / abort
RLD, release P, emit a token, finish). No clock, no I/O: the router's
`PddRun` and the simulator drive the same object. It owns, for one request:

    start -> StartPrefill (+ OpenDecode for RLD and/or MD)
    DIRECT with MD's KV due within first_token_max_stall_s (a relay: RLD's,
      over the local link): P's first token goes out at `Prefilled`; the
      decoder's copy of it (index 0) is skipped
    RLD streams eager tokens 0..k while MD's KV crosses the WAN
      every RLD token: the live filter (`cancel_wan`) may drop MD
    MD KvReady -> HandoffSession (`new_session`): ExtendMd* (token ids only)
      final batch: PauseRld at stop_at; RLD tokens past it are held back;
      MD's token `stop_at` completes the handoff (RLD aborted)
      a final batch armed for RLD's next token: PauseRld(at=next) first, so
      RLD makes that token and no more (no step of its own on the core MD's
      extend needs); disarmed without a final batch -> ResumeRld
      overlap (MD's step clearly shorter than RLD's): no pause; RLD streams
      until MD's tokens overtake its own, then MD owns the stream
      paced (MD about as fast, RLD has room): no pause; RLD's tokens are held
      back and let out `handoff_pace_ratio` MD steps apart (a `Wake` at
      `wake_s()`) until MD's tokens reach the user's stream
    RLD ends first -> MD parked (`keep_wan_copy`: its copy still lands) or dropped
    MD / WAN fails before it owns the stream -> RLD resumes (held tokens emitted)
    DIRECT fails before a token -> failover: P sends its KV to an RLD (`pick_spare`),
      after its prefill when the copy failed before P's first token
    RLD gone -> `on_rld_lost`: MD takes over by a final extend of what the
      user has (P re-sends the KV first when MD had no copy), or fail
    the user's stream: every token index exactly once, in order (Emit)

MD's side and the handoff are in `lifecycle_handoff.py`, MD racing RLD
(overlap, paced) in `lifecycle_race.py`, failures
(failover, RLD / MD / WAN lost) in `lifecycle_recovery.py`, the facts and
commands in `lifecycle_io.py`. Tested in process, event
orders included (tests/test_policy_lifecycle*.py).
"""

from __future__ import annotations

from pdd.policy.config import PolicyConfig
from pdd.policy.copies_ahead import DispatchedCopies
from pdd.policy.filter import RelayBudgets
from pdd.policy.handoff import HandoffSession, HandoffState
from pdd.policy.lifecycle_io import (
    Abort, ClientGone, CloseStream, Command, DeadlinePassed, DecodeEnded, DecodeToken, DecodeTokens, Emit,
    EmitRun, EndReason, Extended, Fact, Finish, FinishReason, KvReady, Leg, Note, OpenDecode, Outcome,
    PeerGone, Prefilled, PrefillEnded, ReleaseP, StartPrefill, StartTransfer, Transfer, TransferEnded, Wake,
    WanFailed,
)
from pdd.policy.lifecycle_handoff import HandoffRules
from pdd.policy.lifecycle_race import RaceRules
from pdd.policy.lifecycle_recovery import RecoveryRules, _Failed, pick_spare
from pdd.policy.pipeline import (
    Pipeline, PipelineDecision, cancel_wan, copy_yields_line, keep_wan_copy, note_decision,
)
from pdd.policy.views import InstanceView, RequestFacts

__all__ = ["RequestLifecycle", "pick_spare", "remaining_wan_s"]


def remaining_wan_s(d: PipelineDecision, wan_elapsed_s: float) -> float:
    """Routing's WAN estimate less the time the copy has had."""
    return max(0.0, d.wait_s - max(wan_elapsed_s, 0.0))


class RequestLifecycle(HandoffRules, RaceRules, RecoveryRules):
    def __init__(self, req: RequestFacts, decision: PipelineDecision, cfg: PolicyConfig,
                 budgets: RelayBudgets | None = None, warm_blocks: int = 0,
                 copies: DispatchedCopies | None = None) -> None:
        """`copies`: the WAN copies routed and not yet in P's report, shared by
        the requests of one router (the request's own copy counts there from
        `start` until P reports it or it ends)."""
        self.req, self.d, self.cfg, self.budgets = req, decision, cfg, budgets
        self.copies = copies
        # The decision counts in the relay budgets from now on: as predicted
        # while the request runs, as it went once it has ended.
        self.budget = note_decision(budgets, decision, req) if budgets is not None else None
        self.rld_emitted = 0                       # the user's tokens RLD produced
        direct = decision.pipeline is Pipeline.DIRECT
        self.p_id = decision.p_id
        self.rld_id = decision.rld_id if decision.rld_id and not direct else None
        self.md_id = decision.md_id if decision.md_id and decision.start_wan else None
        self.warm = (decision.md_id, warm_blocks) if warm_blocks and decision.md_id else None
        # The MD whose incoming copy still lands after the user's answer.
        self.landing_after: str | None = self.warm[0] if self.warm else None
        self.owner = Leg.MD if direct else Leg.RLD
        self.outcome = Outcome.of(decision)
        self.tokens: list[int] = []                # the user's stream
        self.p_first_out = False                   # tokens[0] went out from P, not a decoder
        self.session: HandoffSession | None = None
        self.stop_at: int | None = None
        self.held: dict[int, int] = {}             # RLD tokens past stop_at
        self.rld_hold_at: int | None = None        # RLD told to hold once it has made this many
        self.md_ready_pending = False
        self.md_live = False
        self.md_ready_s: float | None = None
        self.transfers: dict[str, bool | None] = {}    # receiver -> ok (None: in flight)
        self.wan_started_s: float | None = None
        self.first_token: int | None = None
        self.md_upto = 1                           # tokens MD holds: P's first, then extended
        self.ahead_upto = 1                        # the user's tokens sent to MD ahead of its KV
        self.md_runs_from: int | None = None       # MD decodes on from the tokens it took ahead
        self.seen_s: dict[Leg, float] = {}         # last event per stream
        self.rld_kv_s: float | None = None         # RLD's KV landed: from then on it streams
        self.md_extend_s: float | None = None
        self.open_legs: set[Leg] = set()
        self.lost: set[str] = set()
        self.cancelled: set[str] = set()           # copies we cancelled (P reports them failed)
        self.rld_lost: str | None = None
        self.rld_end: EndReason | None = None      # RLD finished while paused for the final batch
        self.takeover_pending = False
        self.failover_to: str | None = None        # RLD that gets P's KV once P has prefilled
        self.p_open = False
        self.p_released = False
        self.ended_on_rld = False
        self.handoff_batches = 0
        self.handoff_s: float | None = None
        self.rld_view: InstanceView | None = None     # RLD's load, as last reported
        self.md_view: InstanceView | None = None      # MD's, at its kv_ready
        self.overlap_from: int | None = None       # overlap handoff: MD's first token of its own
        self.md_ahead: dict[int, int] = {}         # overlap: MD's tokens past the user's
        self.md_first_ahead: int | None = None     # overlap: the index of MD's first token past the user's
        self.md_end: FinishReason | None = None    # overlap: MD ended before owning the stream
        self.rld_seen: list[tuple[float, int]] = []   # (when, the user's tokens) at RLD's last facts: its pace
        self.pace_gap_s: float | None = None       # paced handoff: the least gap between the user's tokens
        self.pace_from: int | None = None          # paced: the user's tokens when pacing began
        self.queued: list[tuple[int, float]] = []  # paced: RLD's (token, when it came) not yet out
        self.out_s: float | None = None            # when the user's last token went out
        self.md_seen: list[tuple[float, int]] = []    # (when, index) of MD's own tokens while racing RLD
        self.done: Finish | None = None
        self._out: list[Command] = []

    # --- driving -------------------------------------------------------------
    def start(self, now: float) -> list[Command]:
        targets: list[Transfer] = []
        if self.rld_id is not None:
            self._open(Leg.RLD, self.rld_id, hold=False)
            targets.append(Transfer(self.rld_id, streamed=self.cfg.stream_relay_copy))
        if self.md_id is not None:
            self._open(Leg.MD, self.md_id, hold=self.d.pipeline is Pipeline.RELAY)
            self.md_live = True
            targets.append(Transfer(self.md_id, background=copy_yields_line(self.d)))
        if self.warm is not None:
            targets.append(Transfer(*self.warm, background=copy_yields_line(self.d, warm=True)))
        if self.copies is not None:
            r = self.req
            if self.md_id is not None:
                self.copies.sent(r.request_id, self.d.missing_bytes, copy_yields_line(self.d))
            elif self.warm is not None:
                self.copies.sent(r.request_id, self.warm[1] * r.block_size * r.kv_bytes_per_token,
                                 copy_yields_line(self.d, warm=True))
        self.transfers = {t.instance_id: None for t in targets}
        self.p_open = True
        self._out.append(StartPrefill(self.p_id, tuple(targets)))
        return self._drain()

    def handle(self, fact: Fact) -> list[Command]:
        if self.done is not None:
            self._after_finish(fact)
            return self._drain()
        leg = Leg.MD if isinstance(fact, (KvReady, Extended)) else getattr(fact, "leg", None)
        if leg in (Leg.RLD, Leg.MD) and not isinstance(fact, PeerGone):
            self.seen_s[leg] = fact.now
        rld = getattr(fact, "rld", None)
        if rld is not None:
            self.rld_view = rld
        try:
            self._dispatch(fact)
            self._release_hold()
        except _Failed as e:
            self._finish(FinishReason.ERROR, str(e))
        return self._drain()

    def watched(self) -> list[tuple[Leg, float]]:
        """(stream, silent since) of the streams that should be producing now:
        RLD once its KV landed and while not paused; MD once its KV is ready
        and while it owns the stream or extends a batch."""
        out = []
        if (self.owner is Leg.RLD and self.stop_at is None and Leg.RLD in self.open_legs
                and self.rld_kv_s is not None):
            out.append((Leg.RLD, max(self.rld_kv_s, self.seen_s.get(Leg.RLD, 0.0))))
        md_busy = (self.owner is Leg.MD and not self.takeover_pending
                   or self.session is not None and self.session.in_flight is not None and self.md_end is None)
        if self.md_live and Leg.MD in self.open_legs and self.md_ready_s is not None and md_busy:
            out.append((Leg.MD, max(self.md_ready_s, self.seen_s.get(Leg.MD, 0.0), self.md_extend_s or 0.0)))
        return out

    @property
    def racing(self) -> bool:
        """MD decodes on its own beside RLD (an overlap or paced handoff's
        final batch is out) while the user's stream is still RLD's."""
        return self.owner is Leg.RLD and self.overlap_from is not None

    def wake_s(self) -> float | None:
        """When the lifecycle wants a `Wake` fact (a paced handoff's next
        held-back token is due), or None."""
        if self.done is None and self.queued and self.pace_gap_s is not None and self.out_s is not None:
            return self.out_s + self.pace_gap_s
        return None

    @property
    def warming(self) -> bool:
        """The answer is out but P keeps the prompt KV until a copy lands on MD."""
        return (self.landing_after is not None and self.transfers.get(self.landing_after) is None
                and self.p_open and self.first_token is not None)

    # --- dispatch --------------------------------------------------------------
    def _dispatch(self, f: Fact) -> None:
        if isinstance(f, Prefilled):
            self._on_prefilled(f)
        elif isinstance(f, TransferEnded):
            self._on_transfer(f)
        elif isinstance(f, PrefillEnded):
            self.p_open = False
            self._copy_over(None)
            if self.first_token is None:
                raise _Failed(f"prefill failed: {f.error or 'stream closed'}")
        elif isinstance(f, DecodeToken):
            self._on_rld_token(f) if f.leg is Leg.RLD else self._on_md_token(f)
        elif isinstance(f, DecodeTokens):
            self._on_tokens(f)
        elif isinstance(f, KvReady):
            self._on_kv_ready(f)
        elif isinstance(f, Extended):
            self._on_extended(f)
        elif isinstance(f, DecodeEnded):
            self._on_rld_ended(f.now, f.reason, f.error, f.healthy) if f.leg is Leg.RLD \
                else self._on_md_ended(f)
        elif isinstance(f, PeerGone):
            if f.leg is Leg.RLD:
                self._on_rld_ended(f.now, EndReason.ERROR, f.why, f.healthy)
            else:
                self._md_failed(f.now, f.why, f.healthy)
        elif isinstance(f, ClientGone):
            self._let_go()
            self._finish(FinishReason.CLIENT_GONE)
        elif isinstance(f, Wake):
            self._release(f.now)
        elif isinstance(f, DeadlinePassed):
            raise _Failed("request deadline exceeded")

    def _after_finish(self, f: Fact) -> None:
        """Only P matters once the user has the answer: a warm copy landing."""
        if isinstance(f, TransferEnded):
            self.transfers[f.instance_id] = f.ok
            if f.instance_id == self.md_id and not f.ok and f.instance_id not in self.cancelled:
                self._out.append(WanFailed())
            self._maybe_release_p()
        elif isinstance(f, PrefillEnded):
            self.p_open = False

    # --- P -----------------------------------------------------------------------
    def _on_prefilled(self, f: Prefilled) -> None:
        self.first_token = f.token
        self.wan_started_s = f.now
        self._try_takeover(f.now)
        rld, self.failover_to = self.failover_to, None
        if self.done is None and (f.stop or self.req.max_tokens == 1):
            self._emit(f.token, Leg.P)
            self._finish(FinishReason.STOP if f.stop else FinishReason.LENGTH)
            if rld is not None:                 # the answer is out: no copy for the failover
                del self.transfers[rld]
                self._maybe_release_p()
        elif rld is not None:
            self._out.append(StartTransfer(rld))
        if self.done is None and not self.tokens and self._p_first_due():
            self.p_first_out = True
            self._emit(f.token, Leg.P)
            self.out_s = f.now

    def _p_first_due(self) -> bool:
        """P's first token goes to the user at once: the decoder that goes on
        (MD for DIRECT, the routed RLD for a relay) is expected to hold the KV
        within `first_token_max_stall_s` of it, so the user waits that long
        for the second token instead of for the first. For a relay this is
        the local copy's time; RLD's own copy of the token is then skipped
        (`_already_out`) and every later token comes when it would have."""
        limit = self.cfg.first_token_max_stall_s
        if self.owner is Leg.MD:
            return (self.md_live and not self.takeover_pending and self.d.pipeline is Pipeline.DIRECT
                    and self.d.wait_s <= limit)
        return (self.rld_id is not None and self.rld_id == self.d.rld_id and self.rld_lost is None
                and self.d.rld_wait_s <= limit)

    def _decoder_tokens(self) -> int:
        """The user's tokens that came from a decoder (RLD or MD), not P."""
        return len(self.tokens) - self.p_first_out

    def _already_out(self, f: DecodeToken) -> bool:
        """A decoder's copy of a token the user already has: P's first one."""
        if f.index >= len(self.tokens):
            return False
        if self.tokens[f.index] != f.token:
            raise _Failed(f"{f.leg.value} stream disagrees at token {f.index}: "
                          f"{f.token} against {self.tokens[f.index]} already sent")
        return True

    def _on_transfer(self, f: TransferEnded) -> None:
        self.transfers[f.instance_id] = f.ok
        self._copy_over(f.instance_id)
        if f.instance_id == self.md_id and not f.ok:
            if f.instance_id not in self.cancelled:     # our own cancel says nothing of the line
                self._out.append(WanFailed())
            self._md_failed(f.now, f"WAN KV transfer failed: {f.error}", f.healthy)
        if f.instance_id == self.rld_id and self.owner is Leg.RLD:
            if f.ok:
                self.rld_kv_s = f.now
            elif self.stop_at is None and self.rld_lost is None:
                # RLD's decode would wait for KV that never comes.
                self._rld_gone(f.now, f"KV transfer to {self.rld_id} failed: {f.error}", f.healthy)
        if self.done is None or self.done.reason is not FinishReason.ERROR:
            self._maybe_release_p()

    def _copy_over(self, receiver: str | None) -> None:
        """The request's WAN copy ended (`receiver` None: P's stream is over,
        and every copy with it): it no longer waits ahead of others."""
        wan = self.md_id or (self.warm[0] if self.warm else None)
        if self.copies is not None and (receiver is None or receiver == wan):
            self.copies.ended(self.req.request_id)

    def _maybe_release_p(self) -> None:
        md_ok = self.md_id is None or self.transfers.get(self.md_id) or not self.md_live
        if (all(v is not None for v in self.transfers.values()) and (self.owner is Leg.RLD or md_ok)
                and not self.p_released):
            self.p_released = True
            self._out.append(ReleaseP(self.p_id))

    # --- RLD -------------------------------------------------------------------
    def _on_tokens(self, f: DecodeTokens) -> None:
        """Each token as its own `DecodeToken`; the live filter once, after the last."""
        if f.leg is Leg.MD and self.owner is Leg.MD and self.md_live and f.first_index == len(self.tokens):
            self.tokens.extend(f.tokens)      # MD owns the stream: its tokens, in order, go out
            self._out.append(EmitRun(f.tokens, Leg.MD, f.first_index))
            return
        last = len(f.tokens) - 1
        for k, tok in enumerate(f.tokens):
            if self.done is not None:
                return
            one = DecodeToken(f.now, f.leg, f.first_index + k, tok, f.rld)
            self._on_rld_token(one, last=k == last) if f.leg is Leg.RLD else self._on_md_token(one)

    def _on_rld_token(self, f: DecodeToken, last: bool = True) -> None:
        """One of RLD's tokens; `last`: no more of its batch follow (the live
        filter and an armed handoff act once, after the batch)."""
        if self.owner is not Leg.RLD:
            return
        if self.stop_at is not None and f.index >= self.stop_at:
            self.held[f.index] = f.token
            return
        if self._already_out(f):
            return
        if f.index != self.rld_made:
            raise _Failed(f"relay stream out of order: token {f.index}, expected {self.rld_made}")
        if self.pace_gap_s is not None:
            self._on_rld_token_paced(f, last)
            return
        self._emit(f.token, Leg.RLD)
        self.out_s = f.now
        if last:
            self._note_rld_pace(f.now)
        if self.overlap_from is not None:
            self._overlap_after_rld_token(f.now)
            return
        if self.md_ready_pending:
            self.md_ready_pending = False
            self._new_session(f.now)
        if last and self.session is not None and self.session.state is HandoffState.ARMED:
            self._do(f.now, self.session.on_rld_token(f.now, len(self.tokens)))
        if last:
            self._maybe_cancel_wan(f.now)
            self._send_ahead()

    def _on_rld_ended(self, now: float, reason: EndReason, error: str,
                      healthy: tuple[InstanceView, ...]) -> None:
        if self.owner is not Leg.RLD:
            return
        if not reason.normal:
            why = error or f"stream ended without finishing ({reason.value})"
            if self.stop_at is not None:
                # Paused for the final batch: MD is already taking over. Remember
                # it, in case MD fails too and would hand the stream back.
                self.rld_lost = why
                self._close(Leg.RLD)
            elif self.rld_lost is None:
                self._rld_gone(now, why, healthy)
            return
        if self.stop_at is not None:
            self.rld_end = reason       # done while paused: MD may yet hand the stream back
            return
        self._flush_queued(now)
        self.ended_on_rld = True
        if self.session is not None and not self.session.state.terminal:
            self.session.on_rld_finished(now, len(self.tokens))
        if self.md_live:
            if keep_wan_copy(self.d) and self.transfers.get(self.md_id) is None:
                self._park_md()
            else:
                self._drop_md("request finished on RLD first")
        self._finish(FinishReason(reason.value))

    def _maybe_cancel_wan(self, now: float) -> None:
        """The live filter: RLD will finish before the WAN copy lands. A copy
        that has landed (MD's `kv_ready` may still be on its way) is left be:
        cancelling it would save no WAN bytes, only drop MD's request; so is
        one whose request RLD has just answered in full (its end settles the
        copy, `keep_wan_copy`)."""
        rld = self.rld_view
        if not self.md_live or self.session is not None or self.wan_started_s is None or rld is None:
            return
        left = self.req.max_tokens - len(self.tokens)
        if self.transfers.get(self.md_id) is not None or left <= 0:
            return
        elapsed = now - self.wan_started_s
        if cancel_wan(self.d, self.budgets, now, elapsed, left, rld, self.cfg):
            if self.budget is not None:
                self.budget.relay_only()
            self.outcome = Outcome.RELAY_CANCELLED
            self._note("filter_cancel", tokens_left=left, remaining_wan_s=remaining_wan_s(self.d, elapsed))
            self._drop_md("abnormal traffic: RLD finishes first")

    # --- output ----------------------------------------------------------------------
    def _emit(self, token: int, source: Leg, held: bool = False) -> None:
        self.tokens.append(token)
        self.rld_emitted += source is Leg.RLD
        self._out.append(Emit(token, source, len(self.tokens) - 1, held))

    def _note(self, event: str, **fields) -> None:
        self._out.append(Note(event, fields))

    def _open(self, leg: Leg, instance_id: str, hold: bool) -> None:
        self.open_legs.add(leg)
        self._out.append(OpenDecode(leg, instance_id, hold))

    def _close(self, leg: Leg) -> None:
        self.open_legs.discard(leg)
        self._out.append(CloseStream(leg))

    def _let_go(self) -> None:
        """The user left: every decode still open is aborted, not only its stream
        closed. A decode paused for a final batch writes nothing, so its instance
        would never notice the closed stream and keep the request (MD's copy
        still lands, for its prefix cache)."""
        for leg, iid in ((Leg.RLD, self.rld_id), (Leg.MD, self.md_id)):
            if leg in self.open_legs and iid is not None:
                self._close(leg)
                self._out.append(Abort(leg, iid, keep_kv=leg is Leg.MD))

    def _finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.done = Finish(self.outcome, reason, error)
        if self.budget is not None:
            self.budget.ended(self.rld_emitted)
        # A copy still going once the user has the answer has long been in
        # P's report (it streams with the prefill); nothing may stay counted
        # for a request that will see no more facts.
        self._copy_over(None)
        self._out.append(self.done)

    def _drain(self) -> list[Command]:
        out, self._out = self._out, []
        return out
