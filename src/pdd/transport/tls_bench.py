"""What mutual TLS and the per-block SHA-256 seal cost the KV transport.

    python -m pdd.transport.tls_bench [--mb 256] [--repeat 3] [--wan-mbps 400 --latency-ms 20]

Real sockets: the receiver runs in a child process (as MD would), the sender
here (as P); the emulated WAN is the project's relay (pdd.wan.relay.WanLink)
in the sender's process. For each link (loopback, WAN) and each variant
(plain, seal only, TLS only, TLS + seal) it prints the median payload throughput of
`--mb` MB of KV blocks over a warm pooled connection, and the time of a
one-block transfer over a fresh connection (connect, TLS handshake, the
HMAC challenge-response, BEGIN/HAVE/END). The numbers go into docs/DESIGN.md.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

from pdd.engine.kv_codec import open_block
from pdd.transport.kv_receiver import KVReceiver
from pdd.transport.kv_sender import KVSender
from pdd.transport.tls import TlsFiles, TlsPeer, client_context, issue_deployment_certs, server_context

SECRET = b"bench"
SMOLLM2_BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4     # K and V, 30 layers, 16 tokens, 3 KV heads x 64, float32


class _Sink:
    """Counts blocks; opens sealed ones, as MD's importer does."""

    def __init__(self):
        self.sealed = False

    def on_begin(self, rid, meta, hashes):
        self.sealed = meta.get("block_digest") is not None
        return set()

    def on_block(self, rid, index, block_hash, payload):
        if self.sealed:
            open_block(payload, index)

    def on_end(self, rid, status):
        pass


def _receiver_main(cert_dir: str, use_tls: bool, ports: mp.Queue) -> None:
    async def main():
        ctx = server_context(TlsFiles(Path(cert_dir), "md0")) if use_tls else None
        r = await KVReceiver.start("127.0.0.1", 0, SECRET, _Sink(), tls=ctx, tls_peers=frozenset({"p0"}))
        ports.put(r.port)
        await asyncio.Event().wait()
    asyncio.run(main())


VARIANTS = (("plain", False, False), ("seal", False, True), ("tls", True, False), ("tls+seal", True, True))


async def _one_transfer_mb_s(sender: KVSender, port: int, blocks: list[bytes], rid: str) -> float:
    t0 = time.perf_counter()
    st = await sender.send("127.0.0.1", port, rid, {}, [os.urandom(16) for _ in blocks], blocks, deadline_s=600).wait()
    if not st.ok:
        raise RuntimeError(st.error)
    return st.payload_bytes / (time.perf_counter() - t0) / 1e6


async def _run(args, ports: dict[bool, int], cert_dir: Path) -> None:
    from pdd.wan.relay import WanLink

    block = os.urandom(args.block_bytes)
    blocks = [block] * max(1, int(args.mb * 1e6) // args.block_bytes)
    peer = TlsPeer(client_context(TlsFiles(cert_dir, "p0")), "md0")

    def make(use_tls: bool, seal: bool, reuse: bool = True) -> KVSender:
        return KVSender(SECRET, reuse_connections=reuse, seal_blocks=seal, tls=(lambda h, p: peer) if use_tls else None)

    link = WanLink(rate_bytes_s=args.wan_mbps * 1e6 / 8, latency_s=args.latency_ms / 1e3, jitter_s=0)
    try:
        wan_ports = {t: await link.add_mapping(0, "127.0.0.1", p) for t, p in ports.items()}
        for link_name, by_tls in (("loopback", ports), ("wan", wan_ports)):
            batch = blocks if link_name == "loopback" else blocks[: max(1, len(blocks) // args.wan_fraction)]
            senders = {v: make(t, s) for v, t, s in VARIANTS}
            for v, t, _ in VARIANTS:      # warm: the timed transfers reuse a pooled connection
                await _one_transfer_mb_s(senders[v], by_tls[t], blocks[:1], "warm")
            rates: dict[str, list[float]] = {v: [] for v, _, _ in VARIANTS}
            fresh: dict[str, list[float]] = {v: [] for v, _, _ in VARIANTS}
            for k in range(args.repeat):   # interleaved, so load from other processes hits every variant alike
                for v, t, s in VARIANTS:
                    rates[v].append(await _one_transfer_mb_s(senders[v], by_tls[t], batch, f"r{k}"))
                    once = make(t, s, reuse=False)
                    t0 = time.perf_counter()
                    await _one_transfer_mb_s(once, by_tls[t], blocks[:1], f"c{k}")
                    fresh[v].append(time.perf_counter() - t0)
                    await once.close()
            for v, _, _ in VARIANTS:
                await senders[v].close()
                print(f"{link_name:9s} {v:9s} {statistics.median(rates[v]):8.1f} MB/s   fresh connection + 1 block "
                      f"{statistics.median(fresh[v]) * 1e3:7.1f} ms", flush=True)
    finally:
        await link.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=256.0, help="KV payload per timed loopback transfer")
    p.add_argument("--block-bytes", type=int, default=SMOLLM2_BLOCK_BYTES)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--wan-mbps", type=float, default=400.0)
    p.add_argument("--latency-ms", type=float, default=20.0, help="one way")
    p.add_argument("--wan-fraction", type=int, default=8, help="the WAN moves mb / this (it is slow)")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        cert_dir = Path(tmp)
        issue_deployment_certs(cert_dir, ["p0", "md0"])
        q = ctx.Queue()
        procs = {t: ctx.Process(target=_receiver_main, args=(tmp, t, q), daemon=True) for t in (False, True)}
        ports = {}
        try:
            for t, proc in procs.items():
                proc.start()
                ports[t] = q.get(timeout=60)
            print(f"block {args.block_bytes} B, {args.mb:g} MB per loopback transfer, WAN {args.wan_mbps:g} Mbit/s "
                  f"{args.latency_ms:g} ms one way, median of {args.repeat}")
            asyncio.run(_run(args, ports, cert_dir))
        finally:
            for proc in procs.values():
                proc.terminate()
                proc.join(5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
