"""What to do with a relayed request whose RelayDecode is gone.

RLD is "gone" for a request when its stream closes or errors without a
normal finish, or stays silent for longer than the deployment's stall limit
while it should be producing tokens. The router knows every token id it has
streamed, so another holder of the prompt KV can continue from there:

    MD holds (or is receiving) the KV  -> TAKE_OVER: MD extends with the
        streamed tokens past P's first (which it already has) and samples the
        next index; no token is sent twice or skipped.
    MD dropped or never asked, P still holds the KV -> RESEND: P sends the
        KV to MD (as failover does for RLD), then TAKE_OVER.
    otherwise -> FAIL with a clear error naming the lost RLD.

Pure: facts in, a decision out, so the simulator can use it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class RldLossAction(Enum):
    TAKE_OVER = "take_over"
    RESEND = "resend"
    FAIL = "fail"


@dataclass(frozen=True)
class RldLossFacts:
    md_live: bool             # MD has this request open (its KV in flight or landed)
    md_available: bool        # a healthy MD exists to receive a fresh copy
    p_holds_kv: bool          # P's prefill job is still open and unreleased
    md_copy_settled: bool     # no earlier (cancelled) P->MD transfer still reporting


def on_rld_lost(f: RldLossFacts) -> RldLossAction:
    if f.md_live:
        return RldLossAction.TAKE_OVER
    if f.md_available and f.p_holds_kv and f.md_copy_settled:
        return RldLossAction.RESEND
    return RldLossAction.FAIL


def stalled(last_event_s: float | None, now: float, stall_s: float,
            answered_s: float | None = None) -> bool:
    """A stream that should be producing has said nothing for `stall_s`, and
    its instance (when `answered_s`, the last time it answered the router's
    load poll, is given) has not answered for as long either: a decoder
    that is alive but queued under overload answers its polls and is only
    slow; a stopped or wedged one answers nothing. (Both for the whole
    limit: a loaded machine can leave one poll unanswered for seconds.)"""
    if last_event_s is None or stall_s <= 0 or now - last_event_s <= stall_s:
        return False
    return answered_s is None or now - answered_s > stall_s
