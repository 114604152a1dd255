"""A finished prefill frees P's keep-alive connection at once.

P's prefill handler ends its NDJSON stream, and the router's HTTP client takes
that connection back for its next call to P: a load poll, a routing prefix
match, a release, the next request's own prefill. aiohttp reads that call only
once the handler has returned, so a handler that went on to await its job's
clean-up (engine commands, answered between two steps) held the call until P's
step under way ended: up to a whole prompt chunk, 0.4-1.6 s in session 37's
runs. Here a real P server (tiny model, engine steps made slow on purpose)
answers a load poll on the connection a released prefill has just handed back
while its engine is in the middle of a long step.
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time

import aiohttp

from deploy_helpers import deployment_toml, ids
from pdd.deploy.spec import load_spec
from pdd.engine.engine import Engine
from pdd.keys import DeploymentKeys
from pdd.server.instance import InstanceServer
from pdd.server.wire import InternalClient

SLOW_STEP_S = 1.5


def test_a_released_prefill_frees_its_connection_while_the_engine_steps(tmp_path, tiny_model, tiny_model_dir):
    path = tmp_path / "pd.toml"
    path.write_text(deployment_toml("pd-local", tiny_model_dir))
    spec = load_spec(path)
    inst = next(i for i in spec.instances if i.name == "p0")
    model, cfg = tiny_model
    engine = Engine(model, cfg, inst.engine)
    slow = threading.Event()
    real_step = engine.step

    def step():
        # A long prompt chunk: the engine thread is busy this long, and
        # commands (abort, forget) wait for it to end.
        if slow.is_set() and engine.has_work:
            time.sleep(SLOW_STEP_S)
        return real_step()
    engine.step = step
    secret = secrets.token_hex(16).encode()

    async def main() -> tuple[float, float]:
        server = InstanceServer(spec, inst, secret, engine)
        runner = await server.start()
        url = f"http://{inst.host}:{inst.port}"
        key = DeploymentKeys.derive(secret).internal_http
        # One connection for the prefill and the poll after it (the router's
        # pool hands the connection a stream just gave back to its next call);
        # the release and the long prompt on connections of their own.
        mine = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
        others = aiohttp.ClientSession()
        try:
            a = InternalClient(key, mine, {url: "p0"})
            b = InternalClient(key, others, {url: "p0"})
            sampling = {"max_tokens": 1}
            events = a.stream(url, "/internal/prefill", {"request_id": "short", "prompt_ids": ids(1, 40),
                                                         "sampling": sampling, "targets": []}, timeout_s=60)
            first = await events.__anext__()
            assert first["event"] == "prefilled", first
            # The engine starts a long prompt's slow step ...
            slow.set()
            long_job = asyncio.ensure_future(_drain(b.stream(url, "/internal/prefill", {
                "request_id": "long", "prompt_ids": ids(2, 200), "sampling": sampling, "targets": []},
                timeout_s=60)))
            for _ in range(500):
                if "long" in engine.requests:
                    break
                await asyncio.sleep(0.01)
            t_step = time.monotonic()
            await asyncio.sleep(0.2)            # ... and is inside it
            # The router releases the short prompt: its stream ends.
            assert (await b.post(url, "/internal/release", {"request_id": "short"}))["ok"] is True
            rest = [e async for e in events]
            assert rest == [], rest
            t0 = time.monotonic()
            stats = await a.get(url, "/internal/stats")
            poll_s = time.monotonic() - t0
            assert stats["name"] == "p0"
            step_left_s = SLOW_STEP_S - (t0 - t_step)
            await b.post(url, "/internal/release", {"request_id": "long"})
            slow.clear()
            await asyncio.wait_for(long_job, 30)
            # The short prompt's record is still dropped (by the spawned clean-up).
            for _ in range(500):
                if "short" not in engine.requests:
                    break
                await asyncio.sleep(0.01)
            assert "short" not in engine.requests
            return poll_s, step_left_s
        finally:
            await mine.close()
            await others.close()
            await server.close()
            await runner.cleanup()

    poll_s, step_left_s = asyncio.run(main())
    # The poll came while the slow step had this much left; the handler that
    # awaited its clean-up answered it only then.
    assert step_left_s > 0.8, step_left_s
    assert poll_s < 0.4, (poll_s, step_left_s)


async def _drain(events) -> list[dict]:
    return [e async for e in events]
