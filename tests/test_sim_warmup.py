"""The replay routes the bench's warm-up requests first, as the router did.

`pdd bench` sends `--warmup` short requests (one by default) through the
router before each mode's run; the router counts them in the relay budgets,
whose start-up loan is repaid by the number of decisions. A replay that
skipped them saw a larger loan at the run's first cold turn than the router
had, and relayed the turn the router had sent direct (the opening decisions
of results/wan-bound-15 and the held-out runs).
"""

from pathlib import Path

from pdd.deploy.spec import load_spec
from pdd.measure.metrics import Sla
from pdd.measure.workload import Workload, WorkloadRequest, warmup_requests
from pdd.sim.runtime import run_runtime_spec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _cold_turn() -> Workload:
    # A cold first turn: ~55 MB of bf16 KV crosses the 60 Mbit/s line in ~7 s,
    # and RLD would emit the whole 17-token answer meanwhile.
    ids = [(7 * i) % 40000 + 100 for i in range(2400)]
    return Workload("cold", [WorkloadRequest("t0", 0.0, ids, 17)], {"kind": "test"}, 16)


def test_the_bench_warmup_is_routed_before_the_run():
    spec = load_spec(EXAMPLES / "pdd.toml")
    assert spec.policy.get("relay_startup_loan") == 1       # the example this was measured on
    wl, sla = _cold_turn(), Sla(30.0, 1.0)
    # Without a warm-up the run's first decision has the whole loan: 17 of 17
    # tokens on RLD fit it.
    entry, records, _ = run_runtime_spec(spec, "pdd", wl, sla)
    assert records[0].pipeline == "relay" and entry["warmup_requests"] == 0
    # After the bench's one warm-up (4 tokens, direct) the loan has shrunk by
    # a tenth: 17 tokens no longer fit, and the turn goes direct, as the
    # router sent the first turn of results/wan-bound-15.
    entry, records, _ = run_runtime_spec(spec, "pdd", wl, sla, warmup=1)
    assert records[0].pipeline == "direct" and entry["warmup_requests"] == 1
    assert "relay budget" in records[0].pipeline_reason
    # What the bench sends: short prompts within the workload's id range.
    (w,) = warmup_requests(wl, 1)
    assert len(w.prompt_token_ids) == 32 and w.max_tokens == 4
    assert min(wl.requests[0].prompt_token_ids) <= min(w.prompt_token_ids)
