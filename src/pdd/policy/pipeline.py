"""Which pipeline serves a request: P->MD, P->RLD->MD, or (filtered) RLD only.

Decision order, over one ClusterView snapshot:

1. P by cache affinity against load (`pick_instance` over PREFILL).
2. MD by the same rule over MAIN (DECODE when there is no MAIN: the in-DC
   and naive cross-DC PD baselines use the same call and get DIRECT).
3. WAN down (operator switch or the link estimate) -> RELAY_ONLY "wan down".
4. Bytes MD lacks = prompt blocks MD does not hold (all of them without DRC);
   est_wan_s = rtt + bytes / measured throughput. Measured, not a constant
   hit rate: a 99%-hit request on a congested line can still be slow. P
   streams the KV while it computes, so what the user would wait for is
   wait_s, the transfer less what hides behind the prefill
   (`wait_after_prefill`); the rules below compare that.
5. The filter: a request of the abnormal class (`in_filter_class`: very
   long, mostly new input, very short output) that an RLD with a free slot
   would finish before the copy lands, while the RLD-only share of recent
   requests is within its budget -> RELAY_ONLY, no WAN transfer. Never
   queued on a full relay pool: that is how RLD-only work snowballs.
6. est_wan_s <= direct_max_wan_s -> DIRECT: MD holds the KV about as soon
   as an RLD could have mattered. Also DIRECT when the local link is
   measured and RLD would hold the prompt KV (what its own prefix cache
   lacks) less than relay_min_gain_s before MD holds what *it* lacks: then
   a relay would add RLD's work and a handoff for no earlier token (a
   high-hit request whose RLD has nothing cached, say).
7. Otherwise RELAY with the least-loaded RLD that has room, while RLD's
   expected share of recent output tokens stays within its budget
   (`RelayBudgets.tokens`: eager tokens = est_wan_s / RLD's step time, at
   most the output bound; a run's first decisions get a start-up loan,
   `ShareBudget`); none, or past the budget -> DIRECT.

There is deliberately no plain P->RLD pipeline for low-hit requests: low-hit
requests are the ones with the longest transfers, and finishing them on RLD
would make a small pool do the bulk decoding of exactly the costliest
requests; its batch fills, TPOT rises, more requests miss the MD handoff
window and stay on RLD, and the pool collapses. RLD only ever holds a
request until MD takes over (or, filtered, for a handful of tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from enum import Enum

from pdd.policy.config import PolicyConfig
from pdd.policy.filter import (
    PrefixReuseCounter, RelayBudgets, ShareBudget, in_filter_class, predict_abnormal, should_cancel_wan,
    warm_after_skip,
)
from pdd.policy.routing import pick_instance
from pdd.policy.views import ClusterView, InstanceView, RequestFacts, Role


class Pipeline(Enum):
    DIRECT = "direct"            # P -> MD
    RELAY = "relay"              # P -> RLD (eager tokens) -> MD (extend-decode handoff)
    RELAY_ONLY = "relay_only"    # RLD to the end, no WAN transfer (filter or WAN down)


class NoRouteError(RuntimeError):
    """No instance can take the request (no P, or WAN down and no RLD)."""


@dataclass(frozen=True)
class PipelineDecision:
    pipeline: Pipeline
    p_id: str
    rld_id: str | None
    md_id: str | None       # for RELAY_ONLY by the filter: the MD it would have gone to
    start_wan: bool         # start the P -> MD KV transfer
    missing_bytes: int      # KV bytes MD lacks (0 when unknown: WAN down)
    est_wan_s: float        # inf when the WAN is down
    reason: str
    # Of the filter's class: the live filter may still cancel its WAN copy.
    filterable: bool = False
    rld_tokens: int = 0     # output tokens RLD is expected to emit (RELAY: eager; RELAY_ONLY: all)
    # How long after P's first token MD is expected to hold the KV (the
    # transfer less what streams behind the prefill, `wait_after_prefill`).
    wait_s: float = math.inf
    # The deployment orders its line (PDD's senders: `copy_yields_line`); a PD
    # baseline's decoder (DECODE, not MAIN) takes its KV as plain TCP flows.
    gated: bool = True
    # A DIRECT copy too big to be a user's short wait (its bytes alone take
    # longer than direct_max_wan_s at the line's rate): it yields the line
    # (`copy_yields_line`).
    big_copy: bool = False
    # How long after P's first token RLD is expected to hold the prompt KV
    # (the local copy, `LinkEstimate.transfer_s` of what RLD lacks; inf when
    # the local link is not measured or no RLD takes the request). The
    # lifecycle lets P's first token out at once when this is within
    # `first_token_max_stall_s`, as it does for a direct request's MD.
    rld_wait_s: float = math.inf

    def __post_init__(self) -> None:
        if self.wait_s == math.inf and math.isfinite(self.est_wan_s):
            object.__setattr__(self, "wait_s", self.est_wan_s)

    @property
    def relay_only_by_choice(self) -> bool:
        """Kept off the WAN by the filter (not because the WAN is down)."""
        return self.pipeline is Pipeline.RELAY_ONLY and self.md_id is not None


def wait_after_prefill(est_wan_s: float, new_tokens: int, p: InstanceView, start_tokens: int = 0) -> float:
    """How long after P's first token the receiver still waits for the KV.

    P streams KV while it computes, so a transfer hides behind the prefill:
    what could cross while P computed has crossed by its end. What exists only
    at the end is the last slice of the last chunk: a chunk's blocks whole
    (kv_layer_slices 1: a one-chunk prompt hides nothing), or its last layer
    (P sends layer by layer: even a warm turn's few new tokens hide all but
    1/layers of their bytes). How long P computes: its fitted step, token and
    attention costs for the new tokens past the `start_tokens` it has cached
    (`InstanceView.prefill_compute_s`). Without P's measured prefill speed
    or chunk size: the whole estimate."""
    chunk = p.chunk_tokens
    if chunk <= 0 or new_tokens <= 0 or not math.isfinite(est_wan_s):
        return est_wan_s
    compute_s = p.prefill_compute_s(new_tokens, start_tokens)
    if compute_s is None:
        return est_wan_s
    tail_s = est_wan_s * min(chunk, new_tokens) / new_tokens / max(1, p.kv_layer_slices)
    return max(est_wan_s - compute_s, tail_s)


def rld_has_room(rld: InstanceView, req: RequestFacts) -> bool:
    """A free batch slot and KV blocks for the prompt plus the whole output."""
    need = -(-(req.num_prompt_tokens + req.max_tokens) // req.block_size)
    return rld.num_requests < rld.max_batch and rld.kv_free_blocks >= need


def rld_tpot_s(rld: InstanceView, cfg: PolicyConfig) -> float:
    return rld.step_time_s if rld.step_time_s and rld.step_time_s > 0 else cfg.rld_tpot_prior_s


def _pick_rld(req: RequestFacts, cluster: ClusterView, cfg: PolicyConfig) -> InstanceView | None:
    free = [r for r in cluster.with_role(Role.RELAY) if rld_has_room(r, req)]
    if not free:
        return None
    # RLD receives the whole prompt KV over the fast path: no cache affinity.
    return cluster.instance(pick_instance(free, {}, req.num_prompt_tokens, cluster.now, cfg))


def _least_loaded_rld(req: RequestFacts, cluster: ClusterView, cfg: PolicyConfig) -> InstanceView | None:
    rlds = cluster.with_role(Role.RELAY)
    if not rlds:
        return None
    return cluster.instance(pick_instance(rlds, {}, req.num_prompt_tokens, cluster.now, cfg))


def _rld_wait(req: RequestFacts, rld: InstanceView | None, cluster: ClusterView, new_tokens: int,
              p_has: int, p_view: InstanceView, cfg: PolicyConfig) -> float:
    """How long after P's first token `rld` would hold the prompt KV: what
    its prefix cache lacks over the local link, less what streams behind the
    prefill when the copy streams with it; inf when the local link is not
    measured (or there is no RLD)."""
    if cluster.local is None or not cluster.local.usable or rld is None:
        return math.inf
    local = cluster.local.transfer_s(req.missing_kv_bytes(cluster.matched(rld.instance_id)))
    if cfg.stream_relay_copy:       # else it leaves once the prefill has ended: nothing hides
        local = wait_after_prefill(local, new_tokens, p_view, p_has)
    return local


def choose_pipeline(req: RequestFacts, cluster: ClusterView, cfg: PolicyConfig,
                    budgets: RelayBudgets | None = None) -> PipelineDecision:
    """`budgets` bound what RLD carries (None: unbounded); the caller notes
    every decision in them (`note_decision`)."""
    prefills = cluster.with_role(Role.PREFILL)
    if not prefills:
        raise NoRouteError("no prefill instance")
    n = req.num_prompt_tokens
    p_id = pick_instance(prefills, cluster.matched_tokens, n, cluster.now, cfg)
    if req.max_tokens == 1:
        # P's first token is the whole answer: no decoder, no copy, as a PD
        # baseline's router does (`pd_flow`); nothing counts in RLD's budgets.
        return PipelineDecision(Pipeline.DIRECT, p_id, None, None, False, 0, 0.0,
                                "one token: P's first is the answer", wait_s=0.0)
    rld = _pick_rld(req, cluster, cfg)
    rld_id = rld.instance_id if rld else None

    mds = cluster.with_role(Role.MAIN) or cluster.with_role(Role.DECODE)
    if not mds or not cfg.md_reachable or not cluster.wan.usable:
        # Nowhere else to go: queue on RLD even when it is full (room frees up).
        queue_rld = rld or _least_loaded_rld(req, cluster, cfg)
        if queue_rld is None:
            raise NoRouteError("WAN down and no relay-decode instance")
        return PipelineDecision(Pipeline.RELAY_ONLY, p_id, queue_rld.instance_id, None, False, 0,
                                math.inf, "wan down", rld_tokens=req.max_tokens)

    md_matched = {m.instance_id: cluster.matched(m.instance_id) for m in mds} if cfg.enable_drc else {}
    md_id = pick_instance(mds, md_matched, n, cluster.now, cfg)
    missing = req.missing_kv_bytes(md_matched.get(md_id, 0))
    est = cluster.wan.transfer_s(missing)
    # What the user would wait for after P's first token: the transfer less
    # the part that streams while P computes. A relayed request's copy goes
    # as background, behind the other copies too: when MD could take over.
    p_view, p_has = cluster.instance(p_id), min(cluster.matched(p_id), n)
    new_tokens = n - p_has
    copy_wait = wait_after_prefill(cluster.wan.transfer_s(missing, background=True), new_tokens, p_view, p_has)
    # A copy whose own bytes outlast a short wait yields the line to those
    # that do not (shortest first), so a direct user waits for it as for a
    # copy. Only where PDD's senders order the line (`gated`: a MainDecode);
    # a PD baseline's copy is a plain flow, its user's wait a flow's.
    gated = bool(cluster.with_role(Role.MAIN))
    big = gated and cluster.wan.bytes_s(missing) > cfg.direct_max_wan_s
    wait = copy_wait if big else wait_after_prefill(est, new_tokens, p_view, p_has)
    filterable = bool(cluster.with_role(Role.RELAY)) and in_filter_class(req, cluster.matched(p_id), cfg)
    rld_wait = _rld_wait(req, rld, cluster, new_tokens, p_has, p_view, cfg)

    def direct(why: str) -> PipelineDecision:
        return PipelineDecision(Pipeline.DIRECT, p_id, None, md_id, True, missing, est, why, filterable,
                                wait_s=wait, gated=gated, big_copy=big)

    m = req.max_tokens
    # RLD-only is bounded by its own budget of requests only: by the class's
    # definition their outputs are tiny (at most 1/100 of the input), so a
    # token budget spent on relays must not send them on a long transfer.
    if (filterable and rld is not None and predict_abnormal(req, copy_wait, rld_tpot_s(rld, cfg), cfg)
            and (budgets is None or budgets.requests.allows(1, 1))):
        return PipelineDecision(Pipeline.RELAY_ONLY, p_id, rld_id, md_id, False, missing, est,
                                f"abnormal: {m} tokens end on RLD before the KV lands ({copy_wait:.3f}s)",
                                filterable, m, wait_s=copy_wait, rld_wait_s=rld_wait)
    if wait <= cfg.direct_max_wan_s:
        return direct(f"wan {wait:.3f}s <= {cfg.direct_max_wan_s}s")
    if math.isfinite(rld_wait) and wait - rld_wait < cfg.relay_min_gain_s:
        return direct(f"relay gains {wait - rld_wait:.3f}s < {cfg.relay_min_gain_s}s "
                      f"(wan {wait:.3f}s, local {rld_wait:.3f}s)")
    if rld is None:
        return direct("no relay-decode instance" if not cluster.with_role(Role.RELAY) else "relay pool full")
    eager = min(m, math.ceil(copy_wait / rld_tpot_s(rld, cfg)))
    if budgets is not None and not budgets.tokens.allows(eager, m):
        return direct(f"relay budget: RLD would emit ~{eager} of {m} tokens past its "
                      f"{cfg.relay_max_token_share:.0%} share")
    return PipelineDecision(Pipeline.RELAY, p_id, rld_id, md_id, True, missing, est,
                            f"wan {wait:.3f}s > {cfg.direct_max_wan_s}s", filterable, eager, wait_s=copy_wait,
                            rld_wait_s=rld_wait)


@dataclass(frozen=True)
class BudgetEntries:
    """One decision's entries in the relay budgets, settled as it goes."""
    requests: list[float]
    tokens: list[float]

    def relay_only(self) -> None:
        """The live filter cancelled the request's WAN copy: it counts as
        RLD-only, all of its tokens RLD's (until it ends)."""
        ShareBudget.settle(self.requests, self.requests[1])
        ShareBudget.settle(self.tokens, self.tokens[1])

    def ended(self, rld_tokens: int) -> None:
        """The request has ended: RLD's tokens are known, not predicted."""
        ShareBudget.settle(self.tokens, rld_tokens)


