"""The router's view of the deployment: addresses, live load, WAN estimate.

Load comes from polling every instance's /internal/stats; between polls the
router counts what it dispatched itself, so a burst does not all land on the
instance that looked idle a moment ago. Prefix matches of PDD's instances in
this datacenter are asked per request; those across the WAN, and those of
every instance of a PD baseline, come from the router's index of their
caches (`CacheIndex`), which the same poll keeps current, so routing costs
no round trip over the WAN and a PD baseline's none at all. The poll's
round trip to the instances across the WAN feeds the WAN's RTT estimate.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace

from pdd.deploy.spec import DeploymentSpec, InstanceSpec, Role
from pdd.deploy.topology import Address, address
from pdd.policy import (
    ClusterView, InstanceView, LinkEstimator, PolicyConfig, PrefixReuseCounter, RelayBudgets,
)
from pdd.policy import Role as PolicyRole
from pdd.policy.copies_ahead import DispatchedCopies
from pdd.policy.views import fit_prefill_cost
from pdd.server.cache_index import CacheIndex
from pdd.server.wire import InternalClient

log = logging.getLogger(__name__)


@dataclass
class Member:
    spec: InstanceSpec
    http: Address           # as the router reaches it
    view: InstanceView
    healthy: bool = True
    in_flight: int = 0      # dispatched by this router and not yet finished
    answered_s: float = 0.0  # when it last answered a load poll (time.monotonic())
    index: CacheIndex | None = None   # its prefix cache as the router knows it (remote instances)
    send_backlog: dict | None = None  # P: WAN bytes still to send, foreground / background (last poll)


LOCAL_LINE_BITS_S = 4e9
INDEX_MAX_AGE_S = 2.0    # a cache index older than this (polls failing): ask the instance
LOCAL_LATENCY_S = 1e-4
# The PD baselines route by cache affinity from the index alone (no round trip).
PD_MODES = ("pd-local", "pd-wan")


class Cluster:
    def __init__(self, spec: DeploymentSpec, client: InternalClient, policy: PolicyConfig):
        self.spec, self.client, self.policy = spec, client, policy
        self.members: dict[str, Member] = {}
        for inst in spec.instances:
            view = InstanceView(inst.name, PolicyRole(inst.role.value), inst.datacenter, 0, 0,
                                inst.engine.max_num_seqs, inst.engine.num_blocks, inst.engine.num_blocks,
                                chunk_tokens=inst.engine.max_num_batched_tokens)
            m = Member(inst, address(spec, inst, spec.router_datacenter), view)
            if m.http.link == "wan" or spec.mode in PD_MODES:
                m.index = CacheIndex()
            self.members[inst.name] = m
        wan = spec.links[0] if spec.links else None
        self.wan = LinkEstimator.from_line(
            (wan.bandwidth_mbps if wan else 10_000.0) * 1e6, (wan.latency_ms if wan else 0.1) / 1e3
        )
        # Inside a datacenter (P -> RLD, P -> D): loopback TCP here, ~4 Gbit/s
        # before the first measurement.
        self.local = LinkEstimator.from_line(LOCAL_LINE_BITS_S, LOCAL_LATENCY_S)
        self.prefix_reuses = PrefixReuseCounter()
        self.relay_budgets = RelayBudgets(self.policy, sum(
            i.engine.max_num_seqs for i in spec.instances if i.role == Role.RELAY))
        self.copies = DispatchedCopies()       # WAN copies routed, not yet in P's report
        self.wan_up = True

    def kv_address(self, target: str, from_instance: str) -> Address:
        """Where `from_instance` sends KV to reach `target`."""
        src = self.members[from_instance].spec
        return address(self.spec, self.members[target].spec, src.datacenter)

    def role(self, *roles: Role) -> list[Member]:
        return [m for m in self.members.values() if m.spec.role in roles]

    # -- live load ---------------------------------------------------------------
    async def refresh(self) -> None:
        async def one(m: Member) -> None:
            path = "/internal/stats" + (f"?{m.index.query()}" if m.index is not None else "")
            t0 = time.monotonic()
            try:
                s = await self.client.get(m.http.url, path, timeout_s=2.0)
            except asyncio.TimeoutError:   # busy, not dead: keep its last view
                return
            except Exception as e:  # an unreachable instance stays in the view, marked unhealthy
                m.healthy = False
                log.warning("stats from %s failed: %r", m.spec.name, e)
                return
            m.healthy = True
            m.answered_s = now = time.monotonic()
            if m.http.link == "wan":
                self.wan.observe_rtt(now, now - t0)
            if m.index is not None and isinstance(s.get("kv"), dict):
                m.index.apply(s["kv"], now)
            m.send_backlog = (s.get("kv_send_backlog") or {}).get("wan", {})
            self.copies.reported(m.send_backlog.get("requests") or ())
            # [prompt tokens, wall s(, attention)]: an instance of before
            # session 33 reports no attention, and its fit has none
            steps = [(int(x[0]), float(x[1]), float(x[2]) if len(x) > 2 else None)
                     for x in s.get("prefill_steps") or ()]
            cost = fit_prefill_cost(steps)
            m.view = replace(m.view, num_running=int(s["num_running"]), num_waiting=int(s["num_waiting"]),
                             kv_free_blocks=int(s["kv_free_blocks"]), kv_total_blocks=int(s["kv_total_blocks"]),
                             step_time_s=s.get("decode_step_s"), prefill_tokens_s=s.get("prefill_tokens_s"),
                             prefill_step_s=cost[0] if cost else None, prefill_token_s=cost[1] if cost else None,
                             prefill_attn_s=cost[2] if cost else 0.0,
                             prefill_largest_step=max((x[0] for x in steps), default=0),
                             kv_layer_slices=int(s.get("kv_stream_slices") or 1))

        await asyncio.gather(*(one(m) for m in self.members.values()))

    async def poll_forever(self, interval_s: float = 0.5) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(interval_s)

    def dispatched(self, name: str, delta: int) -> None:
        self.members[name].in_flight = max(0, self.members[name].in_flight + delta)

    def _view(self, m: Member) -> InstanceView:
        # what the router itself sent beyond what the last poll saw counts as waiting
        extra = max(0, m.in_flight - m.view.num_running - m.view.num_waiting)
        return replace(m.view, num_waiting=m.view.num_waiting + extra)

    # -- per request ---------------------------------------------------------------
    def indexed(self, m: Member, now: float) -> CacheIndex | None:
        """The member's cache index, if the last polls kept it current."""
        if m.index is None or not m.index.fresh(now, INDEX_MAX_AGE_S):
            return None
        return m.index

    def indexed_matches(self, names: list[str], prompt_ids: list[int], now: float) -> dict[str, int]:
        """The cached prefix of the prompt on each of `names` whose index is
        current, from the index alone; the others are left out."""
        hashes: dict[tuple[int, bytes], list[bytes]] = {}
        out: dict[str, int] = {}
        for name in names:
            index = self.indexed(self.members[name], now)
            if index is not None:
                key = (index.block_size, index.namespace)
                if key not in hashes:
                    hashes[key] = index.block_hashes(prompt_ids)
                out[name] = index.matched_tokens(hashes[key])
        return out

    async def matched_tokens(self, names: list[str], prompt_ids: list[int]) -> dict[str, int]:
        """`indexed_matches`, and the instances without a current index asked."""
        out = self.indexed_matches(names, prompt_ids, time.monotonic())

        async def one(name: str) -> tuple[str, int]:
            m = self.members[name]
            t0 = time.monotonic()
            try:
                r = await self.client.post(m.http.url, "/internal/match", {"prompt_ids": prompt_ids}, timeout_s=2.0)
            except Exception:
                return name, 0
            if m.http.link == "wan":
                self.wan.observe_rtt(time.monotonic(), time.monotonic() - t0)
            return name, int(r.get("matched_tokens", 0))

        asked = [n for n in names if n not in out]
        return out | dict(await asyncio.gather(*(one(n) for n in asked)))

    def landed(self, name: str, prompt_ids: list[int], num_blocks: int | None = None) -> None:
        """A transfer put the prompt's first `num_blocks` blocks on `name`
        (None: P computed the prompt, every full block is in its cache)."""
        m = self.members.get(name)
        if m is not None and m.index is not None and m.index.block_size:
            n = len(prompt_ids) if num_blocks is None else num_blocks * m.index.block_size
            m.index.landed(m.index.block_hashes(prompt_ids[:n]))

    def view(self, matched: dict[str, int], now: float) -> ClusterView:
        members = [m for m in self.members.values() if m.healthy or m.spec.role == Role.PREFILL]
        est = self.wan.estimate(now)
        if not self.wan_up:
            est = replace(est, up=False)
        # What P's senders still have to push over the WAN (as of the last poll).
        backlogs = [m.send_backlog for m in self.members.values() if m.send_backlog]
        est = replace(est, queued_bytes=float(sum(b.get("foreground", 0) for b in backlogs)),
                      queued_background_bytes=float(sum(b.get("background", 0) for b in backlogs)),
                      queued_flows=int(sum(b.get("foreground_transfers", 0) for b in backlogs)),
                      queued_background_flows=int(sum(b.get("background_transfers", 0) for b in backlogs)))
        est = self.copies.ahead(est)      # routed since, or still in P's queue
        return ClusterView(tuple(self._view(m) for m in members), matched, est, now,
                           local=self.local.estimate(now))
