"""Mutual TLS on the WAN and the end-to-end KV checksum, over real sockets
and real deployments.

The deployment tests replace the WAN relay process by a test-only tap (same
ports, plain byte forwarding, unshaped) that records every byte crossing the
WAN and can alter them: a frame-aware forger that flips a byte inside a KV
block and re-encodes the frame with the transport's own encoder (valid
CRC), or a raw flip of one byte of the TLS stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import ssl
import struct
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp
import openai
import pytest

from deploy_helpers import deployment_toml
from pdd.deploy.launcher import Deployment
from pdd.deploy.spec import ROUTER_CERT_NAME, SpecError, TlsMode, load_spec
from pdd.deploy.topology import address, relay_mappings
from pdd.engine.kv_codec import DIGEST_BYTES, KVImportError, open_block, seal_block
from pdd.model.reference import generate_greedy
from pdd.model.tokenizer import Tokenizer
from pdd.server.wire import InternalCallError, InternalClient
from pdd.transport import tls
from pdd.transport.frames import HEADER_BYTES, Block, FrameDecoder, FrameType, Part, encode_frame
from pdd.transport.kv_receiver import KVReceiver
from pdd.transport.kv_sender import KVSender
from pdd.transport.state import TransferState

SECRET = "s"


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


# -- in-process: the transport over mutual TLS ----------------------------------------
class Sink:
    def __init__(self):
        self.blocks: dict[int, bytes] = {}
        self.status = None

    def on_begin(self, rid, meta, hashes):
        return set()

    def on_block(self, rid, i, h, payload):
        self.blocks[i] = payload

    def on_end(self, rid, status):
        self.status = status


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    tls.issue_deployment_certs(d / "ours", ["p0", "md0", ROUTER_CERT_NAME])
    tls.issue_deployment_certs(d / "other", ["p0", "md0", ROUTER_CERT_NAME])   # same names, another CA
    return d


def peer(certs: Path, ca: str, me: str, them: str) -> tls.TlsPeer:
    return tls.TlsPeer(tls.client_context(tls.TlsFiles(certs / ca, me)), them)


def transfer(certs: Path, client: tls.TlsPeer | None, server_ca: str = "ours", server_name: str = "md0"):
    async def main():
        sink = Sink()
        receiver = await KVReceiver.start(
            "127.0.0.1", 0, SECRET, sink, tls=tls.server_context(tls.TlsFiles(certs / server_ca, server_name)),
            tls_peers=frozenset({"p0"}), auth_timeout_s=2.0)
        sender = KVSender(SECRET, tls=lambda host, port: client, seal_blocks=True, connect_timeout_s=2.0)
        blocks = [os.urandom(4096) for _ in range(3)]
        try:
            st = await sender.send("127.0.0.1", receiver.port, "r", {}, [os.urandom(16) for _ in blocks],
                                   blocks, deadline_s=5).wait()
        finally:
            await sender.close()
            await receiver.close()
        return st, sink, blocks, receiver.stats
    return asyncio.run(asyncio.wait_for(main(), 20))


def test_kv_transfer_over_mutual_tls_carries_sealed_blocks(certs):
    st, sink, blocks, _ = transfer(certs, peer(certs, "ours", "p0", "md0"))
    assert st.state == TransferState.SUCCESS, st.error
    assert [open_block(sink.blocks[i], i) for i in range(3)] == blocks
    assert st.payload_bytes == 3 * 4096


def test_peer_with_a_certificate_from_another_ca_is_refused(certs):
    # a sender whose certificate another CA signed (same name): the receiver refuses the handshake
    st, sink, _, stats = transfer(certs, peer(certs, "other", "p0", "md0"))
    assert st.state == TransferState.FAILED and "TLS" in st.error and not sink.blocks
    assert stats.num_transfers == 0
    # a receiver whose certificate another CA signed: the sender refuses to send
    st, sink, _, _ = transfer(certs, peer(certs, "ours", "p0", "md0"), server_ca="other")
    assert st.state == TransferState.FAILED and "certificate" in st.error and "TLS" in st.error, st.error
    assert not sink.blocks


def test_certificate_of_the_wrong_name_is_refused_on_both_ends(certs):
    # our CA, but the receiver is not the instance the sender meant to reach
    st, sink, _, _ = transfer(certs, peer(certs, "ours", "p0", "md0"), server_name="p0")
    assert st.state == TransferState.FAILED and "hostname mismatch" in st.error.lower(), st.error
    # our CA, but the sender's certificate names no prefill instance (the router's)
    st, sink, _, stats = transfer(certs, peer(certs, "ours", ROUTER_CERT_NAME, "md0"))
    assert st.state == TransferState.FAILED and not sink.blocks and stats.num_auth_failures == 1
    # plain TCP to a TLS port gets nowhere
    st, sink, _, stats = transfer(certs, None)
    assert st.state == TransferState.FAILED and stats.num_transfers == 0


def test_sealed_block_altered_anywhere_fails_its_checksum():
    block = os.urandom(1000)
    sealed = bytearray(seal_block(block))
    assert open_block(bytes(sealed), 0) == block
    for pos in (0, DIGEST_BYTES - 1, DIGEST_BYTES, len(sealed) - 1):   # digest or payload
        bad = bytearray(sealed)
        bad[pos] ^= 0x01
        with pytest.raises(KVImportError, match="SHA-256"):
            open_block(bytes(bad), 7)


class Importer(Sink):
    """Opens sealed blocks as MD's on_block does."""

    def on_block(self, rid, i, h, payload):
        self.blocks[i] = open_block(payload, i)


