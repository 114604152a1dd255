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
    overlap (MD decodes clearly faster than RLD), paced (MD about as fast):
      the final batch does not pause RLD; MD races it (`lifecycle_race.py`)
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
    def _open_session(self, md_runs_on: bool = False) -> None:
        """The handoff's mode from RLD's load now (`new_session`); an RLD never
        reported counts as idle."""
        rld = self.rld_view or InstanceView(self.rld_id or "rld", Role.RELAY, "", 0, 0, 1, 0, 0)
        self.session = new_session(self.req.request_id, len(self.tokens), rld, self.cfg, self.req.max_tokens,
                                   self.md_view, self.rld_pace_s(), md_runs_on=md_runs_on)

    def _new_session(self, now: float) -> None:
        self._open_session()
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
        self._open_session(md_runs_on=True)
        races = self.session.on_md_running(now, self.md_runs_from, len(self.tokens))
        chosen = self.session.chosen
        self._note("md_ready", eager_tokens=len(self.tokens), mode=chosen.value, ahead=self.md_runs_from)
        if not races:
            # RLD ends the request within `catchup_final_max_tokens`: MD's decode
            # stops, its KV kept for its prefix cache (the next turn's).
            self._note("md_dropped", reason="request ends on RLD within catchup_final_max_tokens")
            self._let_md_go_keeping_kv()
            return
        self.handoff_batches += 1       # what MD took ahead: the final batch, extended at the landing
        self._start_race(now, self.md_runs_from)
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
                    self._start_race(now, act.end)
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
