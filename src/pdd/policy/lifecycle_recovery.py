"""Failures in a request's life: the rules `RequestLifecycle` applies when
an instance, a transfer or the WAN fails.

    DIRECT's MD fails before a token -> failover: P sends its KV to an RLD
    MD / WAN fails while RLD streams  -> MD dropped (copy cancelled); a
        paused RLD resumes, its held-back tokens go out in order
    RLD gone -> `on_rld_lost`: MD takes over by one final extend of what the
        user has (P re-sends the KV first when MD had no copy), or fail
    RLD finished first -> MD parked (`keep_wan_copy`) or dropped
A fresh instance after a failure is chosen by one rule, `pick_spare`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdd.policy.config import PolicyConfig
from pdd.policy.lifecycle_io import (
    Abort, CancelTransfer, ExtendMd, FinishReason, Leg, Outcome, ResumeRld, StartTransfer,
)
from pdd.policy.pipeline import rld_has_room
from pdd.policy.rld_loss import RldLossAction, RldLossFacts, on_rld_lost
from pdd.policy.routing import pick_instance
from pdd.policy.views import InstanceView, RequestFacts, Role


class _Failed(Exception):
    """The request cannot be completed (the message goes to the user)."""


def pick_spare(healthy: Sequence[InstanceView], role: Role, lost: set[str], req: RequestFacts,
               now: float, cfg: PolicyConfig) -> str | None:
    """The one rule for a fresh instance after a failure (failover to RLD, a
    resend to MD): routing's rule without cache affinity, among live
    instances of `role` this request has not lost, preferring those with
    room; None when there is none."""
    pool = [v for v in healthy if v.role is role and v.instance_id not in lost]
    roomy = [v for v in pool if rld_has_room(v, req)]
    if not pool:
        return None
    return pick_instance(roomy or pool, {}, req.num_prompt_tokens, now, cfg)


class RecoveryRules:
    """The failure half of `RequestLifecycle` (a mixin over its state)."""

    def _rld_gone(self, now: float, why: str, healthy: tuple[InstanceView, ...]) -> None:
        """RLD cannot finish this request: MD continues at the user's token
        (`on_rld_lost`), after a fresh copy from P when MD had none, or fail."""
        rld = self.rld_id
        self.rld_lost = why
        self.lost.add(rld)
        if self.overlap_from is not None and self.md_live:
            # MD decodes this request already (an overlap handoff): it takes
            # the stream at the user's next token, as it comes (after RLD's
            # tokens a paced handoff held back: they are the user's).
            self._flush_queued(now)
            self._note("rld_lost", instance=rld, reason=why, tokens=len(self.tokens))
            self._overlap_switch(now, force=True)
            return
        self._close(Leg.RLD)
        self._out.append(Abort(Leg.RLD, rld))
        self._note("rld_lost", instance=rld, reason=why, tokens=len(self.tokens))
        if self.session is not None and not self.session.state.terminal:
            self.session.on_failed(now, f"RLD lost: {why}")
        self.md_ready_pending = False
        md = pick_spare(healthy, Role.MAIN, self.lost, self.req, now, self.cfg)
        facts = RldLossFacts(
            md_live=self.md_live, md_available=md is not None,
            p_holds_kv=self.p_open and not self.p_released and self.first_token is not None,
            md_copy_settled=self.md_id is None or self.transfers.get(self.md_id, False) is not None)
        action = on_rld_lost(facts)
        self._note("rld_lost_action", action=action.value)
        if action is RldLossAction.FAIL:
            raise _Failed(f"relay decode instance {rld} was lost ({why}) and no main-decode instance "
                          f"holds or can receive this request's KV (md live: {facts.md_live}, "
                          f"P still holds the KV: {facts.p_holds_kv})")
        if action is RldLossAction.RESEND:
            self._resend_to_md(md)
        self.owner = Leg.MD
        self.takeover_pending = True
        self._try_takeover(now)

    def _resend_to_md(self, md: str) -> None:
        self.md_id = md
        if self.landing_after == md:
            self.landing_after = None
        self.md_live, self.md_ready_s, self.md_upto, self.md_runs_from = True, None, 1, None
        self.cancelled.discard(md)       # a fresh copy (on_rld_lost waited for the old one's end)
        self._note("rld_lost_resend", md=md)
        self._open(Leg.MD, md, hold=True)
        self.transfers[md] = None
        self._out.append(StartTransfer(md))

    def _md_failed(self, now: float, why: str, healthy: tuple[InstanceView, ...]) -> None:
        """MD or the WAN failed before MD owned the stream: RLD carries on."""
        if not self.md_live:
            return
        self.lost.add(self.md_id)
        if self.rld_lost is not None:
            raise _Failed(f"main decode on {self.md_id} failed ({why}) after relay decode "
                          f"{self.rld_id} was lost ({self.rld_lost})")
        if self.owner is Leg.MD:
            if not self._decoder_tokens() and self._failover(now, why, healthy):
                return
            raise _Failed(f"main decode failed: {why}")
        self._drop_md(why)
        if self.session is not None and not self.session.state.terminal:
            self.session.on_failed(now, why)
        self._end_overlap(now)
        self._resume_paused_rld(now)

    def _resume_paused_rld(self, now: float) -> None:
        """MD will not take the stream: RLD, if paused for it, goes on, its
        held-back tokens out in order (or the request ends, if RLD had)."""
        if self.stop_at is None:
            return
        self.stop_at = None
        self.seen_s[Leg.RLD] = now
        self._out.append(ResumeRld(self.rld_id))
        for i in sorted(self.held):
            if i == len(self.tokens):
                self._emit(self.held[i], Leg.RLD)
        self.held.clear()
        if self.rld_end is not None:    # RLD had already finished: so has the request
            self.ended_on_rld = True
            self._finish(FinishReason(self.rld_end.value))

    def _failover(self, now: float, why: str, healthy: tuple[InstanceView, ...]) -> bool:
        """DIRECT failed before any token: P sends its KV to an RLD instead
        (once it has computed it: a copy that streams with the prefill can
        fail before P's first token)."""
        rld = pick_spare(healthy, Role.RELAY, self.lost, self.req, now, self.cfg)
        if rld is None or (self.first_token is None and not self.p_open):
            return False
        self.md_live = False
        self._close(Leg.MD)
        self.rld_id, self.owner, self.rld_lost = rld, Leg.RLD, None
        self.outcome = Outcome.FAILOVER
        self._note("failover", reason=why, rld=rld)
        self._open(Leg.RLD, rld, hold=False)
        self.transfers[rld] = None          # P keeps the KV for it
        if self.first_token is None:
            self.failover_to = rld          # sent at `Prefilled`
        else:
            self._out.append(StartTransfer(rld))
        return True

    def _try_takeover(self, now: float) -> None:
        """MD continues at index len(tokens): one final extend of what the
        user has past P's first token, as the last batch of a handoff."""
        if not self.takeover_pending or self.md_ready_s is None or not self.md_live:
            return
        if not self.tokens:
            if self.first_token is None:
                return
            self._emit(self.first_token, Leg.P)     # MD was told to hold it back
        self.takeover_pending = False
        if len(self.tokens) >= self.req.max_tokens:
            self._finish(FinishReason.LENGTH)
            return
        if self.md_runs_from is not None:
            # MD decodes on from RLD's tokens it took ahead of its KV: the user's
            # stream goes on with its tokens past what the user has (those
            # before are checked against the user's, `_already_out`).
            self._note("md_takeover", at=len(self.tokens), extend_tokens=0)
            return
        toks = self.tokens[self.md_upto:]
        self.md_upto = len(self.tokens)
        self.md_extend_s = now
        self._note("md_takeover", at=len(self.tokens), extend_tokens=len(toks))
        self._out.append(ExtendMd(self.md_id, tuple(toks), True))

    def _drop_md(self, why: str) -> None:
        """Cancel the P->MD transfer and MD's request (the filter, or a failure)."""
        self.md_live = False
        self._note("md_dropped", reason=why)
        if self.transfers.get(self.md_id) is None:
            self.cancelled.add(self.md_id)
            self._out.append(CancelTransfer(self.md_id, why))
        self._close(Leg.MD)
        self._out.append(Abort(Leg.MD, self.md_id))     # a stalled MD must not hold up RLD

    def _park_md(self) -> None:
        """RLD finished first: drop MD's request but let its copy land, so MD's
        prefix cache learns the context (the next turn then lacks only its
        new tokens on MD as on P)."""
        self.md_live = False
        self.landing_after = self.md_id
        self._note("md_parked", reason="request finished on RLD first; its KV still lands on MD")
        self._close(Leg.MD)
        self._out.append(Abort(Leg.MD, self.md_id, keep_kv=True, background=False))
