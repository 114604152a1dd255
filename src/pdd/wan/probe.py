"""How much of a yielding copy still crosses the line after it yields.

P's sender pauses a background copy between 64 KB slices while a transfer a
user waits on is on the same line (`pdd.transport.priority`). What the copy
already handed over is beyond its reach: its part of the line's buffer
(the relay's, one per direction: about a bandwidth-delay product, at least
256 KiB) and, on loopback, the sockets' buffers, which the kernel
autotunes to megabytes.
This probe measures it on the emulated line, with the real sender, receiver
and relay: a big background copy streams, a small foreground transfer
starts behind it, and

    lead = (its time behind the copy - its time on the idle line) x line rate

is what crossed ahead of it (the idle-line time holds what every transfer
pays: a connection, its authentication, BEGIN -> HAVE, the END's answer).
The simulator's model of the line takes the result as
`RuntimeOptions.sender_socket_bytes` (the lead less 3/4 of the line's
buffer, what the simulator puts ahead for the buffer).

    python -m pdd.wan.probe --wan-mbps 60 --latency-ms 20 --jitter-ms 5
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass

from pdd.transport.kv_receiver import KVReceiver
from pdd.transport.kv_sender import KVSender
from pdd.wan.pipe import queue_limit_bytes
from pdd.wan.relay import WanLink
from pdd.wan.shaper import MBIT_BYTES_S

_SECRET = "probe"
_BLOCK = 368_640          # one 16-token block of SmolLM2's bf16 KV


@dataclass
class Trial:
    foreground_bytes: int
    elapsed_s: float          # behind the copy
    alone_s: float            # the same transfer on the idle line
    lead_bytes: float


class _Drain:
    """A receiver that keeps nothing."""

    def on_begin(self, request_id, meta, block_hashes):
        return set()

    async def on_block(self, request_id, index, block_hash, payload):
        return None

    def on_end(self, request_id, status):
        return None


def _blocks(n: int, tag: int) -> tuple[list[bytes], list[bytes]]:
    data = [bytes([tag, i % 256]) * (_BLOCK // 2) for i in range(n)]
    return data, [hashlib.blake2b(b, digest_size=16).digest() for b in data]


async def _race(rate_bytes_s: float, latency_s: float, jitter_s: float, fg_blocks: int,
                bg_blocks: int, head_start_s: float) -> float:
    """Seconds the foreground transfer takes; behind a copy streaming for
    `head_start_s` (bg_blocks > 0) or on the idle line (0)."""
    receiver = await KVReceiver.start("127.0.0.1", 0, _SECRET, _Drain())
    link = WanLink(rate_bytes_s=rate_bytes_s, latency_s=latency_s, jitter_s=jitter_s)
    sender = KVSender(_SECRET)
    try:
        port = await link.add_mapping(0, "127.0.0.1", receiver.port)
        copy = None
        if bg_blocks:
            big, big_h = _blocks(bg_blocks, 1)
            copy = sender.send("127.0.0.1", port, "copy", {}, big_h, big, 120, line="wan", background=True)
        await asyncio.sleep(head_start_s)
        small, small_h = _blocks(fg_blocks, 2)
        t0 = time.monotonic()
        status = await sender.send("127.0.0.1", port, "user", {}, small_h, small, 120, line="wan").wait()
        elapsed = time.monotonic() - t0
        if not status.ok:
            raise RuntimeError(f"probe transfer failed: {status.error}")
        if copy is not None:
            copy.cancel("probe done")
        return elapsed
    finally:
        await sender.close()
        await link.close()
        await receiver.close()


async def trial(rate_bytes_s: float, latency_s: float, jitter_s: float, fg_blocks: int,
                bg_blocks: int = 40, head_start_s: float = 1.0) -> Trial:
    """One transfer of `fg_blocks` on the idle line, then one behind a copy
    that has streamed for `head_start_s`, each on a fresh line."""
    alone = await _race(rate_bytes_s, latency_s, jitter_s, fg_blocks, 0, 0.2)
    behind = await _race(rate_bytes_s, latency_s, jitter_s, fg_blocks, bg_blocks, head_start_s)
    return Trial(fg_blocks * _BLOCK, behind, alone, max(0.0, (behind - alone) * rate_bytes_s))


async def probe(rate_bytes_s: float, latency_s: float, jitter_s: float, sizes=(1, 2, 3, 4),
                repeats: int = 3) -> dict:
    trials = [await trial(rate_bytes_s, latency_s, jitter_s, n) for n in sizes for _ in range(repeats)]
    lead = statistics.median(t.lead_bytes for t in trials)
    limit = queue_limit_bytes(rate_bytes_s, latency_s, jitter_s)
    return {"rate_bytes_s": rate_bytes_s, "latency_s": latency_s, "jitter_s": jitter_s,
            "lead_bytes_median": lead, "relay_queue_limit_bytes": limit,
            # what the simulator's line puts ahead beyond 3/4 of the line's buffer
            # (`sim.deployment`: the buffer refills from half to full)
            "sender_socket_bytes": max(0.0, lead - 0.75 * limit), "trials": [asdict(t) for t in trials]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdd.wan.probe", description=__doc__.split("\n\n")[0])
    p.add_argument("--wan-mbps", type=float, default=60.0)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--jitter-ms", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None, help="write the result as JSON here")
    a = p.parse_args(argv)
    res = asyncio.run(probe(a.wan_mbps * MBIT_BYTES_S, a.latency_ms / 1e3, a.jitter_ms / 1e3,
                            repeats=a.repeats))
    for t in res["trials"]:
        print(f"foreground {t['foreground_bytes'] / 1e6:.2f} MB: {t['elapsed_s']:.3f} s behind the copy, "
              f"{t['alone_s']:.3f} s alone: {t['lead_bytes'] / 1e6:.2f} MB of the copy ahead")
    print(f"lead (median) {res['lead_bytes_median'] / 1e6:.2f} MB; relay queue limit "
          f"{res['relay_queue_limit_bytes'] / 1e6:.2f} MB; sender's sockets {res['sender_socket_bytes'] / 1e6:.2f} MB")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
