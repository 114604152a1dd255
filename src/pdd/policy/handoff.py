"""Extend-decode handoff from RLD to MD, as a sans-I/O state machine.

RLD streams eager tokens while MD's copy of the prompt KV crosses the WAN.
When MD reports that KV ready, RLD hands over only the *token ids* it
generated; MD recomputes their KV in one extend pass and continues decoding.

Lifecycle of one `HandoffSession` (one per relayed request)::

    AWAITING_MD --on_md_ready--> EXTENDING --on_batch_extended--> EXTENDING ...
         |                |                         |
         |                +--(final batch)----------+--> FINAL_IN_FLIGHT
         |                                                   |
         |                                      on_batch_extended
         |                                                   v
         +--on_rld_finished--> ENDED_ON_RLD                 DONE
    (a final batch that would leave MD <= catchup_final_max_tokens of the
     output bound) --> RLD_FINISHES --on_rld_finished--> ENDED_ON_RLD
    (any live state) --on_failed--> FAILED
    OVERLAP / PACED: AWAITING_MD --on_md_ready--> FINAL_IN_FLIGHT (RLD not paused)
         --on_overlap_switch--> DONE | --on_overlap_diverged--> RLD_FINISHES
         | --on_rld_finished--> ENDED_ON_RLD
    (a paced catch-up's final batch leaves RLD streaming the same way)

Actions returned to the data plane:

* `SendBatch(start, end, final)`: send token ids [start, end) to MD for an
  extend. When `final`, RLD stops generating at `end` (it has produced
  exactly `end` tokens) and MD takes over the stream after its extend.
* `Complete(upto)`: MD has extended through `upto` and owns the stream; RLD
  frees the request's KV and slot.
* `Abandon(resume_at, reason)`: the handoff is off; RLD keeps (or resumes)
  decoding from `resume_at`, MD drops the request.

One-shot: a single final batch of all eager tokens at `on_md_ready`; RLD
stops decoding at once (shortest RLD occupancy, one bigger extend on MD).
With `handoff_on_rld_token`, a final batch is *armed* instead
(ARMED --on_rld_token--> FINAL_IN_FLIGHT): it goes out with RLD's next
token, so RLD pauses right after emitting one and the user's stall is MD's
extend, not also the time since RLD's last token.
Overlap (MD decodes clearly faster than RLD): one final batch of everything
at `on_md_ready`, and RLD is *not* paused: it keeps streaming while MD
extends and then decodes on its own. The lifecycle compares MD's tokens with
the user's and moves the stream to MD once MD's tokens overtake RLD's
(`on_overlap_switch`); RLD's tokens were the user's until then, so the
handoff adds no stall of its own (`lifecycle_race.py`).
Paced (MD not clearly faster, RLD has room; `handoff_pace_ratio` > 0): as
the overlap, one final batch that does not pause RLD, but MD, a round trip
and an extend behind RLD at about RLD's pace, would never overtake it: the
lifecycle holds RLD's tokens back and lets them out at least
`handoff_pace_ratio` of MD's step apart, so the user's stream falls behind
RLD's by a fraction of a step a token until MD's tokens reach it; then MD
owns the stream. The user's largest gap is that stretched one, not a stall
of a round trip and two of MD's steps.
Catch-up: a non-final batch of what RLD has so far while RLD keeps decoding;
then, after each extend, the tokens generated meanwhile, until the gap is at
most `catchup_final_max_tokens` (or `catchup_max_batches` non-final batches
were sent, so a slow MD cannot keep RLD busy forever); then a final batch,
paced as above when `handoff_pace_ratio` > 0 (else it pauses RLD: several
small stalls).

RLD keeps the request's KV until `Complete`, so a failed extend falls back
to RLD (`Abandon` with `resume_at` = what MD had been promised).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from pdd.policy.config import HandoffOverride, PolicyConfig
from pdd.policy.views import InstanceView


class HandoffMode(Enum):
    ONE_SHOT = "one_shot"
    CATCH_UP = "catch_up"
    OVERLAP = "overlap"
    PACED = "paced"


class HandoffState(Enum):
    AWAITING_MD = "awaiting_md"
    EXTENDING = "extending"              # a non-final batch is being extended on MD
    FINAL_IN_FLIGHT = "final_in_flight"  # RLD stopped; MD extends the last batch
    ARMED = "armed"                      # the final batch goes with RLD's next token
    DONE = "done"
    RLD_FINISHES = "rld_finishes"        # too few tokens left to hand over: RLD ends the request
    ENDED_ON_RLD = "ended_on_rld"        # RLD finished the request first
    FAILED = "failed"

    @property
    def terminal(self) -> bool:
        return self in (HandoffState.DONE, HandoffState.ENDED_ON_RLD, HandoffState.FAILED)


class HandoffError(RuntimeError):
    """An event that is illegal in the session's current state."""