def note_decision(budgets: RelayBudgets, d: PipelineDecision, req: RequestFacts) -> BudgetEntries:
    """Count a routing decision in the relay budgets (router and simulator
    alike, through `RequestLifecycle`, which settles the entries)."""
    return BudgetEntries(budgets.requests.note(1 if d.relay_only_by_choice else 0, 1),
                         budgets.tokens.note(d.rld_tokens, req.max_tokens))


def cancel_wan(d: PipelineDecision, budgets: RelayBudgets | None, now: float, wan_elapsed_s: float,
               tokens_left: int, rld: InstanceView, cfg: PolicyConfig) -> bool:
    """The live filter, while a relayed request's WAN copy is in flight:
    cancel it when the request is of the filter's class, the RLD-only budget
    has room, and RLD will end first (`should_cancel_wan`) by the routing
    estimate less the time the copy has already had. The caller then calls
    `BudgetEntries.relay_only`."""
    if not d.filterable or (budgets is not None and not budgets.requests.allows(1, 1)):
        return False
    remaining = max(0.0, d.wait_s - max(wan_elapsed_s, 0.0))
    return should_cancel_wan(now, max(tokens_left, 0), remaining, rld_tpot_s(rld, cfg), cfg)


def keep_wan_copy(d: PipelineDecision) -> bool:
    """RLD finished a relayed request before MD held its KV: let the copy land
    anyway, so MD's prefix cache learns the context as P's did (DRC), unless
    the request is of the filter's class, which nothing is expected to reuse.
    Cancelling it instead is the self-feeding loop: the next turn of the
    conversation lacks all of it on MD, is relayed again, ends on RLD again."""
    return d.start_wan and not d.filterable


