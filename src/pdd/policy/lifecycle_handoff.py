"""MD's side of a request's life and the handoff: the rules `RequestLifecycle`
applies once MD's copy of the prompt's KV has landed.

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
    MD's stream ends -> finish, or a failure for `lifecycle_recovery.py`
"""

from __future__ import annotations

from pdd.policy.handoff import Complete, HandoffMode, HandoffState, SendBatch, new_session
from pdd.policy.lifecycle_io import (
    Abort, DecodeEnded, DecodeToken, EndReason, Extended, ExtendMd, FinishReason, KvReady, Leg, PauseRld,
    ResumeRld,
)
from pdd.policy.lifecycle_recovery import _Failed
from pdd.policy.views import InstanceView, Role


# RLD's facts that its pace is read from (`HandoffRules.rld_pace_s`): five gaps.
RLD_PACE_FACTS = 6


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
        if self.takeover_pending:
            self._try_takeover(f.now)
        elif self.owner is Leg.RLD:
            if self.tokens:
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
        if self.owner is Leg.RLD and self.overlap_from is not None:
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
        if self.owner is Leg.RLD and self.overlap_from is not None and f.reason.normal:
            # MD made its last token (EOS or the bound) while overlapping: it
            # takes the stream if it has the next index, else RLD, making the
            # same tokens, ends the request itself.
            self.md_end = FinishReason(f.reason.value)
            self._overlap_switch(f.now)
            if self.done is None and len(self.tokens) not in self.md_ahead:
                # MD's last token is one the user has (checked): so is the
                # whole answer. RLD, paused or about to end the same way, goes.
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

    def _do(self, now: float, act: SendBatch | Complete | None) -> None:
        while isinstance(act, SendBatch):
            self.handoff_batches += 1
            toks = self.tokens[max(act.start, 1): act.end]     # MD already holds token 0 (from P)
            self.md_upto = max(self.md_upto, act.end)
            if toks or act.final:
                self.md_extend_s = now
                self._out.append(ExtendMd(self.md_id, tuple(toks), act.final))
                if act.final and self.session.mode is HandoffMode.OVERLAP:
                    self.overlap_from = act.end      # MD's first token of its own
                    self.rld_hold_at = None
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

    def _note_rld_pace(self, now: float) -> None:
        """When RLD's tokens reached the router (the last fact's last one)."""
        self.rld_seen.append((now, len(self.tokens)))
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

    # --- overlap -----------------------------------------------------------------------
    def _on_md_token_overlapping(self, f: DecodeToken) -> None:
        """MD decodes beside RLD: a token the user has must agree; one ahead waits."""
        if f.index < len(self.tokens):
            if self.tokens[f.index] != f.token:
                self._overlap_diverged(f.now, f.index)
            return
        self.md_ahead[f.index] = f.token
        self._overlap_switch(f.now)

    def _overlap_after_rld_token(self, now: float) -> None:
        """RLD's token went to the user: MD's copy of it must agree; then MD
        may take the next index, or RLD pauses if MD lags too far."""
        i = len(self.tokens) - 1
        if i in self.md_ahead and self.md_ahead.pop(i) != self.tokens[i]:
            self._overlap_diverged(now, i)
            return
        self._overlap_switch(now)
        if (self.owner is Leg.RLD and self.overlap_from is not None and self.stop_at is None
                and len(self.tokens) - self.overlap_from >= self.cfg.overlap_max_lag):
            # MD has not overtaken RLD: RLD holds, MD's own tokens catch up.
            self.stop_at = len(self.tokens)
            self._note("overlap_pause", at=self.stop_at)
            self._out.append(PauseRld(self.rld_id))

    def _overlap_switch(self, now: float, force: bool = False) -> None:
        """MD has the user's next token: it owns the stream from here. MD's
        first token of its own waits for RLD's of the same index (RLD's token
        is due within its gap; MD's next one then follows within MD's), unless
        MD is `overlap_max_ahead` tokens ahead, RLD is paused or gone, or MD
        has ended."""
        n = len(self.tokens)
        waits = n not in self.md_ahead or (n == self.overlap_from and self.stop_at is None and self.md_end is None
                                           and len(self.md_ahead) < self.cfg.overlap_max_ahead)
        if waits and not force:
            return
        self.session.on_overlap_switch(now, n)
        self.stop_at = n
        self.held.clear()
        self._complete(now)
        while len(self.tokens) in self.md_ahead:
            self._emit(self.md_ahead.pop(len(self.tokens)), Leg.MD)
        self.md_ahead.clear()
        if self.md_end is not None and self.done is None:
            self._finish(self.md_end)

    def _overlap_diverged(self, now: float, index: int) -> None:
        """MD's token at `index` differs from the one the user has (the two
        decoders ran it in different batches): MD's continuation is not the
        user's. MD's request ends with its KV kept for its prefix cache; RLD
        ends the request (resumed if it was told to pause)."""
        self._note("overlap_diverged", index=index)
        self.session.on_overlap_diverged(now)
        self._end_overlap()
        self.md_live = False
        self._close(Leg.MD)
        self._out.append(Abort(Leg.MD, self.md_id, keep_kv=True, background=True))
        self._resume_paused_rld(now)

    def _end_overlap(self) -> None:
        """MD will not take the stream: nothing of its overlap is kept."""
        self.overlap_from, self.md_end = None, None
        self.md_ahead.clear()

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
