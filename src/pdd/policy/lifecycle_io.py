"""What goes in and out of a `RequestLifecycle`: facts, commands, outcomes.

Facts are what the data plane saw (a stream event, a transfer's end, a
silence past the stall limit, the client leaving), each with the `now` it
was seen at. Commands are what the lifecycle wants done; the driver (the
router's `PddRun`, the simulator) carries them out in the order given and
feeds back what happens as further facts. Both are frozen records, so a run
can be logged and two runs compared command by command.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from pdd.policy.pipeline import Pipeline, PipelineDecision
from pdd.policy.views import InstanceView


class Leg(Enum):
    """Who a stream, a token or a command is about."""
    P = "p"
    RLD = "rld"
    MD = "md"


class Outcome(Enum):
    """How a request was served: the one label of the router's trace and the
    simulator's record (`pipeline`)."""
    DIRECT = "direct"                        # P -> MD
    RELAY = "relay"                          # P -> RLD -> MD (or ended on RLD first)
    RELAY_FILTERED = "relay_filtered"        # the filter kept it off the WAN at routing
    RELAY_CANCELLED = "relay_cancelled"      # the live filter cancelled its WAN copy
    WAN_DOWN = "relay_only"                  # RLD only: no usable MD or WAN
    FAILOVER = "direct_failover_relay"       # DIRECT whose MD failed before a token: an RLD decoded

    @staticmethod
    def of(d: PipelineDecision) -> "Outcome":
        if d.pipeline is Pipeline.DIRECT:
            return Outcome.DIRECT
        if d.pipeline is Pipeline.RELAY:
            return Outcome.RELAY
        return Outcome.RELAY_FILTERED if d.relay_only_by_choice else Outcome.WAN_DOWN


class EndReason(Enum):
    """How a decode stream ended, as its last event says."""
    STOP = "stop"
    LENGTH = "length"
    ERROR = "error"
    ABORT = "abort"
    CLOSED = "closed"        # the stream closed without a `finished` event

    @property
    def normal(self) -> bool:
        return self in (EndReason.STOP, EndReason.LENGTH)


class FinishReason(Enum):
    STOP = "stop"
    LENGTH = "length"
    ERROR = "error"
    CLIENT_GONE = "client_gone"


# --- facts -------------------------------------------------------------------
@dataclass(frozen=True)
class Prefilled:
    now: float
    token: int               # P's first token (index 0)
    stop: bool = False       # it is an end-of-sequence token


@dataclass(frozen=True)
class TransferEnded:
    now: float
    instance_id: str         # the transfer's receiver
    ok: bool
    error: str = ""
    healthy: tuple[InstanceView, ...] = ()    # live RLD/MD, for a failover or a resend


@dataclass(frozen=True)
class PrefillEnded:
    """P's stream is over (after its transfers, or failed)."""
    now: float
    error: str = ""


@dataclass(frozen=True)
class DecodeToken:
    now: float
    leg: Leg                 # RLD or MD
    index: int
    token: int
    rld: InstanceView | None = None    # RLD's load now: the live filter, the handoff mode


@dataclass(frozen=True)
class DecodeTokens:
    """Several tokens of one stream seen at once: `tokens[k]` is index
    `first_index + k`. The simulator's decode steps end at a step boundary
    with one token for every request in the batch, or several for a macro
    step; the live filter then runs once, after the last of them, as the
    simulator's RLD reports its load once per step."""
    now: float
    leg: Leg
    first_index: int
    tokens: tuple[int, ...]
    rld: InstanceView | None = None


@dataclass(frozen=True)
class KvReady:
    """MD holds the prompt KV (its stream's `kv_ready`). `md`: MD's load now
    (its decode step against RLD's chooses an overlap handoff)."""
    now: float
    rld: InstanceView | None = None
    payload_bytes: int | None = None
    md: InstanceView | None = None
    # MD took RLD's tokens sent ahead (`ExtendAhead`) with the KV and decodes
    # on from them: the output tokens it held then (P's first and RLD's);
    # None: MD holds the request for the handoff's batches.
    md_have: int | None = None


@dataclass(frozen=True)
class Extended:
    """MD extended through `upto` tokens (a non-final handoff batch)."""
    now: float
    upto: int


@dataclass(frozen=True)
class DecodeEnded:
    now: float
    leg: Leg
    reason: EndReason
    error: str = ""
    healthy: tuple[InstanceView, ...] = ()


