"""What the simulator's events say: one frozen record per kind of happening.

An event is a record at a time (`pdd.sim.loop.Event`). The record's class
gives the event's kind (`KIND`, the tie-break order among events at the
same instant) and its `key` (the next tie-break: the id it concerns); its
fields name requests, instances, links and flows by id, never by object, so
a run can be written out line by line (`EventLog`) and two runs compared.
The cluster looks the objects up by id when it handles the record.

    kind            records
    TRANSFER_DONE   TransferDone: a link's predicted next completion
    STEP_END        StepEnd: an instance's predicted step end
    CORE_DONE       CoreDone: a shared CPU core's predicted next step end
    MESSAGE         a message's arrival or a change of the world:
                    BeginArrives, HaveArrives (a transfer's handshake),
                    FlowTailArrives, CopyFailed, CancelTaken, LinkCut,
                    LinkRestored, MdReadyReachesRld, ExtendedReachesRld,
                    ExtendReachesMd, AheadReachesMd, LifecycleWake,
                    MdTokensReachRouter
    ARRIVAL         Arrival: a request reaches the router's policy

`MdReadyReachesRld` and `ExtendedReachesRld` wait in the receiving
instance's queue of engine commands once they arrive and take effect at its
next step boundary (`Cluster._deliver`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import ClassVar, TextIO

from pdd.sim.loop import EventKind


@dataclass(frozen=True, slots=True)
class Arrival:
    """Request `request_id` (its spec waits in `Cluster.arriving`) reaches the policy."""
    KIND: ClassVar[EventKind] = EventKind.ARRIVAL
    request_id: str

    @property
    def key(self) -> str:
        return self.request_id


@dataclass(frozen=True, slots=True)
class StepEnd:
    """Instance `instance_id`'s step ends, unless its `version` moved on since."""
    KIND: ClassVar[EventKind] = EventKind.STEP_END
    instance_id: str
    version: int

    @property
    def key(self) -> str:
        return self.instance_id


@dataclass(frozen=True, slots=True)
class CoreDone:
    """A step on a time-sliced CPU core may have ended (stale if `version` moved on)."""
    KIND: ClassVar[EventKind] = EventKind.CORE_DONE
    core: str
    version: int

    @property
    def key(self) -> str:
        return self.core


@dataclass(frozen=True, slots=True)
class TransferDone:
    """A flow on `link` may have delivered its last byte (stale if `version` moved on)."""
    KIND: ClassVar[EventKind] = EventKind.TRANSFER_DONE
    link: str
    version: int

    @property
    def key(self) -> str:
        return self.link


@dataclass(frozen=True, slots=True)
class _OnLink:
    """A message about a flow or a link: ordered by the link's name."""
    KIND: ClassVar[EventKind] = EventKind.MESSAGE
    link: str

    @property
    def key(self) -> str:
        return self.link


@dataclass(frozen=True, slots=True)
class BeginArrives(_OnLink):
    """Flow `flow_id`'s BEGIN reached its receiver, which answers HAVE. The
    flow carries the prompt's first `blocks` blocks (all if None)."""
    flow_id: str
    started_s: float        # when the flow began: one attempt of `flow_id`
    blocks: int | None
    background: bool


@dataclass(frozen=True, slots=True)
class HaveArrives(_OnLink):
    """The receiver's HAVE reached the sender: the bytes it lacks start to flow."""
    flow_id: str
    started_s: float        # when the flow began: one attempt of `flow_id`
    blocks: int | None
    background: bool


@dataclass(frozen=True, slots=True)
class FlowTailArrives(_OnLink):
    """A transfer streamed ahead of P: its last slice, sent after the
    prefill, reached the receiver."""
    flow_id: str
    num_bytes: float


@dataclass(frozen=True, slots=True)
class CopyFailed(_OnLink):
    """A copy of `request_id`'s KV to `dst_id` failed (the link was down when it began)."""
    request_id: str
    dst_id: str
    error: str


@dataclass(frozen=True, slots=True)
class LinkCut(_OnLink):
    """The link goes down: every copy on it fails."""


@dataclass(frozen=True, slots=True)
class LinkRestored(_OnLink):
    """The link is up again."""


@dataclass(frozen=True, slots=True)
class _ForRequest:
    """A message about one request: ordered by it."""
    KIND: ClassVar[EventKind] = EventKind.MESSAGE
    request_id: str

    @property
    def key(self) -> str:
        return self.request_id


@dataclass(frozen=True, slots=True)
class CancelTaken(_ForRequest):
    """P took the cancel of `request_id`'s copy to `dst_id`: it reports it failed."""
    dst_id: str


@dataclass(frozen=True, slots=True)
class LifecycleWake(_ForRequest):
    """`request_id`'s lifecycle asked to be woken at `at` (a paced handoff's
    next held-back token); stale if it has asked for another time since."""
    at: float


@dataclass(frozen=True, slots=True)
class MdTokensReachRouter(_ForRequest):
    """MD's `count` tokens from `first` on of `request_id` reach the router,
    later than RLD's made at the same time by MD's further way there, from
    the race of an overlap or paced handoff on (their times wait on the
    request, `SimRequest.md_in_flight`); `ends`: MD's stream ends with them."""
    md_id: str
    first: int
    count: int
    ends: bool


@dataclass(frozen=True, slots=True)
class _ToInstance:
    """A message between decoders: ordered by its receiver."""
    KIND: ClassVar[EventKind] = EventKind.MESSAGE
    to_id: str
    request_id: str

    @property
    def key(self) -> str:
        return self.to_id


@dataclass(frozen=True, slots=True)
class MdReadyReachesRld(_ToInstance):
    """MD (`md_id`) admitted the request it holds for a handoff; RLD
    (`to_id`; MD itself without one) hears it at its next step boundary."""
    md_id: str


@dataclass(frozen=True, slots=True)
class ExtendedReachesRld(_ToInstance):
    """MD ran a handoff batch and holds `end` output tokens; RLD (`to_id`)
    hears it at its next step boundary."""
    end: int


@dataclass(frozen=True, slots=True)
class ExtendReachesMd(_ToInstance):
    """A handoff batch of token ids reached MD (`to_id`): it runs there as an
    extend job of `num_tokens` tokens from position `ctx_start`; after it MD
    holds `end` output tokens, and decodes the rest when `final`."""
    num_tokens: int
    ctx_start: int
    final: bool
    end: int


@dataclass(frozen=True, slots=True)
class AheadReachesMd(_ToInstance):
    """RLD's tokens [start, upto) sent ahead of the prompt's KV reached MD
    (`to_id`): kept for its first step if its KV has not landed yet."""
    start: int
    upto: int


class EventLog:
    """One JSON line per processed event: `{"t", "kind", "type", fields...}`,
    plus `"mode"` when given (several modes share one file). Times are
    written exactly (JSON float repr), so equal runs give equal files."""

    def __init__(self, out: TextIO, mode: str | None = None) -> None:
        self.out = out
        self.mode = mode
        self._names: dict[type, tuple[str, ...]] = {}

    def for_mode(self, mode: str) -> EventLog:
        return EventLog(self.out, mode)

    def write(self, time: float, record) -> None:
        cls = type(record)
        names = self._names.get(cls)
        if names is None:
            names = self._names[cls] = tuple(f.name for f in dataclasses.fields(record))
        line = {"t": time, "kind": record.KIND.name, "type": cls.__name__}
        if self.mode is not None:
            line["mode"] = self.mode
        for name in names:
            line[name] = getattr(record, name)
        self.out.write(json.dumps(line) + "\n")
