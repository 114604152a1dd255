"""WAN copies the router has asked P for that P's sender does not report yet.

The router sees what is queued on the line from P's own report (its
sender's backlog, polled every half second). A copy routed since the last
poll, or still waiting in P's queue for the engine to reach its prompt, is
in no report yet: requests arriving together (a burst of cold turns, three
prompts within 0.1 s on the Mooncake trace) each saw the line as the poll
before them had, and judged their own wait without the bytes routed a
moment earlier, which cross first (P computes in arrival order). In the
held-out trace run `heldout-trace-23`, one such request was estimated at
0.74 s of WAN wait with 8 MB routed 0.1 s before it and unreported; the
simulator, which sees its line live, estimated 1.5 s and relayed it, and
the relay budget it spent turned four later decisions.

`DispatchedCopies` counts each routed copy from the decision until P
reports it (from then P's report has its bytes left) or it ends. The
request's lifecycle notes the copy and its end; each world says which
copies P reports (the router: the request ids in P's polled backlog; the
simulator: the flows on its line). Pure: no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable

from pdd.policy.views import LinkEstimate


class DispatchedCopies:
    def __init__(self) -> None:
        self._copies: dict[str, tuple[int, bool]] = {}      # request id -> (bytes, background)

    def sent(self, request_id: str, num_bytes: int, background: bool) -> None:
        """A decision routed a copy of `num_bytes` over the WAN."""
        if num_bytes > 0:
            self._copies[request_id] = (int(num_bytes), bool(background))

    def reported(self, request_ids: Iterable[str]) -> None:
        """P's sender reports these copies (in its backlog): its figures count them now."""
        for rid in request_ids:
            self._copies.pop(rid, None)

    def ended(self, request_id: str) -> None:
        """The copy ended (landed, failed, cancelled) or will never start."""
        self._copies.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._copies)

    def ahead(self, est: LinkEstimate) -> LinkEstimate:
        """`est` with the unreported copies queued ahead of a new transfer, as
        the ones P reports are (`LinkEstimate.transfer_s`)."""
        if not self._copies:
            return est
        fg = [b for b, bg in self._copies.values() if not bg]
        bg = [b for b, bg in self._copies.values() if bg]
        return replace(est, queued_bytes=est.queued_bytes + sum(fg),
                       queued_background_bytes=est.queued_background_bytes + sum(bg),
                       queued_flows=est.queued_flows + len(fg),
                       queued_background_flows=est.queued_background_flows + len(bg))
