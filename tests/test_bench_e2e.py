"""A tiny end-to-end `pdd bench`: two real deployments of the tiny model, one
workload, a complete summary.json (the benchmark itself is not a test)."""

from __future__ import annotations

import json
import math

from deploy_helpers import deployment_toml
from pdd.cli import main as pdd_main
from pdd.deploy.spec import load_spec

REQUIRED = ["ttft_s", "tpot_s", "itl_s", "e2e_s", "goodput_rps", "cost_per_hour", "bcr", "wan_bytes",
            "uncached_kv_bytes", "rld_token_share", "handoff_gap_ratio", "num_requests", "num_failed"]


def test_bench_two_modes_writes_complete_summary(tmp_path, tiny_model_dir):
    configs = []
    for mode in ("pd-wan", "pdd"):
        f = tmp_path / f"{mode}.toml"
        f.write_text(deployment_toml(mode, tiny_model_dir, wan_mbps=2.0))
        configs += ["-c", str(f)]
    out = tmp_path / "bench"
    rc = pdd_main(["bench", *configs, "--workload", "agentic", "--quick", "--num-requests", "6",
                   "--seed", "3", "--out", str(out), "--warmup", "0"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["modes"]) == {"pd-wan", "pdd"}
    for name, m in summary["modes"].items():
        assert set(REQUIRED) <= set(m), (name, set(REQUIRED) - set(m))
        assert m["num_requests"] == 6 and m["num_failed"] == 0
        for k in ("mean", "p50", "p90", "p99"):
            assert math.isfinite(m["ttft_s"][k]) and m["ttft_s"][k] > 0
        assert m["cost_per_hour"] > 0 and m["bcr"] >= 0
        lines = (out / name / "records.jsonl").read_text().splitlines()
        assert len(lines) == 6
        # CPU seconds each process spent during the workload: the engines did
        # the work, the router and the emulated WAN line took their share.
        cpu = m["cpu_s"]
        names = {i.name for i in load_spec(out / name / "deploy.toml").instances}
        assert names | {"router", "wan0", "bench_client"} <= set(cpu), cpu
        assert all(v >= 0 for v in cpu.values())
        assert cpu["p0"] > 0 and cpu["router"] > 0 and cpu["bench_client"] > 0
        # What crossed the line, by the senders' counters over the workload: at
        # least what the requests' own transfers reported (a relayed request's
        # copy to MD may land after the request has ended).
        assert m["wan_bytes"] >= m["wan_bytes_in_requests"] >= 0, name
    assert summary["modes"]["pd-wan"]["wan_bytes"] > 0 and summary["modes"]["pd-wan"]["rld_token_share"] == 0
    # A PD baseline's decoder waits for every byte: the two counts agree.
    assert summary["modes"]["pd-wan"]["wan_bytes"] == summary["modes"]["pd-wan"]["wan_bytes_in_requests"]
    assert "hit_rate_histogram" in json.dumps(summary["workload"])
    assert (out / "report.md").exists() and (out / "ttft_cdf.png").stat().st_size > 1000