def copy_yields_line(d: PipelineDecision, warm: bool = False) -> bool:
    """Whether P's copy of the KV to MD yields the line to transfers a user
    waits on (router and simulator alike). It does when RLD serves the user
    meanwhile (RELAY: the copy only readies MD for the handoff), when it only
    warms MD's cache, and when a direct request's copy is big: its bytes
    alone take longer than `direct_max_wan_s` at the line's rate
    (`big_copy`; its user waits that long anyway, and giving it the line
    first would hold back the warm turns' few blocks that other users wait
    on). What does not yield is a direct copy of a few blocks, however
    crowded the line when it was routed (judged by its size, not by its
    estimated end: that estimate counts the big copies ahead of it, which
    is what yielding removes), or a resend after a lost RLD. Yielding copies
    share what is left of the line one at a time, fewest bytes left first. A
    PD baseline (no MainDecode: `d.gated` false) has no such gate: its
    copies share the line as TCP flows do, in the simulator as on the
    servers."""
    if warm or d.pipeline is Pipeline.RELAY:
        return True
    return d.gated and d.pipeline is Pipeline.DIRECT and d.big_copy


def plan_warm(d: PipelineDecision, matched: Mapping[str, int], prefix_key: Callable[[int], Hashable],
              reuses: PrefixReuseCounter, block_size: int, cfg: PolicyConfig) -> tuple[int, int]:
    """Count the request's P-cached prefix as one more reuse of it; return
    (tokens of it a filtered request should still push to MD, earlier reuses).

    `prefix_key(n)` names the request's first n (block-aligned) tokens: a hash
    of the token ids in the router, a chained block id in the simulator.
    """
    shared = matched.get(d.p_id, 0) // block_size * block_size
    if shared == 0:
        return 0, 0
    before = reuses.seen(prefix_key(shared))
    if d.pipeline is not Pipeline.RELAY_ONLY or d.md_id is None:
        return 0, before
    return warm_after_skip(shared, matched.get(d.md_id, 0), before, block_size, cfg), before
