"""FakeLink: the KV transport's contract in memory, driven by a passed-in clock.

Same handler calls as KVReceiver (on_begin -> on_block per block -> exactly
one on_end), same TransferState machine and TransferStatus fields as
KVSender's handles, no sockets, no wall clock: tests and the simulator call
`advance(now)` and everything due by `now` happens. Timeline of a transfer
started at t0 (latency = one-way, rate shared by all transfers on the link):
    t0                 BOOTSTRAPPING
    t0 + latency       BEGIN lands: on_begin -> WAITING
    t0 + 2 latency     HAVE back at the sender -> TRANSFERRING; missing blocks
                       are queued on the shared line (rate None: infinite)
    each block         lands at its serialization end + latency: on_block
    last block + lat.  on_end(SUCCESS) at the receiver; the sender sees SUCCESS
                       one latency later (END ack)
A deadline passing, cancel() or cut() fails the transfer (on_end(FAILED) if begun).
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Sequence

from pdd.transport.frames import HASH_BYTES, HEADER_BYTES
from pdd.transport.state import TransferState, TransferStatus

BLOCK_OVERHEAD_BYTES = HEADER_BYTES + 4 + HASH_BYTES  # same wire size as a real BLOCK frame


class FakeTransfer:
    def __init__(self, status: TransferStatus, hashes: list[bytes], get_block: Callable[[int], bytes], deadline_s: float):
        self.status = status  # sender's view
        self.rx = TransferStatus(status.request_id, TransferState.WAITING, num_blocks=len(hashes), meta=status.meta)
        self.hashes = hashes
        self.get_block = get_block
        self.deadline_s = deadline_s
        self.begun = False
        self.next_s = 0.0  # time of the next event
        self.deliveries: deque[tuple[float, int, bytes]] = deque()  # (land time, index, payload)
        self.missing: list[int] = []

    def poll(self) -> TransferStatus:
        return self.status.copy()

    @property
    def done(self) -> bool:
        return self.status.done


class FakeLink:
    def __init__(self, handler, *, rate_bytes_s: float | None = None, latency_s: float = 0.0):
        self.handler = handler
        self.rate_bytes_s = rate_bytes_s
        self.latency_s = latency_s
        self.line_free_s = 0.0  # when the shared line finishes serializing what is queued
        self.num_bytes_sent = 0
        self._transfers: list[FakeTransfer] = []

    def send(self, now: float, request_id: str, meta: dict, block_hashes: list[bytes],
             get_block: Sequence[bytes] | Callable[[int], bytes], deadline_s: float = 60.0) -> FakeTransfer:
        if not callable(get_block):
            get_block = list(get_block).__getitem__
        status = TransferStatus(request_id, num_blocks=len(block_hashes), started_s=now, meta=dict(meta))
        transfer = FakeTransfer(status, list(block_hashes), get_block, deadline_s)
        transfer.rx.started_s = now
        transfer.next_s = now + self.latency_s
        self._transfers.append(transfer)
        return transfer

    def cancel(self, transfer: FakeTransfer, now: float, reason: str = "cancelled by caller") -> None:
        transfer.status.cancelled = transfer.rx.cancelled = True
        self._fail(transfer, now, f"cancelled: {reason}", f"cancelled by sender: {reason}")

    def cut(self, now: float, reason: str = "link cut") -> None:
        for transfer in list(self._transfers):
            self._fail(transfer, now, f"connection lost: {reason}", f"connection lost: {reason}")

    def advance(self, now: float) -> None:
        for transfer in list(self._transfers):
            self._advance(transfer, now)
        self._transfers = [t for t in self._transfers if not t.done]

    def _advance(self, t: FakeTransfer, now: float) -> None:
        deadline = t.status.started_s + t.deadline_s
        while not t.done and t.next_s <= min(now, deadline):
            if not t.begun:
                self._begin(t)
            elif t.status.state == TransferState.WAITING:
                self._have(t)
            elif t.deliveries:
                land_s, index, payload = t.deliveries.popleft()
                self.handler.on_block(t.rx.request_id, index, t.hashes[index], payload)
                t.rx.num_blocks_sent += 1
                t.rx.payload_bytes += len(payload)
                t.rx.bytes_received += len(payload) + BLOCK_OVERHEAD_BYTES
                t.next_s = t.deliveries[0][0] if t.deliveries else land_s  # END lands with the last block
            elif t.rx.state != TransferState.SUCCESS:
                t.rx.succeed(t.next_s)
                self.handler.on_end(t.rx.request_id, t.rx.copy())
                t.next_s += self.latency_s  # the END ack travels back
            else:
                t.status.succeed(t.next_s)
        if not t.done and now >= deadline:
            msg = f"deadline of {t.deadline_s} s exceeded while {t.status.state.name}"
            self._fail(t, deadline, msg, "transfer deadline passed")

    def _begin(self, t: FakeTransfer) -> None:
        t.begun = True
        t.status.state = TransferState.WAITING
        held = self.handler.on_begin(t.rx.request_id, dict(t.rx.meta), list(t.hashes)) or set()
        held = {i for i in held if 0 <= i < len(t.hashes)}
        t.status.num_blocks_skipped = t.rx.num_blocks_skipped = len(held)
        t.rx.state = TransferState.TRANSFERRING
        t.missing = [i for i in range(len(t.hashes)) if i not in held]
        t.next_s += self.latency_s

    def _have(self, t: FakeTransfer) -> None:
        t.status.state = TransferState.TRANSFERRING
        start_s = max(self.line_free_s, t.next_s)
        for index in t.missing:
            payload = bytes(t.get_block(index))
            wire_bytes = len(payload) + BLOCK_OVERHEAD_BYTES
            if self.rate_bytes_s:
                start_s += wire_bytes / self.rate_bytes_s
            t.deliveries.append((start_s + self.latency_s, index, payload))
            t.status.num_blocks_sent += 1
            t.status.payload_bytes += len(payload)
            t.status.bytes_sent += wire_bytes
            self.num_bytes_sent += wire_bytes
        self.line_free_s = start_s
        # nothing missing: the END sent right after HAVE lands one latency later
        t.next_s = t.deliveries[0][0] if t.deliveries else t.next_s + self.latency_s

    def _fail(self, t: FakeTransfer, now: float, error: str, rx_error: str) -> None:
        if t.done:
            return
        t.status.fail(error, now)
        if t.begun and not t.rx.done:
            t.rx.fail(rx_error, now)
            self.handler.on_end(t.rx.request_id, t.rx.copy())
