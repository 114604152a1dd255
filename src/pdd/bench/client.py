"""Async streaming client for an OpenAI-compatible `/v1/completions` endpoint.

Lifecycle of one request:
  due (its arrival time, or `think_time_s` after the turn it depends on
  finished) -> waits for a concurrency slot -> POST, stream SSE chunks,
  timestamping each token -> done (dependants may start) -> GET
  `{base}/requests/{id}/trace` for the server-side facts -> RequestRecord.

Times are seconds from the start of the run (monotonic clock). A record's
`arrival_s` is the time the request became due, so client-side queueing for a
slot counts in its TTFT (it is none unless `max_concurrency` is reached); the
per-request timeout counts from the POST. Nothing can hang the run: every
request ends by its timeout, and the run ends by `total_timeout_s` with the
unfinished requests recorded as failed.

Token counting: the server sends one SSE chunk per token, so each chunk with
a choice is one token (an empty text is still a token: the detokenizer may
hold back a partial character), except a text-less final chunk that only
carries finish_reason, and a chunk listing `token_ids` counts them all. The
`usage` chunk at the end is the authority: extra counted tokens are dropped
and missing ones are stamped with the last chunk's time.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdd.measure.metrics import run_duration
from pdd.measure.records import RequestRecord
from pdd.measure.workload import WorkloadRequest, answer_complete, prompt_to_send

# Keys of GET /requests/{id}/trace and their defaults.
TRACE_DEFAULTS: dict = {
    "wan_bytes": 0,
    "uncached_kv_bytes": 0,
    "rld_tokens": 0,
    "handoff_gap_s": None,
    "pipeline": None,
    "handoff_mode": None,
    "cached_tokens": None,
    "pipeline_reason": None,
}


@dataclass(frozen=True)
class ClientConfig:
    base_url: str                        # e.g. "http://127.0.0.1:8100/v1"
    model: str | None = None             # None: the first id of GET /models, else "default"
    max_concurrency: int = 64
    request_timeout_s: float = 300.0
    total_timeout_s: float | None = None
    trace_timeout_s: float = 5.0
    fetch_trace: bool = True
    ignore_eos: bool = True


class _Stream:
    """Mutable state of one streaming response."""

    def __init__(self) -> None:
        self.server_id: str | None = None
        self.token_times: list[float] = []
        self.usage: dict | None = None
        self.finished = False       # saw [DONE] or a finish_reason
        self.error: str | None = None
        self.token_ids: list[int] = []   # when the server lists them (return_token_ids)

    def on_payload(self, data: dict, now: float) -> None:
        if "error" in data:
            err = data["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        self.server_id = self.server_id or data.get("id")
        if data.get("usage"):
            self.usage = data["usage"]
        for choice in data.get("choices") or []:
            ids = choice.get("token_ids")
            if isinstance(ids, list):
                n = len(ids)
                self.token_ids += [int(i) for i in ids]
            else:
                n = 0 if (not choice.get("text") and choice.get("finish_reason")) else 1
            self.token_times.extend([now] * n)
            if choice.get("finish_reason"):
                self.finished = True

    def output_token_times(self) -> list[float]:
        times = list(self.token_times)
        n = (self.usage or {}).get("completion_tokens")
        if isinstance(n, int) and n >= 0:
            if len(times) > n:
                times = times[:n]
            elif times and len(times) < n:
                times += [times[-1]] * (n - len(times))
        return times


def _body(req: WorkloadRequest, model: str, ignore_eos: bool, prompt: list[int] | None = None,
          want_ids: bool = False) -> dict:
    body = {
        "model": model,
        "prompt": req.prompt_token_ids if prompt is None else prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ignore_eos:
        body["ignore_eos"] = True
    if want_ids:
        body["return_token_ids"] = True   # vLLM's name; the next turn quotes the answer
    return body


async def _read_sse(resp, st: _Stream, clock: Callable[[], float]) -> None:
    async for raw in resp.content:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            st.finished = True
            return
        try:
            st.on_payload(json.loads(payload), clock())
        except json.JSONDecodeError:
            st.error = f"bad SSE payload: {payload[:200]}"
        if st.error:
            return


async def stream_completion(http, cfg: ClientConfig, model: str, req: WorkloadRequest,
                            clock: Callable[[], float], st: _Stream | None = None,
                            prompt: list[int] | None = None, want_ids: bool = False) -> _Stream:
    """POST one streaming completion (`prompt`: what to send instead of the
    workload's ids); never raises (but cancellation), errors land in `.error`."""
    st = st or _Stream()
    url = cfg.base_url.rstrip("/") + "/completions"
    try:
        async with asyncio.timeout(cfg.request_timeout_s):
            async with http.post(url, json=_body(req, model, cfg.ignore_eos, prompt, want_ids)) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:500]
                    st.error = f"HTTP {resp.status}: {text}"
                    return st
                await _read_sse(resp, st, clock)
    except TimeoutError:
        st.error = f"timeout after {cfg.request_timeout_s:g} s"
    except Exception as e:  # noqa: BLE001 - any client/connection error is a failed request
        st.error = f"{type(e).__name__}: {e}"
    if st.error is None and not st.finished:
        st.error = "stream ended before [DONE]"
    return st


