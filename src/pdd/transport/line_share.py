"""How one KVSender's transfers share a line (`line=` in `KVSender.send`).

A transfer on a named line asks, before each frame it writes: may I write
now, and how fast? A foreground transfer holds the line from HAVE until
its last block is written (not while its source waits for P); a background
copy waits its turn behind them (`priority.LineGate`), keeps the line's
pace (`paces`) and stops yielding when a transfer waiting for HAVE on the
same receiver needs its blocks (priority inheritance). Each transfer also
learns whether it ever shared its line with another.

Kept apart from `kv_sender`, which holds the protocol of one transfer
(BEGIN, HAVE, the blocks, END, and every way it can fail): this is the
state the sender's transfers share with each other, and the rules for it,
which do not depend on what the frames say.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from pdd.transport.priority import SLICE_BYTES, LineGate
from pdd.transport.state import TransferStatus
from pdd.transport.stream import FrameStream

if TYPE_CHECKING:
    from pdd.transport.transfer import TransferHandle

# A paced line's bucket: what a background copy may write at once after a
# pause (four slices: 36 ms at 0.95 of 60 Mbit/s).
PACE_BURST_BYTES = 4 * SLICE_BYTES


class LineShare:
    """The lines one sender's transfers cross: who may write next on each,
    at what pace the background copies go, and which transfers wait for HAVE.

    max_yield_s: a background copy waiting this long since it started goes
    before younger ones (`LineGate`). paces: bytes/s per line at which
    background copies are written, all of them together; a line not named
    (or a pace of 0): as fast as TCP takes them."""

    def __init__(self, max_yield_s: float, paces: dict[str, float] | None) -> None:
        self.gate = LineGate(max_yield_s)
        self.paces = {k: float(v) for k, v in (paces or {}).items() if v and v > 0}
        self._paced_until: dict[str, float] = {}   # line -> when its next background slice may go
        # Transfers waiting for HAVE, per receiver, with their block hashes: a
        # receiver holds HAVE back while another transfer brings it the same
        # blocks, so a background copy that carries blocks a waiting transfer
        # needs must not yield meanwhile (priority inheritance).
        self._awaiting_have: dict[tuple[str, int], list[frozenset]] = {}
        # Transfers past HAVE, per line: each learns whether it ever shared it.
        self._on_line: dict[str, dict[int, TransferStatus]] = {}

    @contextmanager
    def awaiting_have(self, dest: tuple[str, int], hashes: list[bytes]) -> Iterator[None]:
        """While the body runs, a transfer to `dest` with these blocks waits
        for HAVE: copies that carry them write as foreground ones (`awaited`)."""
        waiting = self._awaiting_have.setdefault(dest, [])
        mine = frozenset(hashes)
        waiting.append(mine)
        # a copy already queued on the line may carry blocks this one waits for:
        # it must stop yielding now, not only at its next slice (`awaited`)
        self.gate.wake_all()
        try:
            yield
        finally:
            waiting.remove(mine)
            if not waiting:
                del self._awaiting_have[dest]

    def awaited(self, dest: tuple[str, int], last_hash: bytes) -> bool:
        """A transfer to `dest` waits for HAVE and needs this copy's blocks."""
        return any(last_hash in w for w in self._awaiting_have.get(dest, ()))

    async def write_frame(self, stream: FrameStream, frame: bytes, line: str | None, background: bool,
                          status: TransferStatus, dest: tuple[str, int], last_hash: bytes) -> None:
        """One frame, in one write (so a keepalive WAIT never lands
        inside it); a background one (a slice of at most SLICE_BYTES) after
        the foreground transfers on the line are through, in its turn."""
        held = line is not None and background and not self.awaited(dest, last_hash)
        pace = self.paces.get(line) if held else None
        if held:
            left = status.num_blocks - status.num_blocks_skipped - status.num_blocks_sent + 1
            urgent = lambda: self.awaited(dest, last_hash)  # noqa: E731
            while True:
                status.yielded_s += await self.gate.turn(line, id(status), left, status.started_s, urgent)
                if pace is None or urgent():
                    break
                # the pace's wait holds the turn, so the copies still go one at a
                # time in the gate's order (waiting outside it, they took turns)
                wait = self._paced_until.get(line, 0.0) - time.monotonic()
                if wait <= 0:
                    break
                try:
                    await asyncio.sleep(wait)
                except BaseException:
                    self.gate.release(line, id(status))
                    raise
                if not self.gate.busy(line):
                    break
                self.gate.release(line, id(status))      # a foreground transfer came meanwhile
        try:
            if pace is not None:
                # paced: the line drains faster than this, so nothing of the copy
                # waits in the buffers ahead of it (`pdd.policy.line_order`). A
                # token bucket, not a fixed gap after each slice: a sleep that
                # overran (a busy loop) is made up within PACE_BURST_BYTES, so
                # the copy keeps its pace on average.
                now = time.monotonic()
                due = max(self._paced_until.get(line, 0.0), now - PACE_BURST_BYTES / pace)
                self._paced_until[line] = due + len(frame) / pace
            status.bytes_sent += stream.write(frame)
            await stream.drain()
        finally:
            if held:
                self.gate.release(line, id(status))

    def join(self, line: str, status: TransferStatus) -> None:
        """A transfer is past HAVE on `line`: it and every other one there
        now share the line."""
        members = self._on_line.setdefault(line, {})
        if members:
            status.shared_line = True
            for other in members.values():
                other.shared_line = True
        members[id(status)] = status

    def leave(self, line: str, status: TransferStatus) -> None:
        """The transfer has ended: it no longer counts as on `line`."""
        members = self._on_line.get(line, {})
        members.pop(id(status), None)
        if not members:
            self._on_line.pop(line, None)

    def hold(self, handle: TransferHandle, line: str) -> None:
        """The transfer writes as a foreground one: background copies on the
        line wait until `let_go`."""
        handle.holds_line = line
        self.gate.enter(line)

    def let_go(self, handle: TransferHandle) -> None:
        """The transfer no longer holds its line (if it did)."""
        # At once, not when its bytes can have crossed at the pace: holding the
        # line for what the buffers still held of a transfer starved the copies
        # while transfers a user waits on kept coming (tried in session 16:
        # tests/test_soak.py then left a request on MD after the load).
        if handle.holds_line is not None:
            self.gate.leave(handle.holds_line)
            handle.holds_line = None