@dataclass(frozen=True)
class SendBatch:
    start: int
    end: int
    final: bool

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Complete:
    upto: int


@dataclass(frozen=True)
class Abandon:
    resume_at: int
    reason: str


HandoffAction = SendBatch | Complete | Abandon


def md_overtakes(rld: InstanceView, md: InstanceView | None, cfg: PolicyConfig,
                 rld_pace_s: float | None = None) -> bool:
    """MD's decode step is at most `overlap_max_step_ratio` of RLD's, both
    measured: MD's tokens overtake RLD's within a few of RLD's after a final
    batch that does not pause RLD. With MD at half RLD's step, MD gains half
    an RLD step a token and makes up its round trip and extend (~1-1.5 RLD
    steps here) in 2-3 tokens; a slower MD would never catch up and RLD would
    decode the whole answer beside it. `rld_pace_s`: RLD's gap between this
    request's own last tokens, when known, rather than its instance's mean
    step: RLD beside P is 3-8x slower while P computes than once P is idle,
    and the mean lags (`wan-bound-57-96`: a mean that said "slow" while RLD
    made this request's tokens 35-44 ms apart, as fast as MD, sent two
    overlaps MD never caught up with)."""
    if md is None or cfg.overlap_max_step_ratio <= 0:
        return False
    t_rld, t_md = rld_pace_s or rld.step_time_s, md.step_time_s
    return bool(t_rld and t_md and t_rld > 0 and 0 < t_md <= cfg.overlap_max_step_ratio * t_rld)


def choose_handoff_mode(num_eager_tokens: int, rld: InstanceView, cfg: PolicyConfig,
                        md: InstanceView | None = None, rld_pace_s: float | None = None) -> HandoffMode:
    """Overlap where MD overtakes RLD (`md_overtakes`); else, while RLD has
    room, catch-up for many eager tokens and paced for few (one-shot with
    pacing off); one-shot for a busy RLD.

    A busy RLD wants its slot back now (one-shot); an idle one can afford to
    keep decoding so that the user sees no stall (catch-up, paced). Overlap
    and paced keep RLD decoding only until MD's tokens reach the user's (a
    few of RLD's steps).
    """
    if num_eager_tokens < 0:
        raise ValueError("num_eager_tokens must be >= 0")
    if cfg.handoff_mode is HandoffOverride.ONE_SHOT:
        return HandoffMode.ONE_SHOT
    if cfg.handoff_mode is HandoffOverride.CATCH_UP:
        return HandoffMode.CATCH_UP
    if cfg.handoff_mode is HandoffOverride.PACED:
        return HandoffMode.PACED if cfg.handoff_pace_ratio > 0 else HandoffMode.ONE_SHOT
    if cfg.handoff_mode is HandoffOverride.OVERLAP or md_overtakes(rld, md, cfg, rld_pace_s):
        return HandoffMode.OVERLAP
    has_room = rld.num_requests < cfg.rld_busy_fraction * rld.max_batch
    if num_eager_tokens > cfg.catchup_threshold_tokens and has_room:
        return HandoffMode.CATCH_UP
    if has_room and cfg.handoff_pace_ratio > 0:
        return HandoffMode.PACED
    return HandoffMode.ONE_SHOT


