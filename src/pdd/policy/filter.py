"""Abnormal-traffic filter: requests RLD finishes before MD could take over.

A very long input with a very short output (about 3-4% of agentic traffic)
is the worst case for the WAN: the biggest transfer, for a request RLD will
have finished before the KV lands. For those the transfer is never started
(`predict_abnormal`, at routing time, from max_tokens, an upper bound on the
output, so a wrong "abnormal" guess only errs towards less RLD work than
predicted) or cancelled while in flight (`should_cancel_wan`, from live
progress). RLD then runs the request to the end.

"RLD ends first" alone is a greedy rule: on a slow line it holds for almost
every request, and following it turns PDD into in-datacenter PD with the
small relay pool as the decoder. Three bounds keep the filter to what it is
for (`in_filter_class`, `RelayBudgets.requests`, and RLD room in the pipeline
choice):
* the report's class only: an input far longer than the output bound;
* an input mostly new to P: a continuation whose context P holds and MD
  lacks must cross, or MD's cache stays cold and the next turn of the same
  conversation lacks even more (the self-feeding loop of a missing DRC);
* a bounded share of recent requests, and only onto an RLD with a free
  slot: a full relay pool is a reason to go direct, never to queue there.
Relays themselves are bounded the same way, by the share of output tokens
RLD is expected to emit (`RelayBudgets.tokens`): with short answers and long
transfers a relay ends on RLD, and enough of those make RLD the decoder.

Warming MD's cache with a skipped prefix later: only a *hot shared* prefix
(`warm_tokens_after_cancel`). A private prefix is not pushed speculatively:
if a later turn of the same conversation needs it on MD, that request's own
pipeline moves it (and DRC keeps it from then on), while pushing it now
would spend WAN bandwidth, which is scarcest exactly when long low-hit
transfers queue, on bytes that may never be read. A prefix P has already
seen reused by several requests (system prompt, tool schemas) is different:
every future sharer would pay its transfer latency, so warming its shared,
block-aligned part in the background pays off.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable

from pdd.policy.config import PolicyConfig
from pdd.policy.views import RequestFacts


def predict_abnormal(req: RequestFacts, est_wan_s: float, rld_tpot_s: float,
                     cfg: PolicyConfig) -> bool:
    """True when RLD's whole output (with margin) ends before the WAN copy would land."""
    if rld_tpot_s <= 0:
        raise ValueError("rld_tpot_s must be > 0")
    if not cfg.enable_filter:
        return False
    rld_finish_s = req.max_tokens * rld_tpot_s
    return rld_finish_s * cfg.filter_margin <= est_wan_s


def in_filter_class(req: RequestFacts, p_matched_tokens: int, cfg: PolicyConfig) -> bool:
    """A very long input, mostly new to P, for a very short output."""
    if not cfg.enable_filter:
        return False
    long_short = req.num_prompt_tokens >= cfg.filter_min_io_ratio * req.max_tokens
    fresh = max(p_matched_tokens, 0) <= cfg.filter_max_prefix_hit * req.num_prompt_tokens
    return long_short and fresh


class ShareBudget:
    """A share of recent routing decisions kept under a bound: each decision
    counts `part` of a `whole` (1 of 1 for an RLD-only request; a relay's
    expected RLD tokens of its output bound), over the last `window`
    decisions.

    A short history is no evidence of overuse: a run opens with sessions that
    are all cold, exactly the requests the relay pool exists for. So the
    budget lends `loan` wholes at the start and takes
    the loan back linearly over the `loan / max_share` decisions whose share
    repays it; from then on the bound is the share itself. Pure: the router
    and the simulator feed it the same decisions in the same order and get
    the same answers.
    """

    def __init__(self, max_share: float, window: int, loan: float = 0.0) -> None:
        if not 0.0 <= max_share <= 1.0 or window < 1 or loan < 0:
            raise ValueError("ShareBudget: max_share in [0, 1], window >= 1, loan >= 0")
        self.max_share = max_share
        self.loan = loan
        self._recent: deque[list[float]] = deque(maxlen=window)
        self._wholes_noted = 0.0                # ever noted: the loan's clock
        self._repaid_after = loan / max_share if max_share > 0 else 0.0

    @property
    def part(self) -> float:
        return sum(p for p, _ in self._recent)

    @property
    def whole(self) -> float:
        return sum(w for _, w in self._recent)

    def lent(self, whole: float) -> float:
        """Parts lent beyond the share, for one more decision of `whole`.
        The loan and its clock count in wholes of the decision at hand: the
        run so far is worth (wholes noted) / `whole` such decisions, so the
        first decision has the whole loan and a warm-up probe of a few tokens
        before the run does not shrink it. (Counted in decisions, the bench's
        one 4-token warm-up took a tenth of a loan of one, and the run's first
        cold turn, 17 tokens on RLD, no longer fitted: in `wan-bound-31` the
        first request waited 13.9 s for the line.)"""
        if self._repaid_after <= 0 or whole <= 0:
            return 0.0
        n = self._wholes_noted / whole
        if n >= self._repaid_after:
            return 0.0
        return self.loan * whole * (1.0 - n / self._repaid_after)

    def allows(self, part: float, whole: float) -> bool:
        """One more decision of `part` in `whole` keeps the share within the bound."""
        if part <= 0 or self.max_share >= 1:
            return True
        if self.max_share <= 0:
            return False
        bound = self.max_share * (self.whole + whole) + self.lent(whole)
        return self.part + part <= bound + 1e-9

    def note(self, part: float, whole: float) -> list[float]:
        """Count one routing decision; the entry, for `settle`."""
        entry = [float(part), float(whole)]
        self._recent.append(entry)
        self._wholes_noted += entry[1]
        return entry

    @staticmethod
    def settle(entry: list[float], part: float) -> None:
        """A decision's part is now known (or changed): count that instead of
        the prediction made at routing. An entry the window has forgotten
        counts nowhere any more; settling it changes nothing."""
        entry[0] = min(max(float(part), 0.0), entry[1])


