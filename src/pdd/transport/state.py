"""Transfer progress as a small ordered enum, polled without blocking.

Lifecycle of one transfer (either side):
    BOOTSTRAPPING (connecting, authenticating)
      -> WAITING (BEGIN sent/received, waiting for the HAVE reply)
      -> TRANSFERRING (missing blocks on the wire)
      -> SUCCESS (receiver acknowledged END)
    any state -> FAILED (error says why: deadline, cancel, corrupt frame, peer gone, auth)
The order matters: `state >= TransferState.TRANSFERRING` reads "past the handshake".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import IntEnum


class TransferState(IntEnum):
    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING = 2
    TRANSFERRING = 3
    SUCCESS = 4


@dataclass
class TransferStatus:
    request_id: str = ""
    state: TransferState = TransferState.BOOTSTRAPPING
    num_blocks: int = 0  # blocks named in BEGIN
    num_blocks_sent: int = 0  # BLOCK frames written (sender) or landed (receiver)
    num_blocks_skipped: int = 0  # blocks the receiver already held (HAVE)
    bytes_sent: int = 0  # wire bytes of this transfer's frames written (sender)
    bytes_received: int = 0  # wire bytes of this transfer's frames read (receiver)
    payload_bytes: int = 0  # block payload bytes sent (sender) or received (receiver)
    error: str = ""
    cancelled: bool = False
    started_s: float = 0.0  # time.monotonic()
    finished_s: float | None = None
    # BEGIN -> HAVE (sender): a round trip, plus the time the receiver held
    # its answer back while another transfer brought it the same blocks.
    handshake_s: float = 0.0
    # Sender, background transfers: time spent waiting for foreground ones on
    # the same line (`pdd.transport.priority`); not the line's speed.
    yielded_s: float = 0.0
    # Sender, streamed transfers: time spent waiting for blocks (or the END's
    # meta) that the producer had not computed yet; not the line's speed either.
    waited_s: float = 0.0
    # Sender, on a named line: another transfer of this sender was sending on
    # the same line at some point between this one's HAVE and its end, so its
    # time says how the line was shared, not how fast it is.
    shared_line: bool = False
    meta: dict = field(default_factory=dict)

    @property
    def done(self) -> bool:
        return self.state in (TransferState.SUCCESS, TransferState.FAILED)

    @property
    def ok(self) -> bool:
        return self.state == TransferState.SUCCESS

    @property
    def elapsed_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.started_s

    def fail(self, error: str, now_s: float) -> None:
        """First failure wins; a finished transfer is never reopened."""
        if self.done:
            return
        self.state = TransferState.FAILED
        self.error = error
        self.finished_s = now_s

    def succeed(self, now_s: float) -> None:
        if self.done:
            return
        self.state = TransferState.SUCCESS
        self.finished_s = now_s

    def copy(self) -> "TransferStatus":
        return dataclasses.replace(self, meta=dict(self.meta))
