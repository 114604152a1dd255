"""What the KV transport costs: throughput and CPU per MB at both ends, with and
without mutual TLS and the per-block SHA-256 seal.

    python -m pdd.transport.tls_bench [--mb 256] [--repeat 3] [--dtype bfloat16]
                                      [--wan-mbps 400 --latency-ms 20] [--slices]

Real sockets and the serving path at both ends: the sender (here, as P) reads
each block out of a KV pool tensor as P's engine does (`runner.read_kv_bytes`)
and sends it with `KVSender`; the receiver runs in a child process (as RLD or
MD would), opens sealed blocks (`kv_codec.open_block`) and writes them into a
pool of its own (`runner.write_kv_bytes`), one torch thread, as an instance
does. The emulated WAN is the project's relay (`pdd.wan.relay.WanLink`) in the
sender's process. For each link (loopback, WAN) and variant (plain, seal only,
TLS only, TLS + seal) it prints the median of `--repeat` transfers of `--mb`
MB over a warm pooled connection: payload MB/s, and on loopback the CPU time
per MB of the sending and the receiving process (on the WAN the sender's
process also runs the relay, so its CPU is not shown); and the time of a
one-block transfer over a fresh connection (connect, TLS handshake, the HMAC
challenge-response, BEGIN/HAVE/END). On loopback a fifth variant, `shm`,
takes the same-host path of a datacenter's local line (`transport.shm`): the
blocks through a shared-memory file, one REF frame each on the socket.
`--slices`: the blocks go as a background copy on a named line (64 KB PART
frames, as P's copies to MD), not whole (`shm`: written into the file slice
by slice). The numbers go into docs/DESIGN.md.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

from pdd.engine.kv_codec import open_payload
from pdd.transport.kv_receiver import KVReceiver
from pdd.transport.kv_sender import KVSender
from pdd.transport.tls import TlsFiles, TlsPeer, client_context, issue_deployment_certs, server_context

SECRET = b"bench"
# SmolLM2-135M: K and V, 30 layers, 16 tokens, 3 KV heads x 64
LAYERS, TOKENS, KV_HEADS, HEAD_DIM = 30, 16, 3, 64
POOL_BLOCKS = 64


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _pool(dtype: str):
    import torch

    return torch.zeros(LAYERS, 2, POOL_BLOCKS * TOKENS, KV_HEADS, HEAD_DIM, dtype=getattr(torch, dtype))


def _block(pool, i: int):
    j = i % POOL_BLOCKS
    return pool[:, :, j * TOKENS: (j + 1) * TOKENS]


class _Sink:
    """Opens sealed blocks and writes every block into a pool, as an instance's import does."""

    def __init__(self, dtype: str):
        self.pool = _pool(dtype)
        self.sealed = False

    def on_begin(self, rid, meta, hashes):
        self.sealed = meta.get("block_digest") is not None
        return set()

    def on_block(self, rid, index, block_hash, payload):
        from pdd.engine.runner import write_kv_bytes

        write_kv_bytes(_block(self.pool, index), open_payload(payload, index) if self.sealed else payload)

    def on_end(self, rid, status):
        pass


def _receiver_main(cert_dir: str, use_tls: bool, dtype: str, ports: mp.Queue, asks: mp.Queue,
                   answers: mp.Queue) -> None:
    import torch

    torch.set_num_threads(1)

    async def main():
        ctx = server_context(TlsFiles(Path(cert_dir), "md0")) if use_tls else None
        r = await KVReceiver.start("127.0.0.1", 0, SECRET, _Sink(dtype), tls=ctx, tls_peers=frozenset({"p0"}))
        ports.put(r.port)
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, asks.get):   # the parent asks for our CPU time
            answers.put(_cpu_s())
    asyncio.run(main())


VARIANTS = (("plain", False, False), ("seal", False, True), ("tls", True, False), ("tls+seal", True, True))
SHM_LINE = "local"      # the line a sender takes the same-host path on (as a server's P: `[kv] same_host`)


class _Receiver:
    def __init__(self, ctx, cert_dir: str, use_tls: bool, dtype: str):
        self.ports, self.asks, self.answers = ctx.Queue(), ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=_receiver_main, daemon=True,
                                args=(cert_dir, use_tls, dtype, self.ports, self.asks, self.answers))

    def cpu_s(self) -> float:
        self.asks.put(True)
        return self.answers.get(timeout=60)


