"""Runner, report and `pdd bench` CLI on fake deployments (no model, no processes)."""

import json
import sys
import types
from pathlib import Path

import pytest

from pdd.bench import runner
from pdd.bench.fake_server import FakeBehaviour, FakeDeployment
from pdd.measure import report
from pdd.measure.files import read_records
from pdd.measure.metrics import Sla
from pdd.measure.workload import Workload, WorkloadRequest


def test_plan_modes_and_ablations():
    modes = runner.plan_modes(["ex/pd-local.toml", "ex/pdd.toml", "ex/pd-wan.toml"],
                              ["no-drc", "pd-wan:one-shot"])
    assert [m.name for m in modes] == ["pd-local", "pdd", "pd-wan", "pdd+no-drc", "pd-wan+one-shot"]
    assert modes[3].config_path == "ex/pdd.toml"
    assert modes[3].overrides == {"policy": {"enable_drc": False}}
    assert modes[4].overrides == {"policy": {"handoff_mode": "one_shot"}}
    assert runner.plan_modes(["a.toml"], ["catch-up"])[1].name == "a+catch-up"
    with pytest.raises(ValueError):
        runner.plan_modes(["pdd.toml"], ["no-such"])
    with pytest.raises(ValueError):
        runner.plan_modes(["x/pdd.toml", "y/pdd.toml"])


def test_mode_roles_and_baseline():
    assert report.mode_role("pdd+no-drc") == "pdd"
    assert report.mode_role("pd-wan") == "cross_dc_pd"
    assert report.mode_role("pd-local") == "in_dc_pd"
    assert report.mode_role("colocated") == "colocated"
    summary = {"modes": {"colocated": {}, "pd-local": {}, "pdd": {}, "broken": {"error": "x"}}}
    assert report.pick_baseline(summary) == "pd-local"
    assert report.pick_baseline(summary, "pdd") == "pdd"
    assert report.pick_baseline(summary, "broken") == "pd-local"


def _workload() -> Workload:
    a = list(range(100, 164))
    reqs = [WorkloadRequest("r0", 0.0, a, 4),
            WorkloadRequest("r1", 0.02, a + list(range(300, 310)), 4),
            WorkloadRequest("r2", 0.04, list(range(500, 540)), 2)]
    return Workload("tiny", reqs, settings={"kind": "test"}, block_size=16)


def test_run_bench_writes_everything(tmp_path: Path, capsys):
    fast = FakeBehaviour(token_delay_s=0.005)
    relay = FakeBehaviour(token_delay_s=0.005, trace_facts={"rld_tokens": 2, "handoff_gap_s": 0.02,
                                                            "pipeline": "relay"})
    start = FakeDeployment.factory(fast, pdd=relay)

    def factory(path, overrides=None, run_dir=None):
        if Path(path).stem == "broken":
            raise RuntimeError("instance p0 did not become healthy")
        return start(path, overrides, run_dir)

    modes = runner.plan_modes(["ex/pd-local.toml", "ex/broken.toml", "ex/pdd.toml"], ["no-filter"])
    summary = runner.run_bench(modes, _workload(), tmp_path, Sla(1.0, 0.1), factory=factory)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert set(on_disk["modes"]) == {"pd-local", "broken", "pdd", "pdd+no-filter"}
    assert "did not become healthy" in on_disk["modes"]["broken"]["error"]
    assert on_disk["baseline"] == "pd-local"
    assert on_disk["workload"]["num_requests"] == 3
    assert on_disk["sla"] == {"ttft_s": 1.0, "tpot_s": 0.1}
    pdd = on_disk["modes"]["pdd"]
    assert pdd["num_requests"] == 3 and pdd["num_failed"] == 0
    assert pdd["rld_token_share"] == pytest.approx(6 / 10)
    assert pdd["overrides"] is None
    assert on_disk["modes"]["pdd+no-filter"]["overrides"] == {"policy": {"enable_filter": False}}
    assert pdd["prefix_hit_rate"] == pytest.approx(on_disk["workload"]["theoretical_hit_rate"])
    lines = (tmp_path / "pdd" / "records.jsonl").read_text().splitlines()
    assert [json.loads(x)["request_id"] for x in lines] == ["r0", "r1", "r2"]
    assert read_records(tmp_path / "pdd" / "records.jsonl")[1].cached_tokens == 64
    for fig in summary["figures"]:
        assert (tmp_path / fig).stat().st_size > 1000
    assert {"ttft_cdf.png", "token_timelines.png", "wan_vs_hit.png"} <= set(summary["figures"])
    md = (tmp_path / "report.md").read_text()
    assert "| pdd |" in md and "-51.5%" in md and "![ttft_cdf.png](ttft_cdf.png)" in md
    report.print_table(on_disk)
    out = capsys.readouterr().out
    assert "pdd+no-filter" in out and "FAILED" in out and "pdd vs pd-local" in out