async def fetch_trace(http, base_url: str, server_id: str | None, timeout_s: float) -> dict:
    """Server-side facts of one request; defaults when absent or unreachable."""
    facts = dict(TRACE_DEFAULTS)
    if not server_id:
        return facts
    url = f"{base_url.rstrip('/')}/requests/{server_id}/trace"
    try:
        async with asyncio.timeout(timeout_s):
            async with http.get(url) as resp:
                if resp.status == 200:
                    data = await resp.json(content_type=None)
                    if isinstance(data, dict):
                        facts.update({k: data[k] for k in TRACE_DEFAULTS if data.get(k) is not None})
                        facts["first_token_from_p"] = (data.get("token_sources") or [None])[0] == "p"
                        facts["events"] = trace_events(data)
    except Exception:  # noqa: BLE001 - a missing trace must not fail the request
        pass
    return facts


def trace_events(trace: dict) -> list[dict]:
    """The trace's events with times relative to the router's arrival."""
    t0 = trace.get("arrival_s")
    out = []
    for ev in trace.get("events") or []:
        if not isinstance(ev, dict) or "ts" not in ev or t0 is None:
            continue
        e = {k: v for k, v in ev.items() if k not in ("ts", "ts_abs")}
        e["t"] = round(float(ev["ts"]) - float(t0), 6)
        out.append(e)
    return out


def build_record(req: WorkloadRequest, arrival_s: float, end_s: float, st: _Stream,
                 facts: dict, quoted: int = 0) -> RequestRecord:
    times = st.output_token_times()
    usage = st.usage or {}
    cached = facts.get("cached_tokens")
    if cached is None:
        cached = ((usage.get("prompt_tokens_details") or {}).get("cached_tokens")) or 0
    failed = st.error is not None
    gap, k = facts["handoff_gap_s"], int(facts["rld_tokens"] or 0)
    k += bool(k and facts.get("first_token_from_p"))    # P's first went out ahead of RLD's
    if gap is not None and 0 < k < len(times):
        # RLD's tokens come first, then MD's: the switch's gap as the client
        # saw it, from RLD's last token to MD's first, as the simulator counts
        # it. (Until session 30 the gap before RLD's last token counted too,
        # for a router that delayed it; the router now sends a token before
        # the calls it triggers, and that gap was RLD's own pace: ~4x the
        # median where RLD shares P's core.) The router's own figure stays
        # when larger: a paced handoff's stretched gaps before the switch.
        gap = max(gap, times[k] - times[k - 1])
    return RequestRecord(
        request_id=req.request_id,
        arrival_s=arrival_s,
        prompt_tokens=int(usage.get("prompt_tokens") or req.prompt_tokens),
        output_tokens=len(times),
        cached_tokens=int(cached),
        ttft_s=(times[0] - arrival_s) if times else None,
        token_times_s=times,
        e2e_s=None if failed else end_s - arrival_s,
        failed=failed,
        error=st.error,
        wan_bytes=int(facts["wan_bytes"] or 0),
        uncached_kv_bytes=int(facts["uncached_kv_bytes"] or 0),
        rld_tokens=int(facts["rld_tokens"] or 0),
        handoff_gap_s=gap,
        pipeline=facts["pipeline"],
        handoff_mode=facts["handoff_mode"],
        pipeline_reason=facts.get("pipeline_reason"),
        events=list(facts.get("events") or []),
        quoted_answer_tokens=quoted,
        first_token_from_p=bool(facts.get("first_token_from_p")),
    )


