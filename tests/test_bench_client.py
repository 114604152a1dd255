"""The streaming client against a fake OpenAI SSE server."""

import time

import pytest

from pdd.bench.client import ClientConfig, _Stream, run_workload_sync
from pdd.bench.fake_server import FakeBehaviour, FakeOpenAIServer
from pdd.measure.workload import WorkloadRequest


@pytest.fixture
def serve():
    servers = []

    def start(**kw):
        s = FakeOpenAIServer(FakeBehaviour(**kw)).start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


def reqs(n, max_tokens=5, gap_s=0.0, prompt_len=40):
    return [WorkloadRequest(f"q{i}", gap_s * i, list(range(100, 100 + prompt_len)), max_tokens)
            for i in range(n)]


def test_the_switch_after_a_first_token_from_p_is_found_past_it(serve):
    """P sent the first token, RLD one of its own, then MD: the switch is
    between tokens 1 and 2, whatever small figure the router reported."""
    s = serve(first_token_delay_s=0.1, token_delay_s=0.02, trace_facts={
        "rld_tokens": 1, "pipeline": "relay", "handoff_gap_s": 0.001, "handoff_mode": "paced",
        "token_sources": ["p", "rld", "md", "md", "md"]})
    (r,), _ = run_workload_sync(ClientConfig(s.url), reqs(1))
    t = r.token_times_s
    assert r.first_token_from_p and r.rld_tokens == 1
    assert r.handoff_gap_s == t[2] - t[1] > 0.001


def test_records_tokens_ttft_and_server_facts(serve):
    s = serve(first_token_delay_s=0.1, token_delay_s=0.02, trace_facts={"rld_tokens": 2,
              "pipeline": "relay", "handoff_gap_s": 0.05, "handoff_mode": "one_shot"})
    records, duration = run_workload_sync(ClientConfig(s.url), reqs(2, gap_s=0.05))
    a, b = records
    assert [r.request_id for r in records] == ["q0", "q1"]
    for r in records:
        assert not r.failed and r.error is None
        assert r.output_tokens == 5 and len(r.token_times_s) == 5
        assert 0.09 <= r.ttft_s < 0.5
        assert r.token_times_s[0] == pytest.approx(r.arrival_s + r.ttft_s)
        assert all(x < y for x, y in zip(r.token_times_s, r.token_times_s[1:]))
        assert r.e2e_s >= r.token_times_s[-1] - r.arrival_s
        assert (r.rld_tokens, r.pipeline, r.handoff_mode) == (2, "relay", "one_shot")
        # The gap at the switch as the client saw it (RLD's last token, index
        # 1, to MD's first), or the router's figure where larger (a paced
        # handoff's stretched gaps before the switch count too).
        t = r.token_times_s
        assert t[2] - t[1] < 0.05 and r.handoff_gap_s == 0.05
        assert r.prompt_tokens == 40
    assert b.arrival_s >= 0.05 - 1e-3
    assert a.cached_tokens == 0 and b.cached_tokens == 32       # two 16-token blocks, last token computed
    assert a.wan_bytes == 4000 and b.wan_bytes == 800
    assert duration == pytest.approx(b.arrival_s + b.e2e_s - a.arrival_s, abs=1e-6)
    body = s.bodies[0]
    assert body["stream"] is True and body["ignore_eos"] is True and body["temperature"] == 0
    assert body["stream_options"] == {"include_usage": True}
    assert body["prompt"] == list(range(100, 140)) and body["max_tokens"] == 5
    assert body["model"] == "fake-model"                        # from GET /v1/models


def test_http_error_is_a_failed_record(serve):
    s = serve(fail_status=503)
    (r,) = run_workload_sync(ClientConfig(s.url), reqs(1))[0]
    assert r.failed and "HTTP 503" in r.error and "fake failure" in r.error
    assert r.ttft_s is None and r.output_tokens == 0 and r.e2e_s is None


def test_stalled_server_times_out_and_never_hangs(serve):
    s = serve(stall_after_tokens=2)
    t0 = time.monotonic()
    records, _ = run_workload_sync(ClientConfig(s.url, request_timeout_s=0.5), reqs(3))
    assert time.monotonic() - t0 < 3.0
    for r in records:
        assert r.failed and "timeout" in r.error
        assert r.output_tokens == 2 and r.ttft_s is not None     # partial progress kept


def test_cut_stream_is_failed(serve):
    s = serve(cut_after_tokens=3)
    (r,), _ = run_workload_sync(ClientConfig(s.url), reqs(1))
    assert r.failed and "[DONE]" in r.error and r.output_tokens == 3


