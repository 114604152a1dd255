"""Keys and signatures: per-purpose keys derived from the deployment secret;
signed internal calls bound to method, path, target, time, nonce and body,
each accepted once; no credential on the wire equals the master secret.
Over real sockets (in-process servers) and a real deployment."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import math
import re
import secrets
import urllib.error
import urllib.request

import aiohttp
import pytest
from aiohttp import web

from pdd.keys import DeploymentKeys, Purpose, derive_key, hkdf_sha256
from pdd.server.http_auth import HEADER, Refusal, SignatureChecker, check_header, internal_auth_middleware, sign
from pdd.server.replay_cache import ReplayCache
from pdd.server.wire import InternalCallError, InternalClient
from pdd.transport.kv_receiver import KVReceiver
from pdd.transport.kv_sender import KVSender
from pdd.wan.control import ControlServer, WanControlClient
from pdd.wan.relay import WanLink
from wire_tap import WireTap

MASTER = secrets.token_hex(32).encode()   # as `pdd up` writes it: 64 hex characters
KEYS = DeploymentKeys.derive(MASTER)


# -- keys ----------------------------------------------------------------------------

def test_hkdf_matches_rfc5869_vectors():
    ikm = bytes([0x0B] * 22)
    okm = hkdf_sha256(ikm, bytes(range(0xF0, 0xFA)), 42, salt=bytes(range(13)))
    assert okm.hex() == ("3cb25f25faacd57a90434f64d0362f2a2d2d0a90cf1a5a4c"
                         "5db02d56ecc4c5bf34007208d5b887185865")           # A.1
    assert hkdf_sha256(ikm, b"", 42).hex() == ("8da4e775a563c18f715f802a063c5a31b8a11f5c5ee1879e"
                                               "c3454e5f3c738d2d9d201395faa4b61a96c8")  # A.3


def test_purpose_keys_differ_from_each_other_and_from_the_master():
    keys = [KEYS.internal_http, KEYS.kv, KEYS.wan_control]
    assert len(set(keys)) == 3 and all(len(k) == 32 for k in keys)
    assert MASTER not in keys and bytes.fromhex(MASTER.decode()) not in keys
    assert derive_key(MASTER.decode(), Purpose.KV) == KEYS.kv          # str and bytes name the same secret
    assert DeploymentKeys.derive(b"other").kv != KEYS.kv
    assert "redacted" in repr(KEYS) and KEYS.kv.hex() not in repr(KEYS)


# -- the signature, pure ------------------------------------------------------------

def test_signature_binds_method_path_target_time_and_key():
    now = 1_000_000.0
    h = sign(KEYS.internal_http, "POST", "/internal/decode", "md0", b"{}", now=now)[HEADER]
    ok = check_header(KEYS.internal_http, "md0", h, "POST", "/internal/decode", now + 1)
    assert not isinstance(ok, Refusal) and ok.body_sha256 == hashlib.sha256(b"{}").hexdigest()
    for me, method, path, key, t in [("p0", "POST", "/internal/decode", KEYS.internal_http, now),
                                     ("md0", "GET", "/internal/decode", KEYS.internal_http, now),
                                     ("md0", "POST", "/internal/abort", KEYS.internal_http, now),
                                     ("md0", "POST", "/internal/decode", KEYS.kv, now),
                                     ("md0", "POST", "/internal/decode", MASTER, now)]:
        assert check_header(key, me, h, method, path, t) is Refusal.BAD_MAC
    assert check_header(KEYS.internal_http, "md0", h, "POST", "/internal/decode", now + 121) is Refusal.STALE
    assert check_header(KEYS.internal_http, "md0", h, "POST", "/internal/decode", now - 121) is Refusal.STALE
    forged = h[:-64] + sign(KEYS.internal_http, "POST", "/internal/decode", "md0", b"[]", now=now)[HEADER][-64:]
    assert check_header(KEYS.internal_http, "md0", forged, "POST", "/internal/decode", now) is Refusal.BAD_MAC
    for bad in (None, "", "1:2:3", h.replace("v1:", "v2:"), h + ":x"):
        assert check_header(KEYS.internal_http, "md0", bad, "POST", "/internal/decode", now) is Refusal.MALFORMED


def test_checker_accepts_each_signature_once():
    checker = SignatureChecker(KEYS.internal_http, "p0")
    h = sign(KEYS.internal_http, "GET", "/internal/stats", "p0", now=500.0)[HEADER]
    assert not isinstance(checker.check(h, "GET", "/internal/stats", 500.0), Refusal)
    assert checker.check(h, "GET", "/internal/stats", 501.0) is Refusal.REPLAYED
    assert checker.check(h, "GET", "/internal/stats", 700.0) is Refusal.STALE   # and then forgotten
    assert len(checker.replays) == 1
    fresh = sign(KEYS.internal_http, "GET", "/internal/stats", "p0", now=700.0)[HEADER]
    assert not isinstance(checker.check(fresh, "GET", "/internal/stats", 700.0), Refusal)
    assert len(checker.replays) == 1   # the old nonce expired


def test_replay_cache_is_bounded_and_never_forgets_a_nonce_it_could_still_accept():
    cache = ReplayCache(window_s=10.0, max_entries=4)
    for i in range(4):
        assert cache.accept(f"n{i}", 100.0 + i, now=104.0)
    assert cache.floor_s == -math.inf and len(cache) == 4
    assert cache.accept("n4", 104.5, now=104.5)           # full: the oldest (n0 @ 100) goes
    assert len(cache) == 4 and cache.floor_s == 100.0
    assert not cache.accept("n0", 100.0, now=105.0)        # evicted, yet still refused (floor)
    assert not cache.accept("late", 99.5, now=105.0)       # anything at or below the floor too
    assert not cache.accept("n3", 103.0, now=105.0)        # still remembered
    for i in range(5, 1000):                               # a flood keeps memory at the cap
        cache.accept(f"n{i}", 105.0 + i / 1000, now=106.0)
    assert len(cache) == 4
    assert cache.accept("later", 200.0, now=200.0) and len(cache) == 1   # all others expired


# -- over real sockets ----------------------------------------------------------------

async def _instance_like(name: str, seen: list) -> tuple[web.AppRunner, str]:
    """An aiohttp app with the instances' middleware: /internal/echo returns the body it got."""
    async def echo(request: web.Request) -> web.Response:
        body = await request.json()
        seen.append((name, body))
        return web.json_response({"me": name, "got": body})

    app = web.Application(middlewares=[internal_auth_middleware(KEYS.internal_http, name)])
    app.router.add_post("/internal/echo", echo)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