def unsent_record(req: WorkloadRequest, arrival_s: float, error: str) -> RequestRecord:
    return RequestRecord(request_id=req.request_id, arrival_s=arrival_s,
                         prompt_tokens=req.prompt_tokens, output_tokens=0,
                         failed=True, error=error)


async def discover_model(http, base_url: str) -> str:
    try:
        async with asyncio.timeout(5.0):
            async with http.get(base_url.rstrip("/") + "/models") as resp:
                data = await resp.json(content_type=None)
                return str(data["data"][0]["id"])
    except Exception:  # noqa: BLE001 - the router may not list models
        return "default"


async def run_workload(cfg: ClientConfig, requests: list[WorkloadRequest],
                       on_done: Callable[[RequestRecord], None] | None = None,
                       ) -> tuple[list[RequestRecord], float]:
    """Send every request (open or closed loop); returns (records in `requests`
    order, duration from the first request due to the last one done)."""
    import aiohttp

    done = {r.request_id: asyncio.Event() for r in requests}
    by_id = {r.request_id: r for r in requests}
    quoted_by = {r.depends_on for r in requests if r.answer_at is not None}
    sent: dict[str, list[int]] = {}       # the prompt each request went out with
    quoted: dict[str, int] = {}           # of which tokens the model produced in this run
    due: dict[str, float] = {}
    streams: dict[str, tuple[_Stream, float | None]] = {}
    records: dict[str, RequestRecord] = {}
    sem = asyncio.Semaphore(max(1, cfg.max_concurrency))
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as http:
        model = cfg.model or await discover_model(http, cfg.base_url)
        t0 = time.monotonic()

        def clock() -> float:
            return time.monotonic() - t0

        def _quoting(req: WorkloadRequest) -> tuple[list[int], int]:
            """The prompt to send (quoting the parent's real answer) and how
            many of its tokens the model produced."""
            parent = by_id.get(req.depends_on) if req.answer_at is not None else None
            if parent is None or parent.request_id not in sent:
                return list(req.prompt_token_ids), 0
            st_p = streams.get(parent.request_id, (None,))[0]
            produced = st_p.token_ids if st_p is not None and st_p.error is None else None
            prompt = prompt_to_send(req, parent, sent[parent.request_id], produced)
            used = parent.max_tokens if answer_complete(parent, produced) else 0
            return prompt, quoted.get(parent.request_id, 0) + used

        async def one(req: WorkloadRequest) -> None:
            rid = req.request_id
            try:
                if req.depends_on in done:
                    await done[req.depends_on].wait()
                    await asyncio.sleep(req.think_time_s)
                else:
                    await asyncio.sleep(max(0.0, req.arrival_s - clock()))
                due[rid] = clock()
                prompt, quoted[rid] = _quoting(req)
                sent[rid] = prompt
                async with sem:
                    st = _Stream()
                    streams[rid] = (st, None)
                    await stream_completion(http, cfg, model, req, clock, st, prompt, rid in quoted_by)
                    streams[rid] = (st, clock())
            finally:
                done[rid].set()
            facts = dict(TRACE_DEFAULTS)
            if cfg.fetch_trace:
                facts = await fetch_trace(http, cfg.base_url, st.server_id, cfg.trace_timeout_s)
            records[rid] = build_record(req, due[rid], streams[rid][1], st, facts, quoted[rid])
            if on_done:
                on_done(records[rid])

        tasks = [asyncio.create_task(one(r)) for r in requests]
        try:
            async with asyncio.timeout(cfg.total_timeout_s):
                await asyncio.gather(*tasks)
        except TimeoutError:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        now = clock()

    limit = f"run time limit ({cfg.total_timeout_s} s)"
    for req in requests:
        rid = req.request_id
        if rid in records:
            continue
        if rid in streams:
            st, end = streams[rid]
            if end is None:
                st.error = st.error or limit
            records[rid] = build_record(req, due[rid], end or now, st, dict(TRACE_DEFAULTS))
        else:
            records[rid] = unsent_record(req, due.get(rid, min(req.arrival_s, now)),
                                         f"not sent: {limit}")
        if on_done:
            on_done(records[rid])
    out = [records[r.request_id] for r in requests]
    return out, run_duration(out)


def run_workload_sync(cfg: ClientConfig, requests: list[WorkloadRequest],
                      on_done: Callable[[RequestRecord], None] | None = None,
                      ) -> tuple[list[RequestRecord], float]:
    return asyncio.run(run_workload(cfg, requests, on_done))