def test_multi_token_chunks_counted_by_usage_and_trace_404(serve):
    s = serve(tokens_per_chunk=3, serve_trace=False)
    (r,), _ = run_workload_sync(ClientConfig(s.url), reqs(1, max_tokens=7))
    assert not r.failed
    # Three chunks without token_ids count one token each; usage says 7, so the
    # four missing tokens are stamped with the last chunk's time.
    assert r.output_tokens == 7 and len(r.token_times_s) == 7
    assert len(set(r.token_times_s[2:])) == 1
    assert (r.wan_bytes, r.rld_tokens, r.pipeline, r.handoff_gap_s) == (0, 0, None, None)


def test_closed_loop_waits_for_previous_turn(serve):
    s = serve(token_delay_s=0.05)
    first = WorkloadRequest("t0", 0.0, list(range(100, 140)), 4, session_id="s")
    second = WorkloadRequest("t1", 0.0, list(range(100, 160)), 2, session_id="s", turn=1,
                             depends_on="t0", think_time_s=0.1)
    (a, b), _ = run_workload_sync(ClientConfig(s.url), [first, second])
    assert not a.failed and not b.failed
    assert b.arrival_s >= a.arrival_s + a.e2e_s + 0.1 - 1e-3
    assert b.cached_tokens == 32


def test_total_time_limit_records_everything(serve):
    s = serve(stall_after_tokens=1)
    workload = reqs(2) + [WorkloadRequest("late", 30.0, [100, 101], 3)]
    t0 = time.monotonic()
    records, _ = run_workload_sync(ClientConfig(s.url, total_timeout_s=0.5, request_timeout_s=60), workload)
    assert time.monotonic() - t0 < 3.0
    assert [r.request_id for r in records] == ["q0", "q1", "late"]
    assert all(r.failed and "run time limit" in r.error for r in records)
    assert records[0].output_tokens == 1 and "not sent" in records[2].error


def test_unreachable_server_fails_fast():
    (r,), _ = run_workload_sync(ClientConfig("http://127.0.0.1:9/v1", request_timeout_s=2.0), reqs(1))
    assert r.failed and r.error


def test_stream_token_accounting_edge_cases():
    st = _Stream()
    st.on_payload({"id": "x", "choices": [{"text": "", "finish_reason": None}]}, 1.0)   # held-back bytes
    st.on_payload({"id": "x", "choices": [{"text": "", "finish_reason": "length"}]}, 2.0)  # no token
    st.on_payload({"id": "x", "choices": [{"token_ids": [1, 2], "text": "ab"}]}, 3.0)
    assert st.token_times == [1.0, 3.0, 3.0] and st.finished
    st.usage = {"completion_tokens": 2}
    assert st.output_token_times() == [1.0, 3.0]
    st.on_payload({"error": {"message": "bad"}}, 4.0)
    assert st.error == "bad"


def test_a_closed_loop_turn_quotes_the_answer_the_server_produced(serve):
    """The next turn repeats the previous prompt, then the ids the model
    produced (not the workload's stand-ins), then its own new tokens; a turn
    after it keeps that history; an open-loop request is sent as written."""
    s = serve(token_delay_s=0.01)
    p0 = list(range(100, 140))
    stand_in = [900, 901, 902, 903]
    p1 = p0 + stand_in + [200, 201]
    p2 = p1 + [950, 951] + [300]
    turns = [WorkloadRequest("t0", 0.0, p0, 4, session_id="s"),
             WorkloadRequest("t1", 0.0, p1, 2, session_id="s", turn=1, depends_on="t0", answer_at=40),
             WorkloadRequest("t2", 0.0, p2, 3, session_id="s", turn=2, depends_on="t1", answer_at=46),
             WorkloadRequest("x", 0.0, [100, 101, 102], 2)]
    records, _ = run_workload_sync(ClientConfig(s.url), turns)
    assert not any(r.failed for r in records)
    sent = {len(b["prompt"]): b for b in s.bodies}
    answer0 = [5000 + 40 + i for i in range(4)]          # what the fake produced for t0
    answer1 = [5000 + 46 + i for i in range(2)]
    assert sent[46]["prompt"] == p0 + answer0 + [200, 201]
    assert sent[49]["prompt"] == p0 + answer0 + [200, 201] + answer1 + [300]
    assert sent[40]["return_token_ids"] is True and sent[46]["return_token_ids"] is True
    assert "return_token_ids" not in sent[49] and sent[3]["prompt"] == [100, 101, 102]
    assert [r.quoted_answer_tokens for r in records] == [0, 4, 6, 0]


def test_a_failed_turn_leaves_the_stand_in_answer(serve):
    s = serve(cut_after_tokens=1)
    p0 = list(range(100, 140))
    p1 = p0 + [900, 901] + [200]
    first = WorkloadRequest("t0", 0.0, p0, 2, session_id="s")
    second = WorkloadRequest("t1", 0.0, p1, 2, session_id="s", turn=1, depends_on="t0", answer_at=40)
    (a, b), _ = run_workload_sync(ClientConfig(s.url), [first, second])
    assert a.failed
    assert s.bodies[1]["prompt"] == p1 and b.quoted_answer_tokens == 0
