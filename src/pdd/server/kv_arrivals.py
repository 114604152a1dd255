"""The decode side's incoming prompt KV, one record per request: the KV
receiver's handler (BEGIN -> HAVE, BLOCK, END) and what the decode call
waits on.

A transfer and the decode call that consumes it may come in either order:
whichever comes first creates the request's KVArrival, the other completes
or awaits it. A record nobody claims (a warm push, a copy whose request is
gone) lands in the prefix cache and is unpinned at its END; one never
claimed nor ended expires after 2 x kv_deadline_s.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdd.deploy.spec import DeploymentSpec
from pdd.engine.engine import Engine
from pdd.engine.kv_codec import BLOCK_DIGEST, KVImportError, open_payload
from pdd.policy import PolicyConfig, wait_for_siblings
from pdd.server.engine_loop import EngineLoop
from pdd.server.instance_metrics import InstanceMetrics
from pdd.server.tasks import spawn
from pdd.transport.state import TransferStatus

EXPIRY_SWEEP_S = 5.0


@dataclass
class KVArrival:
    """One request's incoming prompt KV (decode side)."""
    done: asyncio.Future
    created_s: float = field(default_factory=time.monotonic)
    importer: object | None = None
    status: TransferStatus | None = None
    hashes: list = field(default_factory=list)       # the transfer's block hashes (BEGIN)
    skipped: set = field(default_factory=set)        # indices this receiver already held (HAVE)
    landed: set = field(default_factory=set)         # indices whose blocks are in the pool
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    warm: bool = False            # a prefix pushed to warm the cache: no request consumes it
    claimed: bool = False         # a decode call waits for it (under its own timeout: never expired)
    ahead: list = field(default_factory=list)    # the relay's tokens from index 1, sent ahead (`add_ahead`)


