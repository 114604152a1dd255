import argparse
import asyncio

import pytest
from aiohttp import ClientSession

from pdd.keys import Purpose, derive_key
from pdd.server.http_auth import sign
from pdd.wan.cli import add_arguments, parse_listen
from pdd.wan.control import ControlServer, WanControlClient, parse_settings
from pdd.wan.relay import WanLink

SECRET = "deploy-secret"


def test_control_api_requires_token_and_drives_the_link():
    async def main():
        link = WanLink(rate_bytes_s=50e6, latency_s=0.02, jitter_s=0.005)
        control = ControlServer(link, SECRET)
        port = await control.start("127.0.0.1", 0)
        base = f"http://127.0.0.1:{port}"
        try:
            async with ClientSession() as s:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": SECRET}):
                    for method, path in (("GET", "/health"), ("GET", "/stats"), ("POST", "/cut")):
                        async with s.request(method, base + path, headers=headers) as r:
                            assert r.status == 401
                assert not link.is_cut
                body = b'{"rate": 1}'
                async with s.post(base + "/set", data=body, headers=sign(SECRET.encode(), "POST", "/set", "wan", body)) as r:
                    assert r.status == 400 and "unknown setting" in (await r.json())["error"]
                async with s.post(base + "/set", data=b"{nope", headers=sign(SECRET.encode(), "POST", "/set", "wan", b"{nope")) as r:
                    assert r.status == 400
            client = WanControlClient("127.0.0.1", port, SECRET)
            assert (await client.health()) == {"ok": True}
            stats = await client.set(rate_mbps=100, latency_ms=50, jitter_ms=0)
            assert stats["a_to_b"]["rate_bytes_s"] == 12.5e6 and stats["b_to_a"]["latency_s"] == 0.05
            assert (await client.cut())["is_cut"] and link.is_cut
            assert (await client.cut("blackhole"))["cut_mode"] == "blackhole"
            assert not (await client.restore())["is_cut"]
            assert (await client.set(rate_bytes_s=None))["a_to_b"]["rate_bytes_s"] is None
            with pytest.raises(RuntimeError, match="401"):
                await WanControlClient("127.0.0.1", port, "bad").stats()
        finally:
            await control.close()
            await link.close()
    asyncio.run(asyncio.wait_for(main(), 15))


def test_parse_settings_and_cli_arguments():
    assert parse_settings({"rate_mbps": 8, "latency_ms": 20, "jitter_s": 0.001}) == {
        "rate_bytes_s": 1e6, "latency_s": 0.02, "jitter_s": 0.001}
    for bad in ({"latency_ms": -1}, {"rate_mbps": "fast"}, {"latency_ms": 1, "latency_s": 1}, []):
        with pytest.raises(ValueError):
            parse_settings(bad)
    assert parse_listen("7001:127.0.0.1:8001") == (7001, "127.0.0.1", 8001)
    assert parse_listen("7001:[::1]:8001") == (7001, "::1", 8001)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--listen", "0:127.0.0.1:9", "--rate-mbps", "100", "--control-port", "0"])
    assert args.listen == [(0, "127.0.0.1", 9)] and args.rate_mbps == 100 and args.latency_ms == 20
    with pytest.raises(SystemExit):
        parser.parse_args(["--listen", "nonsense"])


def test_pdd_wan_command_starts_serves_and_stops_on_sigterm(tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys
    import threading

    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET + "\n")
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "src")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdd.cli", "wan", "--listen", "0:127.0.0.1:9", "--control-port", "0",
         "--secret-file", str(secret_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    watchdog = threading.Timer(20, proc.kill)  # bounds the blocking readline()s below
    watchdog.start()
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["event"] == "ready" and ready["mappings"][0]["listen_port"] > 0
        # `pdd wan` derives its key from the secret file; the file's content itself is refused
        with pytest.raises(RuntimeError, match="401"):
            asyncio.run(WanControlClient("127.0.0.1", ready["control_port"], SECRET).health())
        client = WanControlClient("127.0.0.1", ready["control_port"], derive_key(SECRET, Purpose.WAN_CONTROL))
        assert asyncio.run(client.health()) == {"ok": True}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert json.loads(proc.stdout.readline())["event"] == "stopped"
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)
        proc.stdout.close()
        proc.stderr.close()