class HandoffSession:
    def __init__(self, request_id: str, mode: HandoffMode, cfg: PolicyConfig,
                 max_tokens: int | None = None, chosen: HandoffMode | None = None) -> None:
        """`max_tokens`: the request's output bound, when known: a final batch
        that would leave MD at most `catchup_final_max_tokens` of it is not sent
        (`RLD_FINISHES`). `chosen`: the mode `choose_handoff_mode` chose, where
        `mode` differs from it (MD running on from tokens taken ahead)."""
        self.request_id = request_id
        self.mode = mode
        self.chosen = chosen or mode
        self.cfg = cfg
        self.max_tokens = max_tokens
        self.state = HandoffState.AWAITING_MD
        self._batches: list[SendBatch] = []
        self._last_generated = 0
        self._armed_start = 0
        self.md_ready_s: float | None = None
        self.done_s: float | None = None

    # --- read-only facts --------------------------------------------------
    @property
    def overlaps(self) -> bool:
        """The final batch leaves RLD streaming: overlap, paced, and catch-up
        while pacing is on."""
        return (self.mode in (HandoffMode.OVERLAP, HandoffMode.PACED)
                or self.mode is HandoffMode.CATCH_UP and self.cfg.handoff_pace_ratio > 0)

    @property
    def paced(self) -> bool:
        """RLD's tokens go out no faster than a stretch of MD's pace once the
        final batch is out: every session that overlaps while pacing is on,
        an overlap too (where MD really is faster, RLD's own gaps are longer
        than that stretch and nothing waits; where MD only looked faster, as
        beside RLD on one core, MD still catches up)."""
        return self.overlaps and self.cfg.handoff_pace_ratio > 0

    @property
    def batches_sent(self) -> tuple[SendBatch, ...]:
        return tuple(self._batches)

    @property
    def rld_stop_at(self) -> int | None:
        """Where RLD must stop generating, once the final batch is out (None
        overlapping: RLD goes on until MD overtakes it)."""
        last = self._batches[-1] if self._batches and not self.overlaps else None
        return last.end if last and last.final else None

    @property
    def in_flight(self) -> SendBatch | None:
        live = (HandoffState.EXTENDING, HandoffState.FINAL_IN_FLIGHT)
        return self._batches[-1] if self.state in live else None

    # --- events -------------------------------------------------------------
    def on_md_ready(self, now: float, num_generated: int, rld_decoding: bool = True) -> SendBatch | None:
        """MD holds the prompt KV; RLD has generated `num_generated` tokens.
        `rld_decoding`: RLD has made a token of its own, so its next one is
        due within its inter-token gap; if not (only P's first token is out,
        RLD's first step may still be far off), a final batch goes at once."""
        self._expect(HandoffState.AWAITING_MD, "on_md_ready")
        self._advance(num_generated)
        self.md_ready_s = now
        if self._rld_finishes(num_generated):
            return None
        if self.mode in (HandoffMode.OVERLAP, HandoffMode.PACED):
            return self._send(0, num_generated, True)     # RLD is not paused: nothing to arm
        final = (self.mode is HandoffMode.ONE_SHOT
                 or num_generated <= self.cfg.catchup_final_max_tokens)
        return self._send(0, num_generated, final, arm=rld_decoding)

    def on_md_running(self, now: float, have: int, num_generated: int) -> bool:
        """MD took RLD's first `have` tokens, sent ahead while its KV crossed,
        and decodes on from them (`PolicyConfig.extend_ahead`): as an
        overlapping session's final batch, sent and extended at once. False
        where RLD ends the request itself (`RLD_FINISHES`, as `on_md_ready`):
        MD is to stop."""
        self._expect(HandoffState.AWAITING_MD, "on_md_running")
        if not self.overlaps:
            raise HandoffError(f"{self.request_id}: MD runs on in a {self.mode.name} session")
        self._advance(num_generated)
        self.md_ready_s = now
        if self._rld_finishes(num_generated):
            return False
        self._batches.append(SendBatch(0, have, True))
        self.state = HandoffState.FINAL_IN_FLIGHT
        return True

    def on_rld_token(self, now: float, num_generated: int) -> SendBatch | None:
        """RLD's token reached the router: an armed final batch goes now."""
        if self.state is not HandoffState.ARMED:
            return None
        self._advance(num_generated)
        if self._rld_finishes(num_generated):
            return None
        return self._send(self._armed_start, num_generated, True)

    def on_batch_extended(self, now: float, upto: int, num_generated: int) -> SendBatch | Complete | None:
        """MD extended through `upto`; RLD has generated `num_generated` so far."""
        batch = self.in_flight
        if batch is None:
            raise HandoffError(f"{self.request_id}: on_batch_extended in state {self.state.name}")
        if upto != batch.end:
            raise HandoffError(f"{self.request_id}: MD extended to {upto}, "
                               f"batch in flight ends at {batch.end}")
        self._advance(num_generated)
        if batch.final:
            if num_generated != batch.end:
                raise HandoffError(f"{self.request_id}: RLD generated {num_generated} tokens "
                                   f"after being told to stop at {batch.end}")
            self.state = HandoffState.DONE
            self.done_s = now
            return Complete(upto)
        num_non_final = len(self._batches)
        final = (num_generated - upto <= self.cfg.catchup_final_max_tokens
                 or num_non_final >= self.cfg.catchup_max_batches)
        if final and self._rld_finishes(num_generated):
            return None
        return self._send(upto, num_generated, final)

    def on_overlap_switch(self, now: float, upto: int) -> Complete:
        """Overlap: MD's tokens overtook RLD's at index `upto`; MD owns the stream."""
        if not self.overlaps or self.state is not HandoffState.FINAL_IN_FLIGHT:
            raise HandoffError(f"{self.request_id}: on_overlap_switch in {self.mode.name} / {self.state.name}")
        self._advance(upto)
        self.state = HandoffState.DONE
        self.done_s = now
        return Complete(upto)

    def on_overlap_diverged(self, now: float) -> None:
        """Overlap: MD's token differs from the user's at an index both made
        (numerics of different batches): RLD ends the request."""
        if not self.overlaps or self.state is not HandoffState.FINAL_IN_FLIGHT:
            raise HandoffError(f"{self.request_id}: on_overlap_diverged in {self.mode.name} / {self.state.name}")
        self.state = HandoffState.RLD_FINISHES

    def on_rld_finished(self, now: float, num_generated: int) -> Abandon:
        """RLD ended the request (EOS or max_tokens) before the final batch
        (or, overlapping, before MD's tokens overtook its own)."""
        overlapping = self.overlaps and self.state is HandoffState.FINAL_IN_FLIGHT
        if not overlapping and self.state not in (HandoffState.AWAITING_MD, HandoffState.EXTENDING,
                                                  HandoffState.ARMED, HandoffState.RLD_FINISHES):
            raise HandoffError(f"{self.request_id}: on_rld_finished in state {self.state.name}")
        self._advance(num_generated)
        self.state = HandoffState.ENDED_ON_RLD
        self.done_s = now
        return Abandon(num_generated, "request ended on RLD")

    def on_failed(self, now: float, reason: str) -> Abandon:
        """MD or the link failed: RLD keeps the stream from what it had sent."""
        if self.state.terminal:
            raise HandoffError(f"{self.request_id}: on_failed in state {self.state.name}")
        stopped = self.rld_stop_at
        self.state = HandoffState.FAILED
        self.done_s = now
        return Abandon(self._last_generated if stopped is None else stopped, reason)

    # --- internals ----------------------------------------------------------
    def _rld_finishes(self, num_generated: int) -> bool:
        """At most `catchup_final_max_tokens` of the output bound are left: a
        final batch would stall the user (MD's extend, a WAN round trip) to hand
        over tokens RLD makes in about as long with no stall; RLD ends the request
        instead. Measured: a 41-token answer handed over at 40, its last token 0.27 s
        (3.4x the median gap) after the one before (`results/wan-bound-26`).
        A paced session (MD not faster than RLD) takes about `overlap_max_lag`
        of the user's tokens to catch MD up, each stretched: with at most twice
        that left RLD ends the request too. In `results/ab-s35-ahead` (s0006-t00)
        MD raced from token 52 of 61: the user's tokens went out 0.18 s apart
        (RLD made them every 0.06 s) until RLD ended the request first and the
        rest came at once."""
        left = None if self.max_tokens is None else self.max_tokens - num_generated
        limit = self.cfg.catchup_final_max_tokens
        if self.mode is HandoffMode.PACED and self.chosen is not HandoffMode.ONE_SHOT:
            limit = max(limit, 2 * self.cfg.overlap_max_lag)      # (a busy RLD is paused, not paced)
        if left is None or left > limit:
            return False
        self.state = HandoffState.RLD_FINISHES
        return True

    def _expect(self, state: HandoffState, event: str) -> None:
        if self.state is not state:
            raise HandoffError(f"{self.request_id}: {event} in state {self.state.name}, "
                               f"expected {state.name}")

    def _advance(self, num_generated: int) -> None:
        if num_generated < self._last_generated:
            raise HandoffError(f"{self.request_id}: num_generated went back from "
                               f"{self._last_generated} to {num_generated}")
        self._last_generated = num_generated

    def _send(self, start: int, end: int, final: bool, arm: bool = True) -> SendBatch | None:
        arm = arm and not self.overlaps          # a final batch that leaves RLD running pauses nothing
        if final and arm and self.cfg.handoff_on_rld_token and self.state is not HandoffState.ARMED:
            self._armed_start = start
            self.state = HandoffState.ARMED
            return None
        batch = SendBatch(start, end, final)
        self._batches.append(batch)
        self.state = HandoffState.FINAL_IN_FLIGHT if final else HandoffState.EXTENDING
        return batch


def new_session(request_id: str, num_eager_tokens: int, rld: InstanceView,
                cfg: PolicyConfig, max_tokens: int | None = None,
                md: InstanceView | None = None, rld_pace_s: float | None = None,
                md_runs_on: bool = False) -> HandoffSession:
    """A session with its mode chosen from RLD's (and MD's) load at MD-ready
    time. `md_runs_on`: MD decodes on from RLD's tokens it took ahead of its
    KV (`HandoffSession.on_md_running`): the session overlaps whatever the
    choice, paced where MD is not clearly faster and pacing is on; `chosen`
    keeps the choice (a one-shot's busy RLD is paused at once)."""
    chosen = choose_handoff_mode(num_eager_tokens, rld, cfg, md, rld_pace_s)
    mode = chosen
    if md_runs_on:
        mode = HandoffMode.OVERLAP if chosen is HandoffMode.OVERLAP or cfg.handoff_pace_ratio <= 0 \
            else HandoffMode.PACED
    return HandoffSession(request_id, mode, cfg, max_tokens, chosen)