class KVArrivals:
    """Every request's KVArrival on one decoding instance; the KVReceiver's handler."""

    def __init__(self, spec: DeploymentSpec, engine: Engine, policy: PolicyConfig,
                 metrics: InstanceMetrics):
        self.spec, self.engine, self.policy, self.metrics = spec, engine, policy, metrics
        self.kv_reuse = policy.enable_drc
        self.loop: EngineLoop | None = None          # set when the instance starts
        self.after_transfer = lambda: None            # the instance's `trim_if_quiet`
        self.by_id: dict[str, KVArrival] = {}
        self._cleanups: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self.by_id)

    @property
    def importing(self) -> bool:
        """A transfer is landing blocks now."""
        return any(a.importer is not None and not a.ended.is_set() for a in self.by_id.values())

    def get(self, rid: str) -> KVArrival:
        """The request's record, created if neither its transfer nor its decode call came yet."""
        a = self.by_id.get(rid)
        if a is None:
            a = self.by_id[rid] = KVArrival(asyncio.get_running_loop().create_future())
        return a

    def add_ahead(self, rid: str, start: int, token_ids: list[int]) -> int | None:
        """The relay's tokens from output index `start` on, for a decode call
        that waits for its KV: kept for the request's first step. The output
        tokens held then (P's first, then these), or None when no decode call
        waits here (not come yet, or its KV landed and it runs: nothing is
        taken). A `start` past what is held takes nothing."""
        a = self.by_id.get(rid)
        if a is None or not a.claimed:
            return None
        if 1 <= start <= 1 + len(a.ahead):
            a.ahead[start - 1:] = token_ids
        return 1 + len(a.ahead)

    def consumed(self, rid: str) -> None:
        """The decode call took the KV: the request's pins are its own now."""
        self.by_id.pop(rid, None)

    def _close_import(self, a: KVArrival) -> None:
        """Blocks reserved for what never landed go back to the pool."""
        close = getattr(a.importer, "close", None)   # the vLLM server's staging has none
        if close is not None:
            self.loop.call_now(lambda e: close())

    def drop(self, rid: str) -> None:
        a = self.by_id.pop(rid, None)
        if a is not None:
            a.ended.set()
            self._close_import(a)
        if a is not None and not a.done.done():
            a.done.set_exception(RuntimeError("aborted"))
            a.done.exception()  # mark retrieved
        asyncio.get_running_loop().create_task(self.loop.call(lambda e: e._release_pins(rid)))

    def let_land(self, rid: str, why: str) -> None:
        """The request is gone: a transfer still landing for it finishes as a
        warm push into the prefix cache (unpinned at its END); otherwise the
        arrival is dropped now. One whose BEGIN has not come yet is dropped
        too: when it comes, no decode call waits for it, and such a copy is
        also unpinned at its END, its blocks left in the cache."""
        a = self.by_id.get(rid)
        if a is not None and a.importer is not None and a.status is None:
            a.warm = True
            if not a.done.done():
                a.done.set_exception(RuntimeError(why))
                a.done.exception()  # mark retrieved
        else:
            self.drop(rid)

    # -- DRC: blocks already on their way ---------------------------------------------
    def _siblings_bringing(self, request_id: str, wanted: set[bytes]) -> tuple[int, list[KVArrival]]:
        """(how many of the `wanted` hashes, those this receiver lacks, are on
        their way in another transfer, those transfers)."""
        wanted = set(wanted)
        count, siblings = 0, []
        for rid, b in self.by_id.items():
            if rid == request_id or b.importer is None or b.status is not None:
                continue
            coming = {h for i, h in enumerate(b.hashes) if i not in b.skipped and i not in b.landed} & wanted
            if coming:
                count += len(coming)
                wanted -= coming
                siblings.append(b)
        return count, siblings

    async def _wait_for_siblings(self, request_id: str, hashes: list[bytes]) -> None:
        """DRC under a slow line: when most of what this transfer lacks is
        already on its way in another one (the previous turn of the same
        conversation, say), answer HAVE only once that one has ended, so the
        same blocks do not cross the WAN twice. As long as it takes: a queued
        sibling is not a dead one (it ends, landed or failed, within its
        request's deadline; a failed one only means the blocks are sent after
        all), and meanwhile this side says it is alive (WAIT). A fixed bound
        (half the 60 s KV deadline, until session 13) let every turn of a
        conversation whose first copy queued longer than that resend what the
        first copy was still bringing: under overload the line's backlog fed
        on itself (results/overload-13). The simulator waits the same way."""
        if not self.kv_reuse:
            return
        # Looked at again after every wake-up: a sibling may end with part of
        # its blocks landed (failed, cancelled), and then the transfers that
        # waited on it all lack the same rest; the first to look again begins
        # (its blocks now on their way) and the others wait on it, instead of
        # each sending the rest (results/overload-s29: eleven turns of one
        # conversation sent the same 20 blocks). The simulator does the same.
        deadline = time.monotonic() + self.spec.request_timeout_s
        while True:
            lacking = {h for h in hashes if not self.engine.pool.holds(h)}
            coming, siblings = self._siblings_bringing(request_id, lacking)
            left = deadline - time.monotonic()
            if not siblings or not wait_for_siblings(len(lacking), coming, self.policy) or left <= 0:
                return
            waits = [asyncio.ensure_future(b.ended.wait()) for b in siblings]
            done, pending = await asyncio.wait(waits, timeout=left)
            for w in pending:
                w.cancel()
            if pending:
                return

    # -- the receiver's handler --------------------------------------------------------
    async def on_begin(self, request_id: str, meta: dict, block_hashes: list[bytes]) -> set[int]:
        if meta.get("block_digest") != BLOCK_DIGEST:
            # Without the per-block seal a block altered before or after the wire could not be told apart.
            raise KVImportError(f"KV blocks must be sealed with {BLOCK_DIGEST} (got {meta.get('block_digest')!r})")
        a = self.get(request_id)
        a.warm = bool(meta.get("warm"))
        a.hashes = list(block_hashes)
        await self._wait_for_siblings(request_id, a.hashes)
        if self.by_id.get(request_id) is not a:
            # The decode call left while we waited (its arrival was dropped):
            # land it as a warm push, unpinned at its END, instead of leaving
            # pins that no request and no record would ever release.
            a.warm = True
            self.by_id[request_id] = a

        def begin(e: Engine) -> set[int]:
            a.importer = e.begin_import(meta, block_hashes, pin_for=request_id)
            held = e.held_block_indices(block_hashes) if self.kv_reuse else set()
            for i in sorted(held):                    # pin what we have so it cannot be evicted meanwhile
                block = e.pool.hash_to_block[block_hashes[i]]
                e.pool.acquire([block])
                e._pin(request_id, block)
            a.importer.reserve(i for i in range(len(block_hashes)) if i not in held)
            return held

        # The pool lock, not the engine thread: HAVE goes back while a step
        # runs, instead of after it (up to a whole prefill chunk).
        a.skipped = self.loop.call_now(begin)
        return a.skipped

    async def on_block(self, request_id: str, index: int, block_hash: bytes, payload: bytes) -> None:
        a = self.by_id.get(request_id)
        if a is None or a.importer is None:
            raise KVImportError(f"no transfer begun for {request_id}")
        # The import check: from here to the pool the bytes are an immutable
        # object, so what passes is what the sender read. A mismatch fails the
        # transfer (the receiver answers ERROR), so the request takes the
        # policy's failure path instead of decoding on altered KV. A block from
        # a same-host segment is read from it once, straight into the pool
        # (below, before this returns).
        payload = open_payload(payload, index)
        # Into the pool as it lands, during the engine's step: at END every
        # block is already there, so a transfer costs no wait for a step.
        self.loop.call_now(lambda e: a.importer.add_block(index, payload))
        a.landed.add(index)

    async def on_end(self, request_id: str, status: TransferStatus) -> None:
        a = self.by_id.get(request_id)
        if a is None:
            return
        a.status = status
        a.ended.set()
        self._close_import(a)
        self.metrics.on_kv_received(status)
        self._settle(request_id, a, status)
        # The heap's trim (~2 ms) after the waiter has run: a decode call
        # answered above submits its request first, and the trim then finds
        # the engine busy and skips.
        asyncio.get_running_loop().call_soon(self.after_transfer)

    def _settle(self, request_id: str, a: KVArrival, status: TransferStatus) -> None:
        if a.warm:
            # The blocks stay in the prefix cache (committed as they landed);
            # nothing waits for them, so unpin now rather than at expiry.
            self.drop(request_id)
            return
        if not a.done.done():
            if status.ok:
                a.done.set_result(status)
            else:
                a.done.set_exception(RuntimeError(f"KV transfer failed: {status.error}"))
        if not status.ok or not a.claimed:
            # A broken copy feeds no request (a decode call waiting, or one
            # still to come, gets the error); a copy no decode call waits for
            # (its caller left before it began, or never reached us) may feed
            # none. Unpin now, not at the record's expiry: the blocks stay in
            # the prefix cache, so a decode call that does come late still
            # finds them (or, if evicted meanwhile, recomputes them).
            spawn(self.loop.call(lambda e: e._release_pins(request_id)), self._cleanups)

    async def expire_forever(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_SWEEP_S)
            now = time.monotonic()
            for rid, a in list(self.by_id.items()):
                # A decode call may wait longer than this for its KV while P's
                # queue is long (overload): its own timeout governs it.
                if (not a.claimed and now - a.created_s > self.spec.kv_deadline_s * 2
                        and rid not in self.engine.requests):
                    self.drop(rid)