def _header_from_wire(raw: bytes) -> str:
    m = re.search(rb"(?i)x-pdd-auth: ([^\r\n]+)", raw)
    assert m, raw[:300]
    return m[1].decode()


async def _post_raw(session, url: str, header: str, body: bytes) -> tuple[int, str]:
    async with session.post(url, data=body, headers={HEADER: header, "Content-Type": "application/json"}) as r:
        return r.status, (await r.json())["error"]["message"] if r.status != 200 else ""


def test_captured_header_is_refused_replayed_rebodied_or_sent_elsewhere():
    async def main():
        seen: list = []
        p0, p0_url = await _instance_like("p0", seen)
        md0, md0_url = await _instance_like("md0", seen)
        tap = await WireTap("127.0.0.1", int(p0_url.rsplit(":", 1)[1])).start()
        try:
            async with aiohttp.ClientSession() as session:
                client = InternalClient(KEYS.internal_http, session, {tap.url: "p0", md0_url: "md0"})
                assert (await client.post(tap.url, "/internal/echo", {"n": 1}))["got"] == {"n": 1}
                captured = _header_from_wire(bytes(tap.upstream))
                body = json.dumps({"n": 1}).encode()
                # captured after use: as-is, with other bodies, on another instance
                assert await _post_raw(session, p0_url + "/internal/echo", captured, body) == \
                    (401, "unauthenticated call: " + Refusal.REPLAYED.value)
                for other in (b'{"n": 2}', b'{"n": 1, "evil": true}', b"{}"):
                    assert (await _post_raw(session, p0_url + "/internal/echo", captured, other))[0] == 401
                assert (await _post_raw(session, md0_url + "/internal/echo", captured, body))[0] == 401
                # intercepted before it arrived (never used): still no other body, no other target
                h = sign(KEYS.internal_http, "POST", "/internal/echo", "p0", body)[HEADER]
                assert await _post_raw(session, md0_url + "/internal/echo", h, body) == \
                    (401, "unauthenticated call: " + Refusal.BAD_MAC.value)
                assert await _post_raw(session, p0_url + "/internal/echo", h, b'{"n": 3}') == \
                    (401, "unauthenticated call: " + Refusal.BODY_MISMATCH.value)
                # signed with the master secret itself (the old scheme's key): refused
                old = sign(MASTER, "POST", "/internal/echo", "p0", body)[HEADER]
                assert (await _post_raw(session, p0_url + "/internal/echo", old, body))[0] == 401
                # fresh, correctly signed calls go through, to either instance
                assert (await client.post(md0_url, "/internal/echo", {"n": 4}))["me"] == "md0"
                assert (await client.post(tap.url, "/internal/echo", {"n": 5}))["got"] == {"n": 5}
                with pytest.raises(InternalCallError, match="no instance is known"):
                    await client.post("http://127.0.0.1:1", "/internal/echo", {})
            assert seen == [("p0", {"n": 1}), ("md0", {"n": 4}), ("p0", {"n": 5})]   # no refused call ran
        finally:
            await tap.close()
            await p0.cleanup()
            await md0.cleanup()
    asyncio.run(asyncio.wait_for(main(), 30))


