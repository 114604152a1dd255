"""A network link: fair-shared bandwidth (processor sharing) plus RTT.

Every active flow gets bandwidth / n (capped at max_flow_bytes_s, as one TCP
stream rarely fills a long fat pipe). Whenever a flow joins, leaves or ends
the shares change, so the link advances all flows to `now` and predicts the
next completion. The caller schedules that prediction as an event tagged
with `version`; any later change bumps the version, and a completion event
whose version is stale is ignored.

The same class times the steps of engines that time-slice one CPU core (a
"flow" is a step's seconds of work, bandwidth 1.0); `shared_efficiency` is
the fraction of the capacity left when two or more flows share it, since
processes that share a core also lose time to switching between them.
A flow's `weight` is its share against the others' (1.0 each by default):
the kernel gives a process of lower priority (a nice value) a smaller share
of a core it shares (`cfs_weight`).

Background flows (`pdd.policy.copy_yields_line`) yield: while any
foreground flow is active they get nothing, as the servers' senders pause
them (`pdd.transport.priority`), and among themselves they go one at a
time, fewest bytes left first unless one has waited `max_yield_s` since it
started (`pdd.policy.line_order`: then the oldest such; the moment a flow
reaches the bound is an event of its own); the time they wait is kept per
flow (`yielded_s`), for the estimator, as the real sender reports it.

A flow may have a cap of its own (`cap_bytes_s`): a transfer P streams
while it computes cannot cross faster than P makes its KV, and what it
leaves of the line goes to the others (max-min fair shares). The cap bounds
what has crossed by what P has made (cap x time since the flow started),
not the rate at every instant: a flow that fell behind (it yielded, or
shared the line) goes at its full share until it is level with P again, as
the real sender sends every slice P has made (`_behind`; the moment it
levels is an event of its own). The caller reports P's progress at each of
its steps (`progress`: a prediction of P's speed is no promise) and lifts
the cap when P is done.

What a flow has already handed to the line cannot be called back: a
background sender pauses between slices, but the buffers ahead of the line
still hold its bytes: the line's own buffer (the emulated WAN's relay keeps
one per direction, as a router does: about a bandwidth-delay product, at
least 256 KiB, between half full and full while senders outrun the line),
which a new TCP flow's first byte queues behind, and the sockets' buffers
of a copy whose sender has paused. So when a foreground flow starts, the
flows the line serves at their full share keep it for `buffer_bytes` more,
all of them together (each its even part, capped by what it has left and
by what P has made of it), before sharing resumes; a background one keeps
it for `yield_leak_bytes` more (what its sockets still hold) before it
yields. 0: a new flow gets its share, or its priority, at once.

Background flows may be paced (`background_pace_bytes_s`, all of them
together, as P's sender paces its yielding copies: `pdd.policy.line_order`):
held below the line's rate, their sender keeps no bytes in the buffers
ahead of the line, so they have no lead when a foreground flow starts.

A transfer pays one RTT of handshake (BEGIN -> HAVE) before its bytes flow,
and its BEGIN waits in the line's buffer while flows keep it full, and
at least for the bytes a real line's handshakes met there on average,
measured (`handshake_queue_bytes`; `queue_s`); the caller delays `add` by those, which keeps this class about
bandwidth only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pdd.policy.line_order import ages_at, yield_key


def cfs_weight(nice: int) -> float:
    """A process's weight against a nice-0 one on a shared core: Linux's CFS
    table falls ~1.25x per nice step (nice 5: 335 / 1024)."""
    return 1.25 ** -nice


@dataclass
class Flow:
    flow_id: str
    num_bytes: float
    remaining: float
    started_s: float
    background: bool = False
    yielded_s: float = 0.0
    cap_bytes_s: float = math.inf
    made_bytes: float = 0.0          # what P had made of it at made_s (`progress`)
    made_s: float = 0.0
    lead: float = 0.0                # bytes already on the line: they go before any priority
    shared: bool = False             # another flow was on the line meanwhile (as P's sender reports)
    weight: float = 1.0              # its share against the others' (`cfs_weight` on a core)


class Link:
    def __init__(self, name: str, bandwidth_bytes_s: float, rtt_s: float,
                 max_flow_bytes_s: float | None = None, shared_efficiency: float = 1.0,
                 max_yield_s: float = math.inf, buffer_bytes: float = 0.0,
                 yield_leak_bytes: float | None = None, background_pace_bytes_s: float | None = None,
                 tail_release_bytes: float = 0.0, handshake_queue_bytes: float = 0.0) -> None:
        if bandwidth_bytes_s <= 0 or rtt_s < 0:
            raise ValueError(f"{name}: bandwidth must be > 0 and rtt >= 0")
        self.name = name
        self.bandwidth_bytes_s = bandwidth_bytes_s
        self.rtt_s = rtt_s
        self.max_flow_bytes_s = max_flow_bytes_s or math.inf
        if not 0 < shared_efficiency <= 1:
            raise ValueError(f"{name}: shared_efficiency must be in (0, 1]")
        self.shared_efficiency = shared_efficiency
        self.max_yield_s = max_yield_s
        if buffer_bytes < 0:
            raise ValueError(f"{name}: buffer_bytes must be >= 0")
        self.buffer_bytes = buffer_bytes
        # A background flow's sender pauses, but what its sockets already hold
        # still crosses first (beyond its part of the line's buffer).
        self.yield_leak_bytes = 0.0 if yield_leak_bytes is None else yield_leak_bytes
        if self.yield_leak_bytes < 0:
            raise ValueError(f"{name}: yield_leak_bytes must be >= 0")
        if background_pace_bytes_s is not None and not background_pace_bytes_s > 0:
            raise ValueError(f"{name}: background_pace_bytes_s must be > 0 (None: unpaced)")
        self.background_pace_bytes_s = background_pace_bytes_s or math.inf
        # A foreground transfer lets the line go once its last block is
        # written to its socket, not once it has crossed: with this much or
        # less of every foreground flow left, the first yielding copy shares
        # the line with them again (0: foreground flows hold it to the end).
        if tail_release_bytes < 0:
            raise ValueError(f"{name}: tail_release_bytes must be >= 0")
        self.tail_release_bytes = tail_release_bytes
        # What a handshake's frames meet in the line's buffers at least, on
        # average, as measured (`CpuCalibration.handshake_queue`; 0: none).
        if handshake_queue_bytes < 0:
            raise ValueError(f"{name}: handshake_queue_bytes must be >= 0")
        self.handshake_queue_bytes = handshake_queue_bytes
        self.flows: dict[str, Flow] = {}
        self.version = 0
        self.up = True
        self._last_s = 0.0
        self.bytes_delivered = 0.0

    def _sharing(self) -> list[Flow]:
        """The flows that get the line now: the foreground ones; else the
        background one with the fewest bytes left (the servers' senders take
        background copies one at a time, shortest first)."""
        fg = [f for f in self.flows.values() if not f.background]
        if fg or not self.flows:
            return fg
        return [min(self.flows.values(), key=self._order)]

    def _order(self, f: Flow) -> tuple:
        """A background flow's place among the others (`line_order.yield_key`)."""
        return yield_key(f.remaining, f.started_s, self._last_s, self.max_yield_s)

    def rate_per_flow(self) -> float:
        """An uncapped flow's share of the line now."""
        n = len(self._sharing())
        if not n:
            return 0.0
        total = self.bandwidth_bytes_s * (self.shared_efficiency if n > 1 else 1.0)
        return min(total / n, self.max_flow_bytes_s)

    def _behind(self, f: Flow) -> bool:
        """A capped flow that has crossed less than P has made so far."""
        if f.cap_bytes_s == math.inf:
            return False
        return f.num_bytes - f.remaining < self._made(f) - 1e-6 * max(f.num_bytes, 1.0)

    def _made(self, f: Flow) -> float:
        """What P has made of a capped flow by now: its last reported progress,
        then at the cap's rate."""
        return min(f.num_bytes, f.made_bytes + f.cap_bytes_s * (self._last_s - f.made_s))

    def _cap(self, f: Flow) -> float:
        return math.inf if self._behind(f) else f.cap_bytes_s

    def _rates(self) -> dict[str, float]:
        """Each flow's rate: the foreground flows share the line evenly, a
        capped one held to its cap and what it leaves split among the others
        (water-filling); what they leave goes to the background flows, fewest
        bytes left first, each up to its cap (a copy waiting for P does not
        hold the line, foreground or background)."""
        leading = [f for f in self.flows.values() if f.lead > 0]
        if leading:
            # Bytes already on the line go first, at the line's rate.
            share = min(self.bandwidth_bytes_s * (self.shared_efficiency if len(leading) > 1 else 1.0)
                        / len(leading), self.max_flow_bytes_s)
            return {f.flow_id: share for f in leading}
        fg = [f for f in self.flows.values() if not f.background]
        bg = sorted((f for f in self.flows.values() if f.background), key=self._order)
        if not fg and not bg:
            return {}
        n = len(fg) + (1 if bg else 0)
        left = self.bandwidth_bytes_s * (self.shared_efficiency if n > 1 else 1.0)
        rates: dict[str, float] = {}
        cap = {f.flow_id: self._cap(f) for f in self.flows.values()}
        resumed = bg[:1] if fg and bg and self._released(fg) else []
        for f in resumed:         # it shares the line at its pace, as a foreground flow would
            cap[f.flow_id] = min(cap[f.flow_id], self.background_pace_bytes_s)
        todo = sorted(fg + resumed, key=lambda f: cap[f.flow_id] / f.weight)
        while todo:
            per = left / sum(g.weight for g in todo)       # a unit of weight's share
            f = todo[0]
            if cap[f.flow_id] < min(per * f.weight, self.max_flow_bytes_s):
                rates[f.flow_id] = cap[f.flow_id]
                left -= cap[f.flow_id]
                todo.pop(0)
                continue
            for g in todo:
                rates[g.flow_id] = min(per * g.weight, self.max_flow_bytes_s)
            left = 0.0
            break
        left_bg = self.background_pace_bytes_s - sum(rates[f.flow_id] for f in resumed)
        for f in bg:
            if f in resumed:
                continue
            if min(left, left_bg) <= 1e-9:
                break
            rates[f.flow_id] = min(cap[f.flow_id], left, left_bg, self.max_flow_bytes_s)
            left -= rates[f.flow_id]
            left_bg -= rates[f.flow_id]
        return rates

    @property
    def paces_background(self) -> bool:
        """Its yielding copies are paced: their sender writes them as the line takes them."""
        return self.background_pace_bytes_s != math.inf

    def _released(self, fg: list[Flow]) -> bool:
        """Every foreground flow has at most `tail_release_bytes` left: its
        sender has written its last block (the rest is in its socket's
        buffer) and no longer holds the yielding copies back
        (`transport.line_share.LineShare.let_go`)."""
        return self.tail_release_bytes > 0 and all(f.remaining <= self.tail_release_bytes for f in fg)

    def _advance(self, now: float) -> None:
        if now < self._last_s - 1e-12:
            raise ValueError(f"{self.name}: time went backwards")
        dt = now - self._last_s
        if dt > 0 and self.flows:
            rates = self._rates()
            for f in self.flows.values():
                if rates.get(f.flow_id):
                    sent = dt * rates[f.flow_id]
                    f.remaining = max(f.remaining - sent, 0.0)
                    if f.lead > 0:
                        f.lead = 0.0 if f.lead - sent <= 1e-9 * max(f.num_bytes, 1.0) else f.lead - sent
                else:
                    f.yielded_s += dt
        self._last_s = max(now, self._last_s)

    def _next(self) -> tuple[float, int] | None:
        self.version += 1
        if not self.flows:
            return None
        rates = self._rates()
        least = min((self.flows[i].remaining / r for i, r in rates.items() if r > 0), default=math.inf)
        for i, r in rates.items():
            if r > 0 and self.flows[i].lead > 0:          # its buffered bytes are through
                least = min(least, self.flows[i].lead / r)
        for i, r in rates.items():
            f = self.flows[i]
            if r > f.cap_bytes_s and self._behind(f):
                # it levels with P's making at this rate: its cap applies again then
                least = min(least, (self._made(f) - (f.num_bytes - f.remaining)) / (r - f.cap_bytes_s))
        # A foreground flow's last bytes handed to its socket: a copy may resume.
        if self.tail_release_bytes > 0 and any(f.background for f in self.flows.values()):
            for i, r in rates.items():
                f = self.flows[i]
                if r > 0 and not f.background and f.remaining > self.tail_release_bytes:
                    least = min(least, (f.remaining - self.tail_release_bytes) / r)
        # A background flow reaching the yield bound changes the order.
        if math.isfinite(self.max_yield_s):
            for f in self.flows.values():
                at = ages_at(f.started_s, self.max_yield_s)
                if f.background and at > self._last_s:
                    least = min(least, at - self._last_s)
        if least == math.inf:
            return None
        return self._last_s + max(least, 1e-9), self.version

    def add(self, now: float, flow_id: str, num_bytes: float,
            background: bool = False, cap_bytes_s: float | None = None,
            weight: float = 1.0) -> tuple[float, int] | None:
        """Start pushing bytes; returns (time of next completion, version)."""
        if flow_id in self.flows:
            raise ValueError(f"{self.name}: flow {flow_id} already active")
        if cap_bytes_s is not None and not cap_bytes_s > 0:
            raise ValueError(f"{self.name}: a flow's cap must be > 0")
        if not weight > 0:
            raise ValueError(f"{self.name}: a flow's weight must be > 0")
        self._advance(now)
        if not background and (self.buffer_bytes > 0 or self.yield_leak_bytes > 0):
            self._buffered_ahead()
        flow = Flow(flow_id, float(num_bytes), float(num_bytes), now, background,
                    cap_bytes_s=cap_bytes_s or math.inf, made_s=now, shared=bool(self.flows), weight=weight)
        for other in self.flows.values():
            other.shared = True
        self.flows[flow_id] = flow
        return self._next()

    def _filling(self) -> list[Flow]:
        """The flows that keep the line's buffer full: served at their full
        share and not held to P's pace (their senders then outrun the line),
        and not paced copies (the line drains faster than they feed it)."""
        out = []
        for fid, rate in self._rates().items():
            f = self.flows[fid]
            if rate <= 0 or f.lead > 0:
                continue
            if f.cap_bytes_s != math.inf and rate >= f.cap_bytes_s * (1 - 1e-9) and not self._behind(f):
                continue
            if f.background and self.paces_background:
                continue
            out.append(f)
        return out

    def _buffered_ahead(self) -> None:
        """A foreground flow starts: the flows that fill the line's buffer
        have `buffer_bytes` on the line already, all together, which go
        first: the line's buffer feeds it in order. A yielding copy unpaced
        has its sockets' bytes ahead too."""
        ahead = self._filling()
        for f in ahead:
            sent = f.num_bytes - f.remaining
            made = self._made(f) - sent if f.cap_bytes_s != math.inf else f.remaining
            mine = self.buffer_bytes / len(ahead) + (self.yield_leak_bytes if f.background else 0.0)
            f.lead = max(0.0, min(mine, f.remaining, made))

    def queue_s(self, now: float) -> float:
        """How long a message handed to the line now (a transfer's BEGIN)
        waits in its buffer: the buffer's bytes at the line's rate while some
        flow keeps it full, and at least the measured handshake queue."""
        self._advance(now)
        floor = self.handshake_queue_bytes / self.bandwidth_bytes_s
        if self.buffer_bytes <= 0:
            return floor
        held = sum(f.lead for f in self.flows.values())
        if not held and self._filling():
            held = self.buffer_bytes
        return max(min(held, self.buffer_bytes) / self.bandwidth_bytes_s, floor)

    def progress(self, now: float, flow_id: str, made_bytes: float,
                 cap_bytes_s: float | None = None) -> tuple[float, int] | None:
        """P has made `made_bytes` of a capped flow by now (a step of its
        prefill ended), and makes the rest at `cap_bytes_s` (unchanged: None)."""
        f = self.flows.get(flow_id)
        if f is None or f.cap_bytes_s == math.inf:
            return None
        self._advance(now)
        f.made_bytes, f.made_s = min(float(made_bytes), f.num_bytes), now
        if cap_bytes_s is not None and cap_bytes_s > 0:
            f.cap_bytes_s = cap_bytes_s
        return self._next()

    def uncap(self, now: float, flow_id: str) -> tuple[float, int] | None:
        """The flow may go as fast as its share (P has made all its KV)."""
        f = self.flows.get(flow_id)
        if f is None or f.cap_bytes_s == math.inf:
            return None
        self._advance(now)
        f.cap_bytes_s = math.inf
        return self._next()

    def backlog(self, now: float) -> dict[str, float]:
        """What is still to cross, by kind, as P's sender reports it to the
        router: the `LinkEstimate` fields of the queue ahead of a new transfer."""
        self._advance(now)
        out = {"queued_bytes": 0.0, "queued_background_bytes": 0.0,
               "queued_flows": 0, "queued_background_flows": 0}
        for f in self.flows.values():
            out["queued_background_bytes" if f.background else "queued_bytes"] += f.remaining
            out["queued_background_flows" if f.background else "queued_flows"] += 1
        return out

    def promote(self, now: float, flow_id: str) -> tuple[float, int] | None:
        """A background flow becomes foreground (a foreground transfer waits on it)."""
        f = self.flows.get(flow_id)
        if f is None or not f.background:
            return None
        self._advance(now)
        f.background = False
        return self._next()

    def cancel(self, now: float, flow_id: str) -> tuple[float, int] | None:
        self._advance(now)
        self.flows.pop(flow_id, None)
        return self._next()

    def complete(self, now: float, version: int) -> tuple[list[Flow], tuple[float, int] | None]:
        """Handle a completion event: the flows done at `now` and the next prediction.

        A stale version returns ([], None): a newer prediction is already queued.
        """
        if version != self.version:
            return [], None
        self._advance(now)
        # Relative tolerance: float drift must not leave a flow a few bytes short.
        done = [f for f in self.flows.values() if f.remaining <= 1e-9 * max(f.num_bytes, 1.0) + 1e-6]
        for f in done:
            del self.flows[f.flow_id]
            self.bytes_delivered += f.num_bytes
        return done, self._next()

    def remaining_s(self, flow_id: str, now: float) -> float:
        """Estimated seconds until `flow_id` ends at today's shares (a background
        flow first waits for the foreground ones)."""
        self._advance(now)
        f = self.flows.get(flow_id)
        if f is None:
            return 0.0
        if not f.background:
            rate = self._rates().get(flow_id) or self.rate_per_flow()
            return f.remaining / rate
        # Behind the foreground flows and the background ones before it.
        mine = self._order(f)
        fg = sum(g.remaining for g in self.flows.values() if not g.background)
        bg = sum(g.remaining for g in self.flows.values() if g.background and g is not f and self._order(g) < mine)
        line = min(self.bandwidth_bytes_s, self.max_flow_bytes_s)
        return fg / line + (bg + f.remaining) / min(line, self.background_pace_bytes_s)
