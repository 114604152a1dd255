"""The replay routes the bench's warm-up requests first, as the router did.

`pdd bench` sends `--warmup` short requests (one by default) through the
router before each mode's run; the router counts them in the relay budgets.
A replay that skipped them saw other budgets at the run's first decisions
than the router had (the opening decisions of results/wan-bound-15 and the
held-out runs). The start-up loan's clock counts in wholes of the decision
at hand, so the one 4-token warm-up leaves a cold first turn the loan; it
once took a tenth of it (the clock counted decisions) and sent the first
turn of results/wan-bound-31 to wait 13.9 s for the line.
"""

import dataclasses
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
    # After the bench's one warm-up (4 tokens, direct), routed first, nearly
    # all of it is left: the turn still relays.
    entry, records, _ = run_runtime_spec(spec, "pdd", wl, sla, warmup=1)
    assert records[0].pipeline == "relay" and entry["warmup_requests"] == 1
    # Warm-ups are routed and counted in the budgets, as direct decisions:
    # without a loan, 17 tokens on RLD fit a 10% share only behind 39 of them.
    no_loan = dataclasses.replace(spec, policy={**spec.policy, "relay_startup_loan": 0})
    assert run_runtime_spec(no_loan, "pdd", wl, sla, warmup=38)[1][0].pipeline == "direct"
    assert run_runtime_spec(no_loan, "pdd", wl, sla, warmup=39)[1][0].pipeline == "relay"
    # What the bench sends: short prompts within the workload's id range.
    (w,) = warmup_requests(wl, 1)
    assert len(w.prompt_token_ids) == 32 and w.max_tokens == 4
    assert min(wl.requests[0].prompt_token_ids) <= min(w.prompt_token_ids)