def test_forged_sealed_block_is_refused_and_the_sender_stops_with_the_reason(certs):
    async def main():
        importer = Importer()
        receiver = await KVReceiver.start("127.0.0.1", 0, SECRET, importer)
        blocks = [seal_block(os.urandom(65536)) for _ in range(400)]
        forged = bytearray(blocks[1])
        forged[-1] ^= 0x01
        blocks[1] = bytes(forged)   # CRC of its frame computed by the encoder: valid
        sender = KVSender(SECRET)   # blocks pre-sealed by the test
        try:
            st = await sender.send("127.0.0.1", receiver.port, "r", {"block_digest": "sha256"},
                                   [os.urandom(16) for _ in blocks], blocks, deadline_s=10).wait()
        finally:
            await sender.close()
            await receiver.close()
        return st, importer
    st, importer = asyncio.run(asyncio.wait_for(main(), 20))
    assert st.state == TransferState.FAILED
    assert "receiver failed transfer" in st.error and "SHA-256" in st.error, st.error
    assert list(importer.blocks) == [0] and not importer.status.ok
    assert st.num_blocks_sent < 200          # it stopped on the ERROR (~60 here: the socket buffers), not at 400


def test_tls_placement_follows_the_datacenters(tmp_path, tiny_model_dir):
    path = tmp_path / "d.toml"
    path.write_text(deployment_toml("pdd", tiny_model_dir))
    spec = load_spec(path)
    byname = {i.name: i for i in spec.instances}
    assert [tls.http_tls(spec, byname[n]) for n in ("p0", "rld0", "md0")] == [False, False, True]
    assert [tls.kv_tls(spec, byname[n]) for n in ("p0", "rld0", "md0")] == [False, False, True]
    every = load_spec(path, {"tls": {"mode": "all"}})
    assert all(tls.http_tls(every, i) for i in every.instances)
    off = load_spec(path, {"tls": {"mode": "off"}})
    assert off.tls.mode == TlsMode.OFF and not tls.uses_tls(off)
    assert load_spec(path, {"tls": {"dir": "certs"}}).tls.dir == tmp_path / "certs"   # beside the file
    with pytest.raises(SpecError, match="tls.mode"):
        load_spec(path, {"tls": {"mode": "sometimes"}})
    doc = path.read_text().replace('name = "md0"', 'name = "router"')
    path.write_text(doc)
    with pytest.raises(SpecError, match="certificate names"):
        load_spec(path)
    assert load_spec(path, {"tls": {"mode": "off"}}).instance("router").role.value == "main"


