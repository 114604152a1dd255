"""MD racing RLD: the rules `RequestLifecycle` applies while MD decodes on
its own beside RLD and the user's stream is still RLD's (an overlap or a
paced handoff, and MD decoding on from RLD's tokens sent ahead of its KV).

    RLD's pace on this request (`rld_pace_s`), MD's (`md_pace_s`)
    overlap: MD's tokens at indices the user has are checked; those past it
      wait in `md_ahead`; the stream moves to MD when MD has the user's next
      index first (`_overlap_switch`; its first token past the user's waits
      for RLD's when that is due soon, `_rld_due_soon`); a disagreement
      leaves the request to RLD (`_overlap_diverged`); RLD pauses at the lag
      bound (`_overlap_lag_check`)
    paced: RLD's tokens queue (`queued`) and go out `pace_gap_s` apart
      (`_release`, at a `Wake`), the gap MD's pace plus its lag spread over
      what is left of `overlap_max_lag` tokens (`_pace_gap`)
"""

from __future__ import annotations

from pdd.policy.lifecycle_io import Abort, DecodeToken, Leg, PauseRld

# RLD's facts that its pace is read from (`RaceRules.rld_pace_s`): five gaps.
RLD_PACE_FACTS = 6


class RaceRules:
    """MD's tokens beside RLD's, a mixin over `RequestLifecycle`'s state."""

    # --- paces -------------------------------------------------------------------------
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

    def _md_pace_or_step(self) -> float | None:
        """MD's pace on this request, or its reported decode step before two
        of its own tokens came."""
        return self.md_pace_s() or (self.md_view.step_time_s if self.md_view is not None else None)

    def _start_race(self, now: float, overlap_from: int) -> None:
        """MD decodes on its own from `overlap_from` (an overlapping final
        batch is out, or MD took RLD's tokens ahead of its KV); RLD streams
        on, its tokens paced where the session is."""
        self.overlap_from = overlap_from
        self.rld_hold_at = None
        if self.session.paced:
            self.pace_gap_s = self._pace_gap(now)
            self._note("paced", gap_s=round(self.pace_gap_s, 4))

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
        md = self._md_pace_or_step()
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
        md = self._md_pace_or_step()
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
        self._let_md_go_keeping_kv()
        self._resume_paused_rld(now)

    def _let_md_go_keeping_kv(self) -> None:
        """MD's request ends off the user's path, its KV kept for its prefix
        cache (the next turn's)."""
        self.md_live = False
        self._close(Leg.MD)
        self._out.append(Abort(Leg.MD, self.md_id, keep_kv=True, background=True))

    def _end_overlap(self, now: float) -> None:
        """MD will not take the stream: nothing of its overlap is kept; RLD's
        tokens a paced handoff held back go out."""
        self.overlap_from, self.md_end, self.md_first_ahead, self.pace_from = None, None, None, None
        self.md_ahead.clear()
        self._flush_queued(now)