async def _one_transfer(sender: KVSender, port: int, read, n: int, rid: str, slices: bool,
                        receiver: _Receiver | None = None) -> tuple[float, float, float]:
    """(payload MB/s, sender CPU ms per MB, receiver CPU ms per MB)."""
    hashes = [os.urandom(16) for _ in range(n)]
    meta = {"block_digest": "sha256"} if sender.seal_blocks else {}
    kw = {"line": "bench", "background": True} if slices else {}
    if sender.shm_line is not None:
        kw = {"line": SHM_LINE, "background": slices, "block_bytes": len(read(0))}
    r0 = receiver.cpu_s() if receiver is not None else 0.0
    c0, t0 = _cpu_s(), time.perf_counter()
    st = await sender.send("127.0.0.1", port, rid, meta, hashes, read, deadline_s=600, **kw).wait()
    wall, cpu = time.perf_counter() - t0, _cpu_s() - c0
    r1 = receiver.cpu_s() if receiver is not None else 0.0
    if not st.ok:
        raise RuntimeError(st.error)
    mb = st.payload_bytes / 1e6
    return mb / wall, cpu / mb * 1e3, (r1 - r0) / mb * 1e3


async def _run(args, receivers: dict[bool, _Receiver], ports: dict[bool, int], cert_dir: Path) -> None:
    import torch

    from pdd.engine.runner import read_kv_bytes
    from pdd.wan.relay import WanLink

    torch.set_num_threads(1)
    pool = _pool(args.dtype).normal_()
    read = lambda i: read_kv_bytes(_block(pool, i))      # noqa: E731
    block_bytes = len(read(0))
    n = max(1, int(args.mb * 1e6) // block_bytes)
    peer = TlsPeer(client_context(TlsFiles(cert_dir, "p0")), "md0")

    def make(use_tls: bool, seal: bool, reuse: bool = True, same_host: bool = False) -> KVSender:
        return KVSender(SECRET, reuse_connections=reuse, seal_blocks=seal, tls=(lambda h, p: peer) if use_tls else None,
                        shm_line=SHM_LINE if same_host else None)

    print(f"{args.dtype} blocks of {block_bytes} B, {n * block_bytes / 1e6:.0f} MB per loopback transfer"
          f"{' in 64 KB slices' if args.slices else ''}, WAN {args.wan_mbps:g} Mbit/s {args.latency_ms:g} ms "
          f"one way, median of {args.repeat}")
    link = WanLink(rate_bytes_s=args.wan_mbps * 1e6 / 8, latency_s=args.latency_ms / 1e3, jitter_s=0)
    try:
        wan_ports = {t: await link.add_mapping(0, "127.0.0.1", p) for t, p in ports.items()}
        for link_name, by_tls in (("loopback", ports), ("wan", wan_ports)):
            count = n if link_name == "loopback" else max(1, n // args.wan_fraction)
            # the same-host path is the local line's only: never across the relay
            variants = VARIANTS + ((("shm", False, True),) if link_name == "loopback" else ())
            senders = {v: make(t, s, same_host=v == "shm") for v, t, s in variants}
            for v, t, _ in variants:      # warm: the timed transfers reuse a pooled connection
                await _one_transfer(senders[v], by_tls[t], read, 1, "warm", args.slices)
            runs: dict[str, list[tuple[float, float, float]]] = {v: [] for v, _, _ in variants}
            fresh: dict[str, list[float]] = {v: [] for v, _, _ in variants}
            for k in range(args.repeat):   # interleaved, so load from other processes hits every variant alike
                for v, t, s in variants:
                    rec = receivers[t] if link_name == "loopback" else None
                    runs[v].append(await _one_transfer(senders[v], by_tls[t], read, count, f"r{k}", args.slices,
                                                       rec))
                    once = make(t, s, reuse=False, same_host=v == "shm")
                    t0 = time.perf_counter()
                    await _one_transfer(once, by_tls[t], read, 1, f"c{k}", False)
                    fresh[v].append(time.perf_counter() - t0)
                    await once.close()
            for v, _, _ in variants:
                await senders[v].close()
                rate, snd, rcv = (statistics.median(x[j] for x in runs[v]) for j in range(3))
                cpu = f"sender {snd:5.2f}  receiver {rcv:5.2f} ms CPU/MB" if link_name == "loopback" else " " * 39
                print(f"{link_name:9s} {v:9s} {rate:8.1f} MB/s  {cpu}  fresh connection + 1 block "
                      f"{statistics.median(fresh[v]) * 1e3:7.1f} ms", flush=True)
    finally:
        await link.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=float, default=256.0, help="KV payload per timed loopback transfer")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--slices", action="store_true", help="send as a background copy: 64 KB PART frames")
    p.add_argument("--wan-mbps", type=float, default=400.0)
    p.add_argument("--latency-ms", type=float, default=20.0, help="one way")
    p.add_argument("--wan-fraction", type=int, default=8, help="the WAN moves mb / this (it is slow)")
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        cert_dir = Path(tmp)
        issue_deployment_certs(cert_dir, ["p0", "md0"])
        receivers = {t: _Receiver(ctx, tmp, t, args.dtype) for t in (False, True)}
        try:
            for r in receivers.values():
                r.proc.start()
            ports = {t: r.ports.get(timeout=60) for t, r in receivers.items()}
            asyncio.run(_run(args, receivers, ports, cert_dir))
        finally:
            for r in receivers.values():
                r.proc.terminate()
                r.proc.join(5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