# -- deployments behind a test-only WAN tap -----------------------------------------------
class Tap:
    """Forwards the relay's mappings byte for byte (A->B and B->A) and records them.
    forge_kv: flip a byte inside the first KV BLOCK (or PART slice) payload and
    re-encode the frame (CRC valid). flip_kv_at: flip the A->B KV byte at this stream offset."""

    def __init__(self, mappings, kv_ports: set[int], forge_kv: bool = False, flip_kv_at: int | None = None):
        self.mappings, self.kv_ports = mappings, kv_ports
        self.forge_kv, self.flip_kv_at = forge_kv, flip_kv_at
        self.a_to_b: dict[int, bytearray] = {lp: bytearray() for lp, _, _ in mappings}
        self.b_to_a: dict[int, bytearray] = {lp: bytearray() for lp, _, _ in mappings}
        self.num_forged = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.servers = []
        self.tasks: set[asyncio.Task] = set()

    def __enter__(self) -> "Tap":
        self.thread.start()
        assert self.ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        async def down():
            for s in self.servers:
                s.close()
            for t in self.tasks:
                t.cancel()
            await asyncio.gather(*self.tasks, return_exceptions=True)
        asyncio.run_coroutine_threadsafe(down(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def up():
            for lp, host, tp in self.mappings:
                self.servers.append(await asyncio.start_server(
                    lambda r, w, lp=lp, host=host, tp=tp: self._relay(r, w, lp, host, tp), "127.0.0.1", lp))
        self.loop.run_until_complete(up())
        self.ready.set()
        self.loop.run_forever()
        self.loop.close()

    async def _relay(self, cr, cw, lp, host, tp) -> None:
        self.tasks.add(asyncio.current_task())
        try:
            sr, sw = await asyncio.open_connection(host, tp)
        except OSError:
            cw.close()
            return
        alter = self._forger() if lp in self.kv_ports else None
        try:
            await asyncio.gather(self._pump(cr, sw, self.a_to_b[lp], alter),
                                 self._pump(sr, cw, self.b_to_a[lp], None), return_exceptions=True)
        finally:
            cw.close()
            sw.close()

    async def _pump(self, reader, writer, log: bytearray, alter) -> None:
        try:
            while data := await reader.read(1 << 16):
                log += data
                writer.write(alter(data) if alter else data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()      # FIN forwarded, the other direction stays open (as the relay does)
        except (ConnectionError, OSError):
            writer.transport.abort()    # a reset on one side resets the other

    def _forger(self):
        buf, seen = bytearray(), [0]

        def alter(data: bytes) -> bytes:
            if self.flip_kv_at is not None:
                start, seen[0] = seen[0], seen[0] + len(data)
                if start <= self.flip_kv_at < seen[0]:
                    data = bytearray(data)
                    data[self.flip_kv_at - start] ^= 0x01
                    self.num_forged += 1
                return bytes(data)
            if not self.forge_kv:
                return data
            buf.extend(data)   # whole frames only, so a BLOCK can be re-encoded
            out = bytearray()
            while len(buf) >= HEADER_BYTES:
                _, _, ftype, _, length, _ = struct.unpack_from(">4sBBHII", buf)
                if len(buf) < HEADER_BYTES + length:
                    break
                frame = bytes(buf[:HEADER_BYTES + length])
                del buf[:HEADER_BYTES + length]
                if ftype in (FrameType.BLOCK, FrameType.PART) and self.num_forged == 0:
                    # A whole block, or (P streams layer by layer) a slice of one:
                    # flip a byte of its KV, past the slice's head and digest.
                    payload = bytearray(frame[HEADER_BYTES:])
                    start = 0
                    if ftype == FrameType.PART:
                        start = 29 + (32 if payload[28] & 1 else 0)   # index, hash, offset, total, flags
                    payload[start + (len(payload) - start) // 2] ^= 0x01
                    frame = encode_frame(ftype, bytes(payload))   # CRC recomputed: valid
                    self.num_forged += 1
                out += frame
            return bytes(out)
        return alter

    def all_bytes(self) -> bytes:
        return b"".join(bytes(b) for b in (*self.a_to_b.values(), *self.b_to_a.values()))


def start(tmp_path_factory, model_dir, mode: str, tls_mode: str, **kw) -> Deployment:
    d = tmp_path_factory.mktemp(f"{mode}-{tls_mode}")
    path = d / "deploy.toml"
    path.write_text(deployment_toml(mode, model_dir, **kw) + f'\n[tls]\nmode = "{tls_mode}"\n')
    return Deployment.start(path, run_dir=d / "run", timeout_s=180)


@contextlib.contextmanager
def swap_relay_for_tap(dep: Deployment, **kw):
    wan = next(p for p in dep.procs if p.name == "wan0")
    os.killpg(wan.pid, signal.SIGTERM)
    for _ in range(100):
        try:
            os.kill(wan.pid, 0)
        except ProcessLookupError:
            break
        try:
            os.waitpid(wan.pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    mappings = relay_mappings(dep.spec, dep.spec.links[0])
    kv_ports = {lp for lp, _, tp in mappings if tp in {i.kv_port for i in dep.spec.instances}}
    with Tap(mappings, kv_ports, **kw) as tap:
        wait_all_healthy(dep)     # the router saw MD down while the relay was gone
        yield tap


def wait_all_healthy(dep: Deployment, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"http://{dep.spec.router_host}:{dep.spec.router_port}/health",
                                        timeout=10) as r:
                health = json.loads(r.read())
        except urllib.error.HTTPError as e:     # a degraded router may answer 503
            health = json.loads(e.read())
        if not health["down"]:
            return
        assert time.monotonic() < deadline, health
        time.sleep(0.2)


def complete(dep: Deployment, prompt: list[int], n: int) -> tuple[str, dict]:
    client = openai.OpenAI(base_url=dep.router_url, api_key="x", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True})
    with urllib.request.urlopen(f"{dep.router_url}/requests/{r.id}/trace", timeout=30) as f:
        return r.choices[0].text, json.loads(f.read())


def md_transfer(trace: dict) -> dict:
    return next(e for e in trace["events"] if e["name"] == "kv_transfer" and e.get("target") == "md0")


PDD_POLICY = {"enable_filter": False}      # every request's KV crosses the WAN to MD
PROMPT = ids(11, 200)


def expected(tiny_model, tiny_model_dir, prompt, n) -> str:
    return Tokenizer(tiny_model_dir).decode(generate_greedy(tiny_model[0], prompt, n))


def kv_blocks(stream: bytes) -> list[bytes]:
    """The KV bytes of every block in a plain KV stream: BLOCK payloads past
    their seal, and blocks P streamed as PART slices, put back together."""
    whole, parts = [], {}
    for f in FrameDecoder().feed(stream):
        if isinstance(f, Block):
            whole.append(f.payload[DIGEST_BYTES:])
        elif isinstance(f, Part):
            parts.setdefault((f.index, f.block_hash), bytearray()).extend(f.data)
    return whole + [bytes(b) for b in parts.values()]


@pytest.fixture(scope="module")
def plaintext_run(tmp_path_factory, tiny_model_dir):
    """The same request with TLS off: what an eavesdropper on the WAN would read."""
    dep = start(tmp_path_factory, tiny_model_dir, "pdd", "off", policy=PDD_POLICY)
    try:
        with swap_relay_for_tap(dep) as tap:
            text, trace = complete(dep, PROMPT, 12)
        yield text, trace, tap
    finally:
        dep.stop()


def test_wan_traffic_is_encrypted_and_serves_the_same_text(plaintext_run, tmp_path_factory, tiny_model,
                                                             tiny_model_dir):
    plain_text, plain_trace, plain_tap = plaintext_run
    needles = [json.dumps(PROMPT[40:48])[1:-1].encode(),                          # router -> MD JSON
               json.dumps(PROMPT[40:48], separators=(",", ":"))[1:-1].encode()]   # KV BEGIN metadata
    plain = plain_tap.all_bytes()
    blocks = [b for lp in plain_tap.kv_ports for b in kv_blocks(bytes(plain_tap.a_to_b[lp]))]
    # the control: without TLS the tap reads the prompt and the KV
    assert md_transfer(plain_trace)["ok"] and blocks, plain_trace
    assert all(n in plain for n in needles)
    windows = [blk[k:k + 32] for blk in blocks[:2] for k in range(0, len(blk) - 32, len(blk) // 8)]
    assert all(w in plain for w in windows)

    dep = start(tmp_path_factory, tiny_model_dir, "pdd", "wan", policy=PDD_POLICY)
    try:
        with swap_relay_for_tap(dep) as tap:
            text, trace = complete(dep, PROMPT, 12)
        assert md_transfer(trace)["ok"], trace
        wire = tap.all_bytes()
        kv_bytes = sum(len(tap.a_to_b[lp]) for lp in tap.kv_ports)
        assert kv_bytes > sum(map(len, blocks)), (kv_bytes, sum(map(len, blocks)))   # the KV did cross
        assert not any(n in wire for n in needles)
        assert not any(w in wire for w in windows)
        assert b"PDKV" not in wire and b"/internal/" not in wire and b"prompt_ids" not in wire
        assert text == plain_text == expected(tiny_model, tiny_model_dir, PROMPT, 12)
    finally:
        dep.stop()


def test_forged_kv_block_with_valid_crc_is_refused_and_the_request_finishes(tmp_path_factory, tiny_model,
                                                                            tiny_model_dir):
    # TLS off, so the forger can rewrite frames: only the end-to-end checksum stands in its way
    dep = start(tmp_path_factory, tiny_model_dir, "pdd", "off", policy=PDD_POLICY)
    try:
        with swap_relay_for_tap(dep, forge_kv=True) as tap:
            text, trace = complete(dep, PROMPT, 12)
        assert tap.num_forged == 1
        md = md_transfer(trace)
        assert not md["ok"] and "SHA-256" in md["error"], md
        assert text == expected(tiny_model, tiny_model_dir, PROMPT, 12)     # RLD carried on
        with urllib.request.urlopen(f"http://127.0.0.1:{dep.spec.instance('md0').port}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert "pdd_kv_cached_blocks" in metrics
        def metric(name: str) -> float:
            return float(next(ln for ln in metrics.splitlines() if ln.startswith(name)).split()[-1])
        assert metric("pdd_kv_cached_blocks") == 0.0                       # nothing of it was cached
    finally:
        dep.stop()


def test_forged_kv_block_in_pd_ends_the_request_with_a_clear_error(tmp_path_factory, tiny_model_dir):
    dep = start(tmp_path_factory, tiny_model_dir, "pd-wan", "off")
    try:
        with swap_relay_for_tap(dep, forge_kv=True) as tap:
            with pytest.raises(openai.APIError) as err:
                complete(dep, PROMPT, 6)
            assert tap.num_forged == 1
        assert "SHA-256" in str(err.value), err.value
    finally:
        dep.stop()


def test_a_byte_flipped_in_the_tls_stream_fails_its_mac_and_the_request_finishes(tmp_path_factory, tiny_model,
                                                                                 tiny_model_dir):
    dep = start(tmp_path_factory, tiny_model_dir, "pdd", "wan", policy=PDD_POLICY)
    try:
        with swap_relay_for_tap(dep, flip_kv_at=20_000) as tap:
            text, trace = complete(dep, PROMPT, 12)
            assert tap.num_forged == 1
            md = md_transfer(trace)
            assert not md["ok"], md
            assert text == expected(tiny_model, tiny_model_dir, PROMPT, 12)
            # MD's HTTP API across the WAN: a client certificate from another CA
            # is refused, and one of this CA naming another instance may not
            # make internal calls; the router's may
            other = tmp_path_factory.mktemp("rogue")
            tls.issue_deployment_certs(other, [ROUTER_CERT_NAME])
            base = address(dep.spec, dep.spec.instance("md0"), dep.spec.router_datacenter).url
            with pytest.raises((aiohttp.ClientError, ssl.SSLError, ConnectionError)):
                internal_match(dep, base, tls.TlsPeer(_mixed_context(other, dep.tls_dir), "md0"))
            p0 = tls.TlsPeer(tls.client_context(tls.TlsFiles(dep.tls_dir, "p0")), "md0")
            assert internal_match(dep, base, p0) == 403
            router = tls.TlsPeer(tls.client_context(tls.TlsFiles(dep.tls_dir, ROUTER_CERT_NAME)), "md0")
            assert internal_match(dep, base, router) == 200
        # an operator's tool on this host reaches MD's API directly (Deployment.instance_url)
        url, ctx = dep.instance_url("md0")
        assert url.startswith("https://") and ctx is not None
        with urllib.request.urlopen(url + "/metrics", timeout=10, context=ctx) as r:
            assert b"pdd_kv_failed_transfers" in r.read()
    finally:
        dep.stop()


def _mixed_context(rogue_dir: Path, real_dir: Path) -> ssl.SSLContext:
    """Trusts the deployment's CA (so the server passes) but presents a rogue CA's router certificate."""
    ctx = ssl.create_default_context(cafile=str(real_dir / "ca.crt"))
    ctx.load_cert_chain(str(rogue_dir / f"{ROUTER_CERT_NAME}.crt"), str(rogue_dir / f"{ROUTER_CERT_NAME}.key"))
    return ctx


def internal_match(dep: Deployment, base: str, peer: tls.TlsPeer) -> int:
    async def main():
        async with aiohttp.ClientSession() as session:
            client = InternalClient(dep.keys.internal_http, session, {base: "md0"}, tls={base: peer})
            try:
                await client.post(base, "/internal/match", {"prompt_ids": [1, 2, 3]}, timeout_s=10)
                return 200
            except InternalCallError as e:
                return int(str(e).split("-> ")[1][:3])
    return asyncio.run(main())


def test_bench_artefacts_reach_md_on_its_tls_port(tmp_path, tiny_model_dir):
    """pdd bench saves every instance's /internal/steps and /metrics: MD's port
    speaks TLS ([tls] mode "wan"), so the runner goes through Deployment.instance_url."""
    from pdd.bench import runner

    path = tmp_path / "pdd.toml"
    path.write_text(deployment_toml("pdd", tiny_model_dir))
    dep = Deployment.start(path, run_dir=tmp_path / "run", timeout_s=180)
    try:
        assert dep.instance_url("md0")[0].startswith("https://")
        complete(dep, ids(3, 40), 3)
        out = tmp_path / "out"
        out.mkdir()
        runner.save_run_artefacts(dep, runner.ModeSpec("pdd", str(path)), out)
        steps = [json.loads(ln) for ln in (out / "steps.jsonl").read_text().splitlines()]
        assert steps and all(s["instance"] in {"p0", "rld0", "md0"} for s in steps)
        # the metrics come after every instance's steps: all four mean no fetch failed
        assert sorted(p.stem for p in (out / "metrics").iterdir()) == ["md0", "p0", "rld0", "router"]
        assert "pdd_kv_free_blocks" in (out / "metrics" / "md0.prom").read_text()
    finally:
        dep.stop()
