"""MD's side of a request's life and the handoff: the rules `RequestLifecycle`
applies once MD's copy of the prompt's KV has landed.

    RLD's tokens while MD's KV crosses -> ExtendAhead (`_send_ahead`); MD's
      kv_ready says it took some and decodes on -> an overlap (or paced)
      session whose final batch is extended already (`_race_from`)
    MD KvReady while RLD streams -> HandoffSession (`handoff.new_session`):
      ExtendMd batches of RLD's token ids; the final one pauses RLD at
      `stop_at` (held ahead at RLD's next token when armed, `_hold_ahead`)
    MD's token `stop_at` (or its normal end there) -> handoff complete: MD
      owns the stream, RLD is aborted off the user's path
    MD's own tokens, once it owns the stream: in order, each once
    overlap (MD decodes clearly faster than RLD): the final batch does not
      pause RLD; MD's tokens are checked against the user's and kept ahead
      (`md_ahead`); the stream moves to MD when MD has the next index first
      (`_overlap_switch`); a disagreement leaves the request to RLD
    paced (MD about as fast as RLD): as the overlap, but RLD's tokens queue
      (`queued`) and go out `pace_gap_s` apart (`_release`, at a `Wake` when
      none comes sooner) until MD has the user's next index first
    MD's stream ends -> finish, or a failure for `lifecycle_recovery.py`
"""

from __future__ import annotations

from pdd.policy.config import HandoffOverride
from pdd.policy.handoff import Complete, HandoffMode, HandoffState, SendBatch, new_session
from pdd.policy.lifecycle_io import (
    Abort, DecodeEnded, DecodeToken, EndReason, Extended, ExtendAhead, ExtendMd, FinishReason, KvReady, Leg,
    PauseRld, ResumeRld,
)
from pdd.policy.lifecycle_recovery import _Failed
from pdd.policy.pipeline import Pipeline
from pdd.policy.views import InstanceView, Role


# RLD's facts that its pace is read from (`HandoffRules.rld_pace_s`): five gaps.
RLD_PACE_FACTS = 6
# The handoff settings under which RLD's tokens go to MD ahead of its KV: those
# whose final batch may leave RLD streaming (forced one-shot and catch-up keep
# their batches, for comparison runs).
AHEAD_MODES = (HandoffOverride.AUTO, HandoffOverride.OVERLAP, HandoffOverride.PACED)


