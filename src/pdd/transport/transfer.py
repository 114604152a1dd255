"""One KV transfer as the caller of `KVSender.send` sees it: the blocks it
hands over and the handle it gets back.

The blocks come in one of three forms: a list or a per-block function
(`BlockSource`: whole blocks, perhaps awaited while P computes them),
slices as they come to exist (`PartSource`), or a function that writes a
block straight into a buffer (`read_into`, for the same-host path's
shared-memory segment). The sender reads every form the same way, as
(block index, byte offset, block bytes, data) items for the blocks the
receiver lacks; `whole_blocks` and `into_segment` turn the first and last
forms into such items. `TransferHandle` is what the caller polls, waits on
or cancels, and where the sender keeps its own notes on the transfer.

Kept apart from `kv_sender`, whose subject is how a transfer runs (the
frames it writes, the answers it waits for, the ways it fails): these are
its inputs and its outcome, the part of it other modules hold on to.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import AsyncIterator, Awaitable, Callable, Sequence, Union

from pdd.transport import shm
from pdd.transport.state import TransferStatus

BlockSource = Union[Sequence[bytes], Callable[[int], Union[bytes, Awaitable[bytes]]]]
# Streaming in slices: given the blocks the receiver holds, yields
# (block index, byte offset, block bytes, slice) for every other block, each
# block's slices in order from offset 0 (blocks may interleave); None while
# nothing is ready (P still computing), so a foreground transfer lets the
# background ones use the line meanwhile.
PartSource = Callable[[set[int]], AsyncIterator[tuple[int, int, int, bytes]]]


class TransferHandle:
    def __init__(self, status: TransferStatus):
        self.status = status
        self.request_id = status.request_id
        self.task: asyncio.Task | None = None
        self.cancel_reason: str | None = None
        self.holds_line: str | None = None     # foreground on this line until its blocks are written
        self.line: str | None = None
        self.background = False
        self.block_bytes = 0                   # a block's payload size, for the backlog (0: unknown)
        self.segment: shm.OutSegment | None = None   # the same-host path's file, if it took one
        self.read_into: Callable[[int, memoryview], None] | None = None

    def bytes_left(self) -> int:
        st = self.status
        return max(st.num_blocks - st.num_blocks_skipped - st.num_blocks_sent, 0) * self.block_bytes

    def poll(self) -> TransferStatus:
        return self.status.copy()

    @property
    def done(self) -> bool:
        return self.status.done

    async def wait(self) -> TransferStatus:
        if self.task is not None:
            await asyncio.shield(self.task)
        return self.poll()

    def cancel(self, reason: str = "cancelled by caller") -> None:
        """Stop sending; the receiver gets CANCEL and ends the transfer as failed."""
        if self.task is not None and not self.task.done() and self.cancel_reason is None:
            self.cancel_reason = reason
            self.task.cancel()


async def whole_blocks(get_block: Callable, n: int, held: set[int]) -> AsyncIterator[tuple[int, int, int, bytes]]:
    """The blocks the receiver lacks, whole, in order, from a per-block source."""
    for i in range(n):
        if i in held:
            continue
        payload = get_block(i)
        if inspect.isawaitable(payload):
            payload = await payload
        yield i, 0, len(payload), payload


async def into_segment(handle: TransferHandle, seg: "shm.OutSegment", n: int,
                       held: set[int]) -> AsyncIterator[tuple[int, int, int, None]]:
    """The blocks the receiver lacks, each read straight into its slot of the
    segment (slot k for the k-th missing block, as `KVSender._send_blocks`
    numbers them)."""
    bb = handle.block_bytes
    for k, i in enumerate(j for j in range(n) if j not in held):
        with seg.slot(k * bb, bb) as out:
            handle.read_into(i, out)
        yield i, 0, bb, None