def _forms(secret: bytes) -> list[bytes]:
    """The master secret as the file holds it, the raw bytes it encodes, and
    their hex and base64 spellings."""
    raw = bytes.fromhex(secret.decode())
    out = []
    for b in (secret, raw):
        out += [b, b.hex().encode(), b.hex().upper().encode(), base64.b64encode(b), base64.urlsafe_b64encode(b),
                base64.b64encode(b).rstrip(b"=")]
    return out


def test_no_credential_on_the_wire_is_the_master_secret_or_a_key():
    """Internal HTTP, the WAN control API and the KV port, driven by their real
    clients through a recording proxy: neither the master secret (in any common
    spelling) nor any derived key crosses the wire, only MACs and nonces."""
    async def main():
        seen: list = []
        inst, inst_url = await _instance_like("p0", seen)
        link = WanLink()
        control = ControlServer(link, KEYS.wan_control, "wan0")
        await control.start("127.0.0.1", 0)

        class Sink:
            def on_begin(self, rid, meta, hashes):
                return set()

            def on_block(self, rid, index, h, payload):
                pass

            def on_end(self, rid, status):
                pass

        receiver = await KVReceiver.start("127.0.0.1", 0, KEYS.kv, Sink())
        taps = [await WireTap("127.0.0.1", int(inst_url.rsplit(":", 1)[1])).start(),
                await WireTap("127.0.0.1", control.port).start(),
                await WireTap("127.0.0.1", receiver.port).start()]
        sender = KVSender(KEYS.kv)
        try:
            async with aiohttp.ClientSession() as session:
                client = InternalClient(KEYS.internal_http, session, {taps[0].url: "p0"})
                await client.post(taps[0].url, "/internal/echo", {"x": 1})
            ctl = WanControlClient("127.0.0.1", taps[1].port, KEYS.wan_control, name="wan0")
            assert (await ctl.set(latency_ms=5))["a_to_b"]["latency_s"] == 0.005
            assert (await ctl.health()) == {"ok": True}
            st = await sender.send("127.0.0.1", taps[2].port, "r", {"m": 1}, [b"h" * 16], [b"payload"], 10).wait()
            assert st.ok, st.error
            # the old bearer form of the control API (the master secret) is refused
            with pytest.raises(RuntimeError, match="401"):
                await WanControlClient("127.0.0.1", control.port, MASTER, name="wan0").stats()
        finally:
            await sender.close()
            await receiver.close()
            for t in taps:
                await t.close()
            await control.close()
            await link.close()
            await inst.cleanup()
        for tap in taps:
            wire = tap.captured
            assert len(tap.upstream) > 40 and len(tap.downstream) > 40
            for form in _forms(MASTER) + [KEYS.internal_http, KEYS.kv, KEYS.wan_control,
                                          KEYS.internal_http.hex().encode(), KEYS.kv.hex().encode(),
                                          KEYS.wan_control.hex().encode()]:
                assert form not in wire
        assert b"Authorization" not in taps[1].upstream and HEADER.encode() in taps[1].upstream
    asyncio.run(asyncio.wait_for(main(), 30))