class HandoffRules:
    """MD's facts and the handoff, a mixin over `RequestLifecycle`'s state."""

    # --- MD ------------------------------------------------------------------------
    def _on_kv_ready(self, f: KvReady) -> None:
        if not self.md_live:
            return
        self.md_ready_s = f.now
        if f.md is not None:
            self.md_view = f.md
        self._note("kv_ready", instance=self.md_id, payload_bytes=f.payload_bytes)
        if f.md_have is not None:
            if f.md_have > max(self.ahead_upto, self.md_upto):
                raise _Failed(f"main decode took {f.md_have} tokens; {self.ahead_upto} were sent to it")
            self.md_runs_from = self.md_upto = f.md_have
            self.md_extend_s = f.now
        if self.takeover_pending:
            self._try_takeover(f.now)
        elif self.owner is Leg.RLD:
            if self.md_runs_from is not None:
                self._race_from(f.now)
            elif self.tokens:
                self._new_session(f.now)
            else:
                self.md_ready_pending = True

    def _on_extended(self, f: Extended) -> None:
        if not self.md_live or self.session is None:
            return
        batch = self.session.in_flight
        if batch is not None and not batch.final and f.upto == batch.end:
            self._do(f.now, self.session.on_batch_extended(f.now, batch.end, len(self.tokens)))

    def _on_md_token(self, f: DecodeToken) -> None:
        if not self.md_live:
            return
        if self.racing:
            self._on_md_token_overlapping(f)
            return
        if self.owner is Leg.RLD and self.stop_at is not None and f.index == self.stop_at:
            self.session.on_batch_extended(f.now, f.index, f.index)
            self._complete(f.now)
        if self.owner is Leg.MD:
            if self._already_out(f):
                return
            if f.index != len(self.tokens):
                raise _Failed(f"main-decode stream out of order: token {f.index}, expected {len(self.tokens)}")
            self._emit(f.token, Leg.MD)

    def _on_md_ended(self, f: DecodeEnded) -> None:
        if not self.md_live:
            return
        if self.racing and f.reason.normal:
            # MD made its last token (EOS or the bound) while overlapping: it
            # takes the stream if it has the next index, else RLD, making the
            # same tokens, ends the request itself.
            self.md_end = FinishReason(f.reason.value)
            self._overlap_switch(f.now)
            if self.done is None and len(self.tokens) not in self.md_ahead:
                # MD's last token is one the user has (checked): so is the
                # whole answer. RLD, paused or about to end the same way, goes.
                self._flush_queued(f.now)
                self.session.on_rld_finished(f.now, len(self.tokens))
                self.ended_on_rld = True
                if Leg.RLD in self.open_legs:
                    self._close(Leg.RLD)
                    self._out.append(Abort(Leg.RLD, self.rld_id))
                self._finish(self.md_end)
            return
        if (self.owner is Leg.RLD and f.reason.normal and self.stop_at is not None
                and len(self.tokens) >= self.stop_at):
            # The final batch reached the end of the output: MD has nothing to add.
            self.session.on_batch_extended(f.now, self.stop_at, self.stop_at)
            self._complete(f.now)
            self._finish(FinishReason(f.reason.value))
            return
        if self.owner is not Leg.MD:
            self._md_failed(f.now, f.error or "main-decode stream ended", f.healthy)
            return
        if self.rld_lost is not None and not f.reason.normal:
            raise _Failed(f"main decode on {self.md_id} failed ({f.error or f.reason.value}) "
                          f"after relay decode {self.rld_id} was lost ({self.rld_lost})")
        if f.reason is EndReason.ERROR and not self._decoder_tokens() and self._failover(f.now, f.error, f.healthy):
            return
        if not f.reason.normal:
            raise _Failed(f.error or f"instance stream ended early ({f.reason.value})")
        self._finish(FinishReason(f.reason.value))

    # --- handoff ---------------------------------------------------------------------
    def _new_session(self, now: float) -> None:
        """The handoff's mode from RLD's load now (`new_session`); an RLD never
        reported counts as idle."""
        rld = self.rld_view or InstanceView(self.rld_id or "rld", Role.RELAY, "", 0, 0, 1, 0, 0)
        self.session = new_session(self.req.request_id, len(self.tokens), rld, self.cfg, self.req.max_tokens,
                                   self.md_view, self.rld_pace_s())
        self._note("md_ready", eager_tokens=len(self.tokens), mode=self.session.mode.value)
        # tokens[0] is P's: RLD decodes from the second one on.
        self._do(now, self.session.on_md_ready(now, len(self.tokens), rld_decoding=len(self.tokens) > 1))

    def _ahead_on(self) -> bool:
        """RLD streams and MD's KV is still on its way, MD's decode open and
        held for the handoff: RLD's tokens may go to MD ahead of the KV."""
        return (self.cfg.extend_ahead and self.cfg.handoff_mode in AHEAD_MODES
                and self.d.pipeline is Pipeline.RELAY and self.md_live and self.md_ready_s is None
                and Leg.MD in self.open_legs and self.owner is Leg.RLD and self.session is None
                and not self.takeover_pending and self.stop_at is None)

    def _send_ahead(self) -> None:
        """The user's tokens past P's first that MD has not been sent go to it
        now (`PolicyConfig.extend_ahead`). MD takes what reached it before its
        KV landed and races RLD from there at once (`_race_from`)."""
        if self._ahead_on() and len(self.tokens) > self.ahead_upto:
            self._out.append(ExtendAhead(self.md_id, self.ahead_upto, tuple(self.tokens[self.ahead_upto:])))
            self.ahead_upto = len(self.tokens)

    def _race_from(self, now: float) -> None:
        """MD's KV landed with RLD's first `md_runs_from` tokens, which it
        computed with the prompt's tail and decodes on from: the handoff is
        an overlap whose final batch has been extended (paced where MD is not
        clearly faster than RLD, as `choose_handoff_mode` has it). Where the
        mode would have been one-shot (a busy RLD wants its slot back), RLD
        pauses now and MD's tokens catch the user's stream up."""
        rld = self.rld_view or InstanceView(self.rld_id or "rld", Role.RELAY, "", 0, 0, 1, 0, 0)
        self.session = new_session(self.req.request_id, len(self.tokens), rld, self.cfg, self.req.max_tokens,
                                   self.md_view, self.rld_pace_s(), md_runs_on=True)
        races = self.session.on_md_running(now, self.md_runs_from, len(self.tokens))
        chosen = self.session.chosen
        self._note("md_ready", eager_tokens=len(self.tokens), mode=chosen.value, ahead=self.md_runs_from)
        if not races:
            # RLD ends the request within `catchup_final_max_tokens`: MD's decode
            # stops, its KV kept for its prefix cache (the next turn's).
            self.md_live = False
            self._note("md_dropped", reason="request ends on RLD within catchup_final_max_tokens")
            self._close(Leg.MD)
            self._out.append(Abort(Leg.MD, self.md_id, keep_kv=True, background=True))
            return
        self.overlap_from = self.md_runs_from
        self.rld_hold_at = None
        self.handoff_batches += 1       # what MD took ahead: the final batch, extended at the landing
        if self.session.paced:
            self.pace_gap_s = self._pace_gap(now)
            self._note("paced", gap_s=round(self.pace_gap_s, 4))
        if chosen is HandoffMode.ONE_SHOT and self.rld_id is not None:
            self.stop_at = self.rld_made
            self._note("overlap_pause", at=self.stop_at)
            self._out.append(PauseRld(self.rld_id))

    def _do(self, now: float, act: SendBatch | Complete | None) -> None:
        while isinstance(act, SendBatch):
            self.handoff_batches += 1
            toks = self.tokens[max(act.start, 1): act.end]     # MD already holds token 0 (from P)
            self.md_upto = max(self.md_upto, act.end)
            if toks or act.final:
                self.md_extend_s = now
                self._out.append(ExtendMd(self.md_id, tuple(toks), act.final))
                if act.final and self.session.overlaps:
                    self.overlap_from = act.end      # MD's first token of its own
                    self.rld_hold_at = None
                    if self.session.paced:
                        self.pace_gap_s = self._pace_gap(now)
                        self._note("paced", gap_s=round(self.pace_gap_s, 4))
                    return
                if act.final:
                    # RLD's tokens past stop_at are held back from here on, so
                    # the pause need not precede MD's extend: a driver may send
                    # both at once (each waits for its instance's step under way).
                    self.stop_at = act.end
                    if self.rld_hold_at is None:
                        self._out.append(PauseRld(self.rld_id))
                    # else RLD holds already: its hold went ahead of any pause
                    # sent now (same lane) and stops it at least as early.
                    self.rld_hold_at = None
                return
            act = self.session.on_batch_extended(now, act.end, len(self.tokens))
        if isinstance(act, Complete):
            self._complete(now)
        self._hold_ahead()

    @property
    def rld_made(self) -> int:
        """The user's tokens plus RLD's held back by a paced handoff."""
        return len(self.tokens) + len(self.queued)

    def _note_rld_pace(self, now: float) -> None:
        """When RLD's tokens reached the router (the last fact's last one)."""
        self.rld_seen.append((now, self.rld_made))
        del self.rld_seen[:-RLD_PACE_FACTS]

    def rld_pace_s(self) -> float | None:
        """RLD's time per token over this request's last `RLD_PACE_FACTS`
        facts, the longest interval between two of them left out (when there
        are three or more); None before two facts with tokens between them.
        The overlap commits for several tokens, so one slow interval (P's
        chunk ran beside RLD's step) must not read as a slow RLD: in
        `wan-bound-58-96` a mean with one 123 ms gap among 35-65 ms ones chose
        an overlap that MD never caught up with (paused at the lag bound,
        3.3x). Time over tokens, not a median of per-fact gaps: facts that
        carry several tokens after a stall would bias a median upwards."""
        spans = [(t1 - t0, n1 - n0) for (t0, n0), (t1, n1) in zip(self.rld_seen, self.rld_seen[1:])
                 if n1 > n0 and t1 > t0]
        if len(spans) >= 3:
            spans.remove(max(spans))
        tokens = sum(n for _, n in spans)
        return sum(t for t, _ in spans) / tokens if tokens else None

    # --- paced -------------------------------------------------------------------------
    def _pace_gap(self, now: float) -> float:
        """The least gap between the user's tokens while MD catches up: MD's
        pace (`md_pace_s`, its time per token on this request once two of
        its own tokens came; its reported decode step before) plus what MD
        lags behind the user's stream spread over what is left of
        `overlap_max_lag` of the user's tokens from the first one paced (so
        that MD is level by then: a stretch of the lag over a fixed count
        would shrink with it and never close it), at most
        `handoff_pace_ratio` of MD's pace. MD's lag is when its token
        for the user's next index should reach the router (after its last
        one, at its pace; before its first, its landing's or extend's step,
        taken as two of its steps) less when that token would go out
        unstretched (the user's last token plus MD's pace). Recomputed at
        every token of MD's, so the stretch shrinks as MD closes in.

        Beside RLD on one core MD runs at RLD's pace, and a stretch of its
        mean step alone would never let it catch up; a stretch of RLD's
        faster gap neither, for an MD slower than RLD (`ab-s34-float`,
        s0008-t00: RLD paused at the lag bound and the user waited out MD's
        whole lag at once, 0.41 s, 4.4x the median gap). Until session 35 the
        stretch was always the ratio (1.5x MD's pace): with MD's batch at
        0.10 s a token, the user's tokens went out 0.15 s apart, 2.2-2.4x the
        run's median gap, where MD lagged a token or two (`ab-s35-ahead`,
        s0008-t00). While MD's pace is unknown (no token of its own, no step
        reported) nothing is held back (0): a stretch of RLD's pace instead
        held a slow RLD's tokens (0.24 s beside P) back to 0.36 s for an MD
        that turned out to make its tokens at 0.065 s (the simulator's first
        relay of a run)."""
        md = self.md_pace_s() or (self.md_view.step_time_s if self.md_view is not None else None)
        if not md or md <= 0:
            return 0.0
        nxt = len(self.tokens)
        if self.md_seen:
            t_last, last = self.md_seen[-1]
            due = t_last + (nxt - last) * md
        else:
            due = now + 2 * md + (nxt - self.md_upto) * md
        lag = due - ((self.out_s if self.out_s is not None else now) + md)
        if self.pace_from is None:
            self.pace_from = nxt
        left = max(1, self.cfg.overlap_max_lag - (nxt - self.pace_from))
        # At least a quarter of the ratio's stretch: MD level with the user's
        # stream but a phase behind it (its token due as the user's goes out)
        # gains that much a token, not nothing.
        least = (self.cfg.handoff_pace_ratio - 1) * md / 4
        return min(md + max(least, lag / left), self.cfg.handoff_pace_ratio * md)

    def md_pace_s(self) -> float | None:
        """MD's time per token over its own last tokens while it races RLD."""
        if len(self.md_seen) < 2:
            return None
        (t0, i0), (t1, i1) = self.md_seen[0], self.md_seen[-1]
        return (t1 - t0) / (i1 - i0) if i1 > i0 and t1 > t0 else None

    def _on_rld_token_paced(self, f: DecodeToken, last: bool) -> None:
        """Paced: RLD's token waits its turn; RLD holds once far enough ahead."""
        self.queued.append((f.token, f.now))
        if last:
            self._note_rld_pace(f.now)
        self._release(f.now)
        if last:
            self._overlap_lag_check()

    def _release(self, now: float) -> None:
        """Paced: RLD's oldest held-back token goes out once `pace_gap_s` has
        passed since the user's last token (`wake_s` asks for the time)."""
        while self.queued and self.done is None and self.pace_gap_s is not None:
            if self.out_s is not None and now < self.out_s + self.pace_gap_s - 1e-9:
                return
            tok, came = self.queued.pop(0)
            self._emit(tok, Leg.RLD, held=now > came)
            self.out_s = now
            self._overlap_after_rld_token(now)

    def _flush_queued(self, now: float) -> None:
        """No more pacing (RLD ends the request, MD will not take it, RLD is
        lost): RLD's held-back tokens go out at once, in order."""
        self.pace_gap_s = None
        while self.queued and self.done is None:
            tok, came = self.queued.pop(0)
            self._emit(tok, Leg.RLD, held=now > came)
        self.queued.clear()
        self.out_s = now

    # --- overlap -----------------------------------------------------------------------
    def _on_md_token_overlapping(self, f: DecodeToken) -> None:
        """MD decodes beside RLD: a token the user has must agree; one ahead
        waits. A paced handoff's gap follows MD's pace as measured."""
        self.md_seen.append((f.now, f.index))
        del self.md_seen[:-RLD_PACE_FACTS]
        if self.pace_gap_s is not None:
            self.pace_gap_s = self._pace_gap(f.now)
        if f.index < len(self.tokens):
            if self.tokens[f.index] != f.token:
                self._overlap_diverged(f.now, f.index)
            return
        self.md_ahead[f.index] = f.token
        if self.md_first_ahead is None:
            self.md_first_ahead = f.index
        self._overlap_switch(f.now)

    def _overlap_after_rld_token(self, now: float) -> None:
        """RLD's token went to the user: MD's copy of it must agree; then MD
        may take the next index, or RLD pauses if MD lags too far."""
        i = len(self.tokens) - 1
        if i in self.md_ahead and self.md_ahead.pop(i) != self.tokens[i]:
            self._overlap_diverged(now, i)
            return
        self._overlap_switch(now)
        if self.pace_gap_s is None:
            self._overlap_lag_check()

    def _overlap_lag_check(self) -> None:
        """RLD `overlap_max_lag` tokens past the final batch (paced: twice
        that, as MD gains only part of a step a token) and MD still behind:
        RLD holds, MD's own tokens catch up."""
        bound = self.cfg.overlap_max_lag * (2 if self.pace_gap_s is not None else 1)
        if self.racing and self.stop_at is None and self.done is None and self.rld_made - self.overlap_from >= bound:
            self.stop_at = self.rld_made
            self._note("overlap_pause", at=self.stop_at)
            self._out.append(PauseRld(self.rld_id))

    def _overlap_switch(self, now: float, force: bool = False) -> None:
        """MD has the user's next token: it owns the stream from here. MD's
        first token ahead of the user's stream (`md_first_ahead`: its first
        of its own after a final batch, or a later one where RLD made those
        before MD, as after tokens sent ahead) waits for RLD's of the same
        index (RLD's token is due within its gap; MD's next one then follows
        within MD's: the switch lands just after one of RLD's tokens, where
        switching at once lands anywhere in RLD's gap), unless
        MD is `overlap_max_ahead` tokens ahead, RLD is paused or gone, MD has
        ended, or RLD has not decoded a token yet: only P's first is out (from
        P, or passed on by RLD), and RLD's first step, behind its import and
        beside P's prefill on a shared core, has no gap to be due within
        (`results/wan-bound-63x`, s0007-t01: MD's tokens 1-7 waited 1.2 s for
        RLD's first, 16.5x the median gap)."""
        n = len(self.tokens)
        # (RLD's token n held back by pacing is here already: no reason to wait)
        waits = n not in self.md_ahead or (n == self.md_first_ahead and self.stop_at is None
                                           and self.md_end is None and not self.queued and self.rld_made > 1
                                           and len(self.md_ahead) < self.cfg.overlap_max_ahead
                                           and self._rld_due_soon(now))
        if waits and not force:
            return
        self.session.on_overlap_switch(now, n)
        self.stop_at = n
        self.held.clear()
        self.queued.clear()           # RLD's copies of what MD now sends
        self.pace_gap_s = None
        self._complete(now)
        while len(self.tokens) in self.md_ahead:
            self._emit(self.md_ahead.pop(len(self.tokens)), Leg.MD)
        self.md_ahead.clear()
        if self.md_end is not None and self.done is None:
            self._finish(self.md_end)

    def _rld_due_soon(self, now: float) -> bool:
        """RLD's next token is due (its last one's time plus its pace on this
        request) before MD, at its own pace, would be `overlap_max_ahead`
        tokens ahead: waiting for it moves the switch to just after one of
        RLD's tokens at no cost to MD's next. A slower RLD's is not (beside
        P's cold prefill, 0.25-0.3 s a token against MD's 0.07): waiting
        would hold MD's tokens back to the bound and then release them a
        whole RLD gap after the user's last token, where switching at once
        leaves a gap of at most RLD's pace less (bound - 1) of MD's. Unknown
        paces wait, as before (the bound caps it)."""
        rld = self.rld_pace_s()
        md = self.md_pace_s() or (self.md_view.step_time_s if self.md_view is not None else None)
        if not rld or not md or not self.rld_seen:
            return True
        due = self.rld_seen[-1][0] + rld
        return due <= now + (self.cfg.overlap_max_ahead - len(self.md_ahead)) * md

    def _overlap_diverged(self, now: float, index: int) -> None:
        """MD's token at `index` differs from the one the user has (the two
        decoders ran it in different batches): MD's continuation is not the
        user's. MD's request ends with its KV kept for its prefix cache; RLD
        ends the request (resumed if it was told to pause)."""
        self._note("overlap_diverged", index=index)
        self.session.on_overlap_diverged(now)
        self._end_overlap(now)
        self.md_live = False
        self._close(Leg.MD)
        self._out.append(Abort(Leg.MD, self.md_id, keep_kv=True, background=True))
        self._resume_paused_rld(now)

    def _end_overlap(self, now: float) -> None:
        """MD will not take the stream: nothing of its overlap is kept; RLD's
        tokens a paced handoff held back go out."""
        self.overlap_from, self.md_end, self.md_first_ahead, self.pace_from = None, None, None, None
        self.md_ahead.clear()
        self._flush_queued(now)

    def _hold_ahead(self) -> None:
        """A final batch armed for RLD's next token: RLD holds right after
        making it. Without this RLD starts its next step before the pause
        reaches it, and MD's wait for its step under way and its extend run
        beside that step on a shared core: measured in `results/wb-s18a`, MD's
        step before the extend 0.19 s against ~0.1 s alone, a 0.22 s stall
        (2.6x the median gap)."""
        if (self.session is not None and self.session.state is HandoffState.ARMED
                and self.rld_hold_at is None and self.stop_at is None and self.rld_id is not None):
            self.rld_hold_at = len(self.tokens) + 1
            self._out.append(PauseRld(self.rld_id, at=self.rld_hold_at))

    def _release_hold(self) -> None:
        """RLD was told to hold for a final batch that will not go now (the
        session ended without one, MD failed, RLD finishes): RLD carries on."""
        if self.rld_hold_at is None or self.stop_at is not None:
            return
        if self.session is not None and self.session.state is HandoffState.ARMED and self.done is None:
            return
        self.rld_hold_at = None
        if self.done is None and self.owner is Leg.RLD and Leg.RLD in self.open_legs and self.rld_lost is None:
            self._out.append(ResumeRld(self.rld_id))

    def _complete(self, now: float) -> None:
        self.owner = Leg.MD
        self.handoff_s = now - self.md_ready_s if self.md_ready_s is not None else None
        self._note("handoff_complete", stop_at=self.stop_at, batches=self.handoff_batches)
        self._close(Leg.RLD)
        # Off the user's path: MD's tokens go out now, not after RLD's step
        # under way has ended and the abort has been answered.
        self._out.append(Abort(Leg.RLD, self.rld_id))