class RelayBudgets:
    """What the small relay pool is allowed to carry, as shares of recent
    decisions: RLD-only requests (the filter) and RLD's tokens (relays' eager
    tokens and RLD-only outputs: as predicted at routing while a request
    runs, as RLD really emitted them once it has ended; a prediction alone
    let RLD's share run past its bound when copies took longer than
    estimated, 16.6% of the tokens at 50 Mbit/s against a 10% budget)."""

    def __init__(self, cfg: PolicyConfig, relay_slots: int = 4) -> None:
        """relay_slots: the relay pool's batch slots (the start-up loan unless
        `relay_startup_loan` sets it)."""
        loan = cfg.relay_startup_loan if cfg.relay_startup_loan is not None else float(relay_slots)
        self.requests = ShareBudget(cfg.relay_only_max_share, cfg.relay_only_window, loan=1.0)
        self.tokens = ShareBudget(cfg.relay_max_token_share, cfg.relay_only_window, loan=loan)


def should_cancel_wan(now: float, tokens_left: int, est_remaining_wan_s: float,
                      rld_tpot_s: float, cfg: PolicyConfig | None = None) -> bool:
    """Live check while a WAN transfer is in flight and RLD is decoding.

    `tokens_left` is an upper bound (max_tokens - generated). Cancelling is
    right when RLD ends first even when stretched by the filter margin.
    `now` is part of the contract for symmetry; the rule is time-invariant.
    """
    del now
    cfg = cfg or PolicyConfig()
    if tokens_left < 0 or est_remaining_wan_s < 0 or rld_tpot_s <= 0:
        raise ValueError("should_cancel_wan: negative tokens/time or non-positive tpot")
    if not cfg.enable_filter:
        return False
    return tokens_left * rld_tpot_s * cfg.filter_margin <= est_remaining_wan_s


def warm_tokens_after_cancel(num_shared_prefix_tokens: int, num_prefix_reuses: int,
                             block_size: int, cfg: PolicyConfig) -> int:
    """Tokens of a skipped request's prefix worth warming on MD later (0 = none).

    `num_shared_prefix_tokens` is the part P already held before this request
    (its matched prefix: shared with earlier requests); `num_prefix_reuses`
    how many requests P has seen reuse it. Only whole blocks travel.
    """
    if block_size <= 0 or num_shared_prefix_tokens < 0 or num_prefix_reuses < 0:
        raise ValueError("warm_tokens_after_cancel: bad arguments")
    if not cfg.enable_drc or num_prefix_reuses < cfg.warm_min_prefix_reuses:
        return 0
    return num_shared_prefix_tokens // block_size * block_size


def warm_after_skip(p_matched_tokens: int, md_matched_tokens: int, num_prefix_reuses: int,
                    block_size: int, cfg: PolicyConfig) -> int:
    """Tokens of a request kept off the WAN (RELAY_ONLY) to push to MD anyway.

    Only the hot shared prefix (`warm_tokens_after_cancel`), and only what MD
    does not already hold; 0 means nothing to send. A transfer cancelled
    mid-flight needs no such step: blocks travel in order, so the prefix it
    carried is already in MD's cache.
    """
    warm = warm_tokens_after_cancel(p_matched_tokens, num_prefix_reuses, block_size, cfg)
    held = max(md_matched_tokens, 0) // block_size * block_size
    return warm if warm > held else 0


class PrefixReuseCounter:
    """How many requests have arrived with each shared prefix (bounded, LRU).

    Keys are whatever identifies a block-aligned prefix to the caller (a hash
    of its token ids in the router, a chained block id in the simulator).
    """

    def __init__(self, capacity: int = 4096) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self._counts: OrderedDict[Hashable, int] = OrderedDict()

    def seen(self, key: Hashable) -> int:
        """Count one more request with this prefix; return how many came before it."""
        before = self._counts.pop(key, 0)
        self._counts[key] = before + 1
        while len(self._counts) > self.capacity:
            self._counts.popitem(last=False)
        return before