# -- a real deployment ------------------------------------------------------------------

@pytest.fixture(scope="module")
def pdd_dep(tmp_path_factory, tiny_model_dir):
    from deploy_helpers import deployment_toml
    from pdd.deploy.launcher import Deployment

    d = tmp_path_factory.mktemp("auth")
    path = d / "pdd.toml"
    path.write_text(deployment_toml("pdd", tiny_model_dir))
    dep = Deployment.start(path, run_dir=d / "run", timeout_s=180)
    yield dep
    dep.stop()


def _call(url: str, header: str | None, body: bytes, context=None) -> int:
    headers = {"Content-Type": "application/json"} | ({HEADER: header} if header else {})
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers), timeout=30, context=context) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_deployment_instances_accept_each_signed_call_once_and_only_as_signed(pdd_dep):
    from pdd.deploy.topology import address

    spec = pdd_dep.spec
    keys = pdd_dep.keys
    assert pdd_dep.secret not in (keys.internal_http, keys.kv, keys.wan_control)
    url = {i.name: address(spec, i, spec.router_datacenter).url for i in spec.instances}  # md0 via the WAN relay
    assert url["md0"] != f"http://{spec.instance('md0').host}:{spec.instance('md0').port}"
    # md0's port speaks TLS ([tls] mode "wan"): https with the router's certificate, as the router calls it
    tls = {i.name: pdd_dep.instance_url(i.name)[1] for i in spec.instances}
    assert tls["md0"] is not None and tls["p0"] is None
    url = {n: "https" + u.removeprefix("http") if tls[n] else u for n, u in url.items()}

    def call(name: str, header: str | None, body: bytes) -> int:
        return _call(url[name] + "/internal/match", header, body, tls[name])

    body = json.dumps({"prompt_ids": list(range(100, 140))}).encode()
    for name in ("p0", "rld0", "md0"):
        h = sign(keys.internal_http, "POST", "/internal/match", name, body)[HEADER]
        assert call(name, h, body) == 200
        assert call(name, h, body) == 401                                                     # replayed
        assert call(name, h, b'{"prompt_ids": []}') == 401                                    # re-bodied
        for other in {"p0", "rld0", "md0"} - {name}:
            assert call(other, h, body) == 401                                                # misdirected
        unused = sign(keys.internal_http, "POST", "/internal/match", name, body)[HEADER]
        assert call(name, unused, b'{"prompt_ids": [1]}') == 401
        assert call(name, sign(pdd_dep.secret, "POST", "/internal/match", name, body)[HEADER],
                    body) == 401                                                              # the master as key
    # the router signs every call for its target: a request end to end still works
    with urllib.request.urlopen(pdd_dep.router_url + "/models", timeout=30) as r:
        model = json.loads(r.read())["data"][0]["id"]
    req = json.dumps({"model": model, "prompt": list(range(200, 240)), "max_tokens": 3, "temperature": 0}).encode()
    with urllib.request.urlopen(urllib.request.Request(pdd_dep.router_url + "/completions", req,
                                                       {"Content-Type": "application/json"}), timeout=120) as r:
        assert r.status == 200 and json.loads(r.read())["usage"]["completion_tokens"] == 3
    # the relay's control API answers its derived key, not the master secret
    assert asyncio.run(pdd_dep.wan_control().stats())["is_cut"] is False
    from pdd.wan.control import WanControlClient
    link = spec.links[0]
    with pytest.raises(RuntimeError, match="401"):
        asyncio.run(WanControlClient(link.relay_host, link.control_port, pdd_dep.secret, name="wan0").stats())