@dataclass(frozen=True)
class PeerGone:
    """A stream that should be producing has been silent past the stall limit
    (the driver asks `watched()` and `policy.stalled`)."""
    now: float
    leg: Leg
    why: str
    healthy: tuple[InstanceView, ...] = ()


@dataclass(frozen=True)
class ClientGone:
    now: float


@dataclass(frozen=True)
class DeadlinePassed:
    now: float


@dataclass(frozen=True)
class Wake:
    """The time the lifecycle asked for (`RequestLifecycle.wake_s`) has come:
    a paced handoff lets RLD's next held-back token out."""
    now: float


Fact = (Prefilled | TransferEnded | PrefillEnded | DecodeToken | DecodeTokens | KvReady | Extended | DecodeEnded
        | PeerGone | ClientGone | DeadlinePassed | Wake)


# --- commands ----------------------------------------------------------------
@dataclass(frozen=True)
class Transfer:
    instance_id: str
    warm_blocks: int = 0     # > 0: only this many prompt blocks, for MD's cache
    background: bool = False  # yields the line to transfers a user waits on (`copy_yields_line`)
    # leaves P while it computes the prompt (layer by layer); False: once the
    # prefill has ended (`PolicyConfig.stream_relay_copy`). A warm push never streams.
    streamed: bool = True


@dataclass(frozen=True)
class StartPrefill:
    p_id: str
    targets: tuple[Transfer, ...]


@dataclass(frozen=True)
class OpenDecode:
    leg: Leg
    instance_id: str
    hold: bool               # MD waits for extends before it streams


@dataclass(frozen=True)
class StartTransfer:
    """P, which still holds the prompt KV, sends it to a new receiver."""
    instance_id: str


@dataclass(frozen=True)
class CancelTransfer:
    instance_id: str
    reason: str


@dataclass(frozen=True)
class ExtendMd:
    instance_id: str
    token_ids: tuple[int, ...]
    final: bool


@dataclass(frozen=True)
class ExtendAhead:
    """RLD's tokens from index `start` on, sent to MD while the prompt's KV
    still crosses the WAN: MD computes them with the prompt's tail in its
    first step once the KV lands and decodes on from there (its kv_ready
    says how many it took, `KvReady.md_have`); one that comes after the
    landing is ignored there."""
    instance_id: str
    start: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class PauseRld:
    """Stop RLD's decode of this request, keeping its KV. `at`: once RLD has
    made `at` output tokens (at once if it already has): sent when a final
    batch is armed, so RLD makes the token the batch goes with and then
    starts no step that MD's extend would have to share the core with.
    None: at once (after the step under way)."""
    instance_id: str
    at: int | None = None


@dataclass(frozen=True)
class ResumeRld:
    instance_id: str


@dataclass(frozen=True)
class Abort:
    leg: Leg
    instance_id: str
    keep_kv: bool = False        # let an incoming KV copy land for the prefix cache
    background: bool = True      # best effort, off the user's path


@dataclass(frozen=True)
class CloseStream:
    leg: Leg


@dataclass(frozen=True)
class ReleaseP:
    p_id: str


@dataclass(frozen=True)
class WanFailed:
    """Tell the WAN estimator a transfer failed."""


@dataclass(frozen=True)
class Emit:
    token: int
    source: Leg
    index: int
    # A paced handoff held this token back: it goes out now, later than it
    # came (the gap before it is the handoff's, `handoff_gap_s`).
    held: bool = False


@dataclass(frozen=True)
class EmitRun:
    """The user's tokens `first_index`, `first_index` + 1, ... from one source:
    a `DecodeTokens` bulk of the stream's owner, in one command (the
    simulator's steps emit millions of tokens)."""
    tokens: tuple[int, ...]
    source: Leg
    first_index: int


@dataclass(frozen=True)
class Note:
    """A trace event (what the router's trace and a decision log record)."""
    event: str
    fields: dict = field(default_factory=dict, compare=True)


@dataclass(frozen=True)
class Finish:
    """The user's stream is over; close every stream but P's while `warming`."""
    outcome: Outcome
    reason: FinishReason
    error: str | None = None


Command = (StartPrefill | OpenDecode | StartTransfer | CancelTransfer | ExtendMd | ExtendAhead | PauseRld | ResumeRld
           | Abort | CloseStream | ReleaseP | WanFailed | Emit | EmitRun | Note | Finish)