def test_cli_delegates_engine_bench(monkeypatch):
    from pdd import cli

    calls = []
    fake = types.ModuleType("pdd.engine.bench")
    fake.add_arguments = lambda p: (p.add_argument("--out"), p.add_argument("--steps", type=int, default=3))
    fake.run = lambda args: calls.append((args.out, args.steps)) or 0
    monkeypatch.setitem(sys.modules, "pdd.engine.bench", fake)
    assert cli.main(["bench", "engine", "--out", "results/engine.json", "--steps", "5"]) == 0
    assert calls == [("results/engine.json", 5)]


def test_cli_fake_end_to_end(tmp_path: Path, capsys):
    from pdd import cli

    rows = [{"timestamp": i * 10, "input_length": 600, "output_length": 64, "hash_ids": [0, 1 + i]}
            for i in range(4)]
    tr = tmp_path / "t.jsonl"
    tr.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "res"
    rc = cli.main(["bench", "-c", "ex/pd-local.toml", "-c", "ex/pdd.toml", "--fake", "--no-plots",
                   "--workload", f"trace:{tr}", "--quick", "--out", str(out)])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["modes"]["pdd"]["num_requests"] == 4
    assert summary["workload"]["settings"]["length_scale"] == pytest.approx(1 / 32)
    assert "pdd vs pd-local" in capsys.readouterr().out
    assert cli.main(["bench", "--quick", "--dry-run"]) == 0


def test_sum_metric_adds_the_samples_with_the_labels_asked():
    text = """# HELP pdd_kv_sent_bytes_total KV payload bytes sent
# TYPE pdd_kv_sent_bytes_total counter
pdd_kv_sent_bytes_total{instance="p0",link="wan",role="prefill"} 2.02743808e+08
pdd_kv_sent_bytes_total{instance="p0",link="local",role="prefill"} 1.3344768e+08
pdd_kv_sent_bytes_created{instance="p0",link="wan",role="prefill"} 1.79e+09
pdd_kv_sent_bytes_total_other{link="wan"} 5
"""
    assert runner.sum_metric(text, "pdd_kv_sent_bytes_total", link="wan") == 2.02743808e+08
    assert runner.sum_metric(text, "pdd_kv_sent_bytes_total") == 2.02743808e+08 + 1.3344768e+08
    assert runner.sum_metric(text, "pdd_kv_sent_bytes_total", link="rdma") == 0.0
    # a fake deployment has no instances to ask: the requests' own sum stands
    fake = types.SimpleNamespace(procs=[])
    assert runner.fetch_metrics(fake) == {} and runner.wan_sent_bytes(fake, {}) is None
    # an instance that did not answer: no total rather than a short one
    dep = types.SimpleNamespace(spec=types.SimpleNamespace(instances=[types.SimpleNamespace(name="p0"),
                                                                      types.SimpleNamespace(name="md0")]))
    assert runner.wan_sent_bytes(dep, {"p0": text.encode()}) is None
    assert runner.wan_sent_bytes(dep, {"p0": text.encode(), "md0": b""}) == 2.02743808e+08
