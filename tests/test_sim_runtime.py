"""The simulator on runtime deployment files: mapping, bench workloads,
shared cores, calibration from saved bench artefacts, validation, planning."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
import tomllib
from pathlib import Path

import pytest

from pdd.bench.runner import save_run_artefacts
from pdd.deploy.spec import load_spec, parse_spec
from pdd.measure.files import load_workload, save_workload
from pdd.measure.metrics import Sla, summarize_mode
from pdd.measure.records import RequestRecord
from pdd.measure.workload import Workload, WorkloadRequest
from pdd.policy import Role
from pdd.sim.bench_stream import BenchStream, chained_block_ids
from pdd.sim.calibration import CpuCalibration, fit
from pdd.sim.cluster import Cluster
from pdd.sim.cost_model import CostModel, StepShape, row_bucket
from pdd.sim.deployment import RuntimeOptions, mode_from_spec, model_shape
from pdd.sim.hardware import get_profile
from pdd.sim.model_shape import get_model
from pdd.sim.runtime import RuntimeMode, run_runtime_mode, simulate_deployments
from pdd.sim.scenario import Scenario, SimSettings

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def chain_workload(n_turns: int = 3, think_s: float = 0.5) -> Workload:
    """One closed-loop session (each turn extends the last) plus one open-loop request."""
    ctx, reqs, prev = ids(0, 600), [], None
    for t in range(n_turns):
        ctx = ctx + ids(10 + t, 40)
        reqs.append(WorkloadRequest(f"s-t{t}", 3.0 * t, list(ctx), 8, "s", t, prev, think_s))
        prev = f"s-t{t}"
    reqs.append(WorkloadRequest("a0", 1.0, ids(99, 500), 2))
    return Workload("test", reqs, {"kind": "test"}, 16)


def test_runtime_file_becomes_one_pool_per_instance():
    spec = load_spec(EXAMPLES / "pdd.toml")
    mode = mode_from_spec(spec)
    assert [(p.name, p.role.value, p.core, p.count) for p in mode.pools] == [
        (i.name, i.role.value, i.cpu, 1) for i in spec.instances]
    assert {p.role for p in mode.pools} == {Role.PREFILL, Role.RELAY, Role.MAIN}
    for pool, inst in zip(mode.pools, spec.instances):
        e = inst.engine
        assert (pool.kv_blocks, pool.max_batch, pool.token_budget, pool.chips, pool.hardware) == (
            e.num_blocks, e.max_num_seqs, e.max_num_batched_tokens, e.num_threads, "cpu")
    link = spec.links[0]
    assert mode.wan.gbps == pytest.approx(link.bandwidth_mbps / 1e3)
    assert mode.wan.rtt_ms == pytest.approx(2 * link.latency_ms + link.jitter_ms)
    assert mode.cost_per_hour() == pytest.approx(spec.cost_per_hour)
    assert mode.serving.match_round_trip and mode.serving.router_datacenter == "A"
    # 46,080 bytes of KV a token in fp32, half in the example's bf16
    assert model_shape(spec).kv_bytes_per_token == 46_080 * spec.instances[0].engine.dtype_bytes // 4


def test_bench_stream_chains_blocks_and_closes_the_loop():
    wl = chain_workload()
    s = BenchStream(wl, 16)
    first = s.initial()
    assert [r.request_id for r in first] == ["s-t0", "a0"]
    t0 = first[0]
    assert t0.block_ids == chained_block_ids(wl.requests[0].prompt_token_ids, 16)
    (t1,) = s.next_after(t0, 10.0, failed=False)
    assert t1.arrival_s == pytest.approx(10.5)          # think time after the user saw the end
    assert t1.block_ids[: len(t0.block_ids)] == t0.block_ids    # shared prefix, shared ids
    # the blocks its output completes (its last token is never computed)
    assert len(t0.full_block_ids) == (t0.prompt_tokens + t0.output_tokens - 1) // 16


def test_bench_stream_replays_the_recorded_send_times():
    """A replay sends each request when the run sent it; a closed-loop turn
    never before its predecessor ended in the simulation (counted as held)."""
    wl = chain_workload()
    sent = {"s-t0": 0.2, "a0": 1.4, "s-t1": 9.0, "s-t2": 20.0}
    s = BenchStream(wl, 16, sent)
    first = {r.request_id: r for r in s.initial()}
    assert first["s-t0"].arrival_s == 0.2 and first["a0"].arrival_s == 1.4
    (t1,) = s.next_after(first["s-t0"], 4.0, failed=False)
    assert t1.arrival_s == 9.0 and s.held == 0        # the run's time, not 4.0 + think time
    (t2,) = s.next_after(t1, 23.5, failed=False)
    assert t2.arrival_s == 23.5 and s.held == 1       # its predecessor ended after the recorded 20.0
    # A request the run has no time for keeps the workload's (a root) or the loop's (a turn).
    s = BenchStream(wl, 16, {"a0": 1.4})
    (t0,) = [r for r in s.initial() if r.request_id == "s-t0"]
    assert t0.arrival_s == 0.0
    (t1,) = s.next_after(t0, 4.0, failed=False)
    assert t1.arrival_s == pytest.approx(4.5) and s.held == 0


def test_a_quoted_answer_is_cached_under_the_next_prompts_block_ids():
    """A closed-loop turn whose next turn quotes its answer (`answer_at`):
    the decoder's output blocks carry the ids of the next prompt's blocks, so
    a decode-side cache that kept them hits there, as the engine's does."""
    p0 = ids(0, 630)
    p1 = p0 + ids(7, 40) + ids(8, 9)                    # the answer (40), then a tool's output
    wl = Workload("q", [WorkloadRequest("t0", 0.0, p0, 40, "s", 0),
                        WorkloadRequest("t1", 0.0, p1, 8, "s", 1, "t0", 0.5, answer_at=630)], {}, 16)
    (t0,) = BenchStream(wl, 16).initial()
    (t1,) = BenchStream(wl, 16).next_after(t0, 1.0, failed=False)
    full = (630 + 40 - 1) // 16
    assert len(t0.full_block_ids) == full > len(t0.block_ids)
    assert t0.full_block_ids == t1.block_ids[:full]


def test_simulated_run_has_the_bench_summary_schema(tmp_path):
    wl = chain_workload()
    summary = simulate_deployments([RuntimeMode("pd-local", str(EXAMPLES / "pd-local.toml")),
                                    RuntimeMode("pdd", str(EXAMPLES / "pdd.toml"))],
                                   wl, Sla(30.0, 1.0), tmp_path, plots=False)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert {"workload", "sla", "modes", "wall_s", "simulated_s", "baseline"} <= set(on_disk)
    bench_keys = set(summarize_mode([], Sla(1, 1), 1.0, 1.0))
    for name in ("pd-local", "pdd"):
        m = summary["modes"][name]
        assert bench_keys <= set(m) and m["num_failed"] == 0 and m["num_requests"] == 4
        recs = [RequestRecord.from_dict(json.loads(x))
                for x in (tmp_path / name / "records.jsonl").read_text().splitlines()]
        by_id = {r.request_id: r for r in recs}
        # Closed loop: turn t+1 is due after turn t ended (+ think time); P's cache serves it.
        t0, t1 = by_id["s-t0"], by_id["s-t1"]
        assert t1.arrival_s >= t0.arrival_s + t0.e2e_s + 0.5 - 1e-9
        assert t1.cached_tokens >= 640 - 16
    assert summary["modes"]["pdd"]["wan_bytes"] > 0 or summary["modes"]["pdd"]["rld_token_share"] > 0


def _two_colocated(tmp_path: Path, cpus: tuple[int, int]) -> Path:
    from pdd.sim.toml_out import dumps

    doc = tomllib.loads((EXAMPLES / "colocated.toml").read_text())
    a = {k: v for k, v in doc["instances"][0].items() if k != "engine"}
    doc["instances"] = [{**a, "cpu": cpus[0]},
                        {**a, "name": "c1", "port": a["port"] + 50, "kv_port": a["kv_port"] + 50,
                         "cpu": cpus[1]}]
    path = tmp_path / f"two-{cpus[0]}{cpus[1]}.toml"
    path.write_text(dumps(doc))
    load_spec(path)
    return path


def test_instances_pinned_to_one_core_share_it(tmp_path):
    wl = Workload("two", [WorkloadRequest("x", 0.0, ids(1, 1024), 4),
                          WorkloadRequest("y", 0.0, ids(2, 1024), 4)], {}, 16)
    ttft = {}
    for cpus in ((0, 1), (0, 0)):
        entry, recs, _ = run_runtime_mode(RuntimeMode("two", str(_two_colocated(tmp_path, cpus))),
                                          wl, Sla(60.0, 1.0))
        assert entry["num_failed"] == 0
        ttft[cpus] = max(r.ttft_s for r in recs)
    # Two prefills at once on one core each take about twice as long.
    assert ttft[(0, 0)] == pytest.approx(2 * ttft[(0, 1)], rel=0.1)


def _steps(model: CostModel, rng: random.Random, n: int, scale: float = 1.0) -> list[dict]:
    out = []
    for _ in range(n):
        if rng.random() < 0.2:
            c = rng.randint(64, 512)
            rec = {"num_prefill_tokens": c, "num_decode_tokens": 0, "batch_size": 1,
                   "context_lens": [c + rng.randint(0, 1500)]}
        else:
            b = rng.randint(1, 4)
            rec = {"num_prefill_tokens": 0, "num_decode_tokens": b, "batch_size": b,
                   "context_lens": [rng.randint(100, 2000) for _ in range(b)]}
        rec["wall_s"] = model.step_time(StepShape.from_record(rec)) * scale * rng.uniform(0.97, 1.03)
        out.append(rec)
    return out


def fp32(toml_text: str) -> str:
    """An example file served in fp32 (the model `get_model` describes)."""
    return "\n".join(line for line in toml_text.splitlines() if not line.startswith("dtype = "))


def _fake_run(tmp_path: Path, steps: int = 80) -> Path:
    """A bench result folder: pd-local at 1x, pdd at 1.4x (a busy machine),
    `steps` engine steps per instance."""
    true = CostModel(get_model("smollm2-135m"), get_profile("cpu"), mfu=0.3, mbu=0.5,
                     overhead_s=0.005, per_seq_s=0.01)
    rng = random.Random(0)
    run = tmp_path / "run"
    for mode, scale in (("pd-local", 1.0), ("pdd", 1.4)):
        d = run / mode
        d.mkdir(parents=True)
        (d / "deploy.toml").write_text(fp32((EXAMPLES / f"{mode}.toml").read_text()))
        insts = load_spec(d / "deploy.toml").instances
        cores = [i.cpu for i in insts if i.cpu is not None]
        with open(d / "steps.jsonl", "w") as f:
            for inst in insts:
                name = inst.name
                # Instances sharing a core: their walls carry the neighbour's slices.
                extra = 2.0 if inst.cpu is not None and cores.count(inst.cpu) > 1 else 1.0
                for rec in _steps(true, rng, steps, scale * extra):
                    f.write(json.dumps({"instance": name, **rec}) + "\n")
    return run


def test_calibration_from_bench_folders(tmp_path):
    run = _fake_run(tmp_path)
    cal = fit([run], get_model("smollm2-135m"))
    f = cal.fits[1]
    assert f.r2 > 0.9
    shared = {f"{m}/{i.name}" for m in ("pd-local", "pdd")
              for i in load_spec(run / m / "deploy.toml").instances
              if i.cpu is not None and [j.cpu for j in load_spec(run / m / "deploy.toml").instances].count(i.cpu) > 1}
    assert shared and not shared & set(f.instances)      # shared cores left out
    assert cal.load["pdd"] / cal.load["pd-local"] == pytest.approx(1.4, rel=0.08)
    path = tmp_path / "cal.json"
    cal.save(path)
    again = CpuCalibration.read(path)
    assert again.fits[1].mfu == pytest.approx(f.mfu) and again.time_scale("pdd") == cal.load["pdd"]
    assert set(again.coefficients(2)) == {"mfu", "mbu", "overhead_s", "per_seq_s", "attn_cost"}
    assert again.fits[1].attn_cost == pytest.approx(f.attn_cost)


def test_a_replay_measures_the_machine_speed_on_its_own_run(tmp_path):
    """A profile fitted on one run, replaying another: its fits carry over,
    each instance's speed is read from the replayed run's own steps."""
    from pdd.sim.calibration import with_run_speeds

    cal = fit([_fake_run(tmp_path / "a")], get_model("smollm2-135m"))
    other = _fake_run(tmp_path / "b")
    for mode in ("pd-local", "pdd"):               # the same run, on a machine 1.3x slower
        f = other / mode / "steps.jsonl"
        rows = [json.loads(line) for line in f.read_text().splitlines()]
        f.write_text("".join(json.dumps(r | {"wall_s": r["wall_s"] * 1.3}) + "\n" for r in rows))
    again = with_run_speeds(cal, [other], get_model("smollm2-135m"))
    assert again.fits == cal.fits and again.role_fits == cal.role_fits
    assert again.instance_load.keys() == cal.instance_load.keys()
    for key, speed in cal.instance_load.items():
        assert again.instance_load[key] / speed == pytest.approx(1.3, rel=0.02), key
    assert again.load["pdd"] / cal.load["pdd"] == pytest.approx(1.3, rel=0.02)


def test_calibration_takes_the_runs_engine_dtype(tmp_path):
    """A run served in bf16 is fitted with half the embedded model's weight and KV
    bytes (read from the deploy.toml beside its steps); mixed dtypes are refused."""
    from pdd.sim.deployment import calibration_model

    run = _fake_run(tmp_path)
    fp32 = calibration_model("smollm2-135m", [run])
    assert fp32 == get_model("smollm2-135m")
    for mode in ("pd-local", "pdd"):
        f = run / mode / "deploy.toml"
        f.write_text(f.read_text().replace("[engine]", '[engine]\ndtype = "bfloat16"', 1))
    bf16 = calibration_model("smollm2-135m", [run])
    assert 2 * bf16.kv_bytes_per_token == fp32.kv_bytes_per_token
    assert 2 * bf16.weight_bytes_per_param == fp32.weight_bytes_per_param
    assert calibration_model("smollm2-135m", [run / "pdd" / "steps.jsonl"]) == bf16
    f = run / "pdd" / "deploy.toml"
    f.write_text(f.read_text().replace('dtype = "bfloat16"', 'dtype = "float32"'))
    with pytest.raises(ValueError, match="different engine dtypes"):
        calibration_model("smollm2-135m", [run])


def test_validate_a_bench_folder(tmp_path):
    """Validation of a run whose 'measurements' are the simulator's own: zero error."""
    from pdd.sim.validate import validate

    run = _fake_run(tmp_path)
    wl = chain_workload()
    save_workload(wl, run / "workload.json")
    assert [r.prompt_token_ids for r in load_workload(run / "workload.json").requests] == \
        [r.prompt_token_ids for r in wl.requests]
    cal = fit([run], get_model("smollm2-135m"))
    sla = Sla(30.0, 1.0)
    modes = [RuntimeMode(m, str(run / m / "deploy.toml"), run=m) for m in ("pd-local", "pdd")]
    summary = simulate_deployments(modes, wl, sla, run, cal, plots=False)   # + <mode>/records.jsonl
    (run / "summary.json").write_text(json.dumps({k: summary[k] for k in ("workload", "sla", "modes")}))
    v = validate(run, seeds=1)      # the seed the "measurements" were drawn with
    assert json.loads((run / "validation.json").read_text())["modes"].keys() == {"pd-local", "pdd"}
    assert v["arrivals"] == "recorded"
    for row in v["modes"].values():
        assert row["sim"]["arrivals_held"] == 0
        for metric in ("ttft_p50", "ttft_p90", "tpot_mean", "goodput_rps"):
            assert row[metric] == pytest.approx(0.0, abs=1e-9)
    closed = validate(run, seeds=1, arrivals="closed-loop")
    assert closed["arrivals"] == "closed-loop" and "arrivals_held" not in closed["modes"]["pdd"]["sim"]
    for row in closed["modes"].values():
        for metric in ("ttft_p50", "ttft_p90", "tpot_mean"):
            assert row[metric] == pytest.approx(0.0, abs=1e-9)
    with pytest.raises(ValueError, match="arrivals"):
        validate(run, seeds=1, arrivals="open")
    # The command line: recorded by default, --closed-loop for the old replay.
    from pdd.cli import main

    for flags, kind in (([], "recorded"), (["--closed-loop"], "closed-loop")):
        assert main(["sim", "--validate", str(run), "--seeds", "1", *flags]) == 0
        assert json.loads((run / "validation.json").read_text())["arrivals"] == kind
    # The replay's requests arrive at the times it is given.
    shifted = {r.request_id: r.arrival_s + 2.0 for r in wl.requests if r.depends_on is None}
    _, recs, _ = run_runtime_mode(modes[1], wl, sla, cal, arrivals=shifted)
    assert {r.request_id: r.arrival_s for r in recs if r.request_id in shifted} == shifted
    d = v["modes"]["pdd"]["decisions"]
    assert d["compared"] == len(wl.requests) and d["agree"] == d["compared"] and d["differ"] == {}
    # A record that says otherwise is counted as a disagreement.
    path = run / "pdd" / "records.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["pipeline"] = "relay" if rows[0]["pipeline"] != "relay" else "direct"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    d = validate(run, seeds=1)["modes"]["pdd"]["decisions"]
    assert d["agree"] == d["compared"] - 1 and sum(d["differ"].values()) == 1
    # Several seeds: the prediction is their median, inside their range.
    v = validate(run, seeds=3)
    assert v["seeds"] == 3
    for row in v["modes"].values():
        for metric in ("ttft_p50", "ttft_p90", "tpot_mean"):
            lo, hi = row["sim_range"][metric]
            assert lo <= row["sim"][metric] <= hi
    # Two validations summarised: counts over both, the real values' spread.
    from pdd.sim.validate import summarize

    exact = validate(run, seeds=1)
    s = summarize([exact, v])
    assert s["modes"].keys() == {"pd-local", "pdd"}
    cell = s["modes"]["pd-local"]["ttft_p90"]
    assert cell["n"] == 2 and cell["errors"][0] == pytest.approx(0.0, abs=1e-9)
    assert cell["within_target"] == sum(abs(e) <= 0.10 for e in cell["errors"]) >= 1
    assert cell["real_min"] == cell["real_max"] == exact["modes"]["pd-local"]["real"]["ttft_p90"]
    assert s["modes"]["pd-local"]["goodput_rps"]["within_target"] is None
    tot = s["totals"]["ttft_p90"]
    assert tot["n"] == 4 and tot["within_target"] == sum(
        s["modes"][m]["ttft_p90"]["within_target"] for m in ("pd-local", "pdd"))
    assert "goodput_rps" not in s["totals"]
    # Pooled over both runs: the simulator's own "measurements" again, so the
    # pooled percentiles agree as well (seed 0 is in both replays).
    pooled = summarize([exact, exact])["pooled"]
    assert pooled.keys() == {"pd-local", "pdd"}
    for row in pooled.values():
        assert row["runs"] == 2
        for metric in ("ttft_p50", "ttft_p90", "tpot_mean"):
            assert row[metric]["error"] == pytest.approx(0.0, abs=1e-9)
    assert len(exact["modes"]["pdd"]["samples"]["real"]["ttft_s"]) == len(wl.requests)


def test_calibration_fits_each_role_its_own_fixed_costs(tmp_path):
    """P's server work per step (KV export) shows as P's own overhead, not a
    per-token cost spread over every instance; MD/RLD borrow the decoders' fit."""
    model = get_model("smollm2-135m")
    truth = {"prefill": CostModel(model, get_profile("cpu"), mfu=0.4, mbu=0.5, overhead_s=0.10,
                                  per_seq_s=0.0),
             "decode": CostModel(model, get_profile("cpu"), mfu=0.4, mbu=0.5, overhead_s=0.01,
                                 per_seq_s=0.02)}
    rng = random.Random(1)
    d = tmp_path / "run" / "pd-local"
    d.mkdir(parents=True)
    (d / "deploy.toml").write_text((EXAMPLES / "pd-local.toml").read_text())
    with open(d / "steps.jsonl", "w") as f:
        for _ in range(120):
            c = rng.choice([32, 80, 200, 512])
            rec = {"instance": "p0", "num_prefill_tokens": c, "num_decode_tokens": 0,
                   "batch_size": 1, "context_lens": [c + rng.randint(0, 1000)]}
            rec["wall_s"] = truth["prefill"].step_time(StepShape.from_record(rec)) * rng.uniform(0.9, 1.1)
            f.write(json.dumps(rec) + "\n")
            b = rng.randint(1, 8)
            rec = {"instance": "d0", "num_prefill_tokens": 0, "num_decode_tokens": b, "batch_size": b,
                   "context_lens": [rng.randint(100, 1500) for _ in range(b)]}
            rec["wall_s"] = truth["decode"].step_time(StepShape.from_record(rec)) * rng.uniform(0.9, 1.1)
            f.write(json.dumps(rec) + "\n")
    cal = fit([tmp_path / "run"], model)
    assert set(cal.role_fits) == {"prefill", "decode"}
    pre, dec = cal.fit_for(1, "prefill"), cal.fit_for(1, "main")
    assert pre.overhead_s == pytest.approx(0.10, rel=0.25) and dec.overhead_s < 0.05
    assert dec is cal.role_fits["decode"][1] and cal.fit_for(1, "relay") is dec
    assert cal.fit_for(1, "colocated") is cal.fits[1]          # no colocated data: the pooled fit
    for role, m in truth.items():            # each role's steps within their noise
        f_ = cal.fit_for(1, role)
        for c in (32, 512):
            s = StepShape(c, 0, 1, (c + 500,)) if role == "prefill" else StepShape(0, c // 32 + 1, c // 32 + 1, (800,) * (c // 32 + 1))
            got = CostModel(model, get_profile("cpu"), mfu=f_.mfu, mbu=f_.mbu, overhead_s=f_.overhead_s,
                            per_seq_s=f_.per_seq_s, attn_cost=f_.attn_cost).step_time(s)
            assert got == pytest.approx(m.step_time(s), rel=0.08)
        # Uniform +-10% scatter: a robust sigma of ~0.06 in log terms.
        assert 0.03 < f_.jitter < 0.09
    again = CpuCalibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert again.fit_for(1, "prefill") == pre
    spec = load_spec(d / "deploy.toml")
    mode = mode_from_spec(spec, "pd-local", cal)
    by_name = {p.name: p for p in mode.pools}
    assert by_name["p0"].overhead_s == pre.overhead_s and by_name["d0"].overhead_s == dec.overhead_s
    assert by_name["p0"].step_jitter == pre.jitter > 0
    quiet = mode_from_spec(spec, "pd-local", cal, dataclasses.replace(RuntimeOptions(), step_jitter=False))
    assert all(p.step_jitter == 0 for p in quiet.pools)


def test_step_jitter_is_seeded_and_keeps_the_mean():
    # fp32, the file as this test was written for (on the bf16 example, one
    # of the four turns' TTFT averaged over 12 seeds came out 20% off)
    spec = load_spec(EXAMPLES / "pd-local.toml", {"engine": {"dtype": "float32"}})
    wl = chain_workload(n_turns=4)
    base = mode_from_spec(spec, "pd-local")
    def ttfts(jitter: float, seed: int) -> list[float]:
        pools = tuple(dataclasses.replace(p, step_jitter=jitter) for p in base.pools)
        mode = dataclasses.replace(base, pools=pools, seed=seed)
        sc = Scenario(model_shape(spec), None, Sla(60.0, 1.0), (mode,), SimSettings(drain_s=1e6))
        reqs = Cluster(mode, sc, BenchStream(wl, 16)).run(1e6)
        return [r.record().ttft_s for r in sorted(reqs, key=lambda r: r.spec.request_id)]
    exact = ttfts(0.0, 0)
    assert ttfts(0.2, 1) == ttfts(0.2, 1) != ttfts(0.2, 2)
    assert ttfts(0.2, 1) != exact
    # Mean-one factors: averaged over seeds, a request's TTFT stays near the exact one.
    runs = [ttfts(0.2, s) for s in range(12)]
    for i, t in enumerate(exact):
        assert sum(r[i] for r in runs) / len(runs) == pytest.approx(t, rel=0.15)
    with pytest.raises(ValueError, match="step_jitter"):
        dataclasses.replace(base.pools[0], step_jitter=1.5)


def test_runner_saves_deploy_file_and_steps(tmp_path, monkeypatch):
    from pdd.bench import runner

    spec = load_spec(EXAMPLES / "pd-local.toml")
    fake = type("Dep", (), {"spec": spec, "secret": b"s" * 32,
                            "instance_url": lambda self, name: (f"http://127.0.0.1:1/{name}", None)})()
    monkeypatch.setattr(runner, "fetch_steps", lambda url, secret, target, context=None: [
        {"instance": url[-4:], "num_prefill_tokens": 1, "num_decode_tokens": 0, "batch_size": 1,
         "context_lens": [1], "wall_s": 0.1}])
    save_run_artefacts(fake, runner.ModeSpec("pd-local", str(EXAMPLES / "pd-local.toml")), tmp_path)
    assert (tmp_path / "deploy.toml").read_text() == (EXAMPLES / "pd-local.toml").read_text()
    assert len((tmp_path / "steps.jsonl").read_text().splitlines()) == 2
    # A fake deployment (no spec, no secret) only gets the file copy, silently.
    other = tmp_path / "fake"
    other.mkdir()
    save_run_artefacts(object(), runner.ModeSpec("x", "no/such.toml", {"policy": {"a": 1}}), other)
    assert sorted(p.name for p in other.iterdir()) == ["overrides.json"]


def test_plan_writes_loadable_winners(tmp_path):
    from pdd.sim.plan import deployment_doc, resize, scenario_doc
    from pdd.sim.scenario import load, parse
    from pdd.sim.toml_out import dumps

    spec = load_spec(EXAMPLES / "pdd.toml")
    big = resize(spec, {"prefill": 3, "main": 2})
    assert [i.name for i in big.by_role(big.instances[0].role)] == ["p0", "p1", "p2"]
    again = parse_spec(tomllib.loads(dumps(deployment_doc(big), inline=("engine",))))
    assert [(i.name, i.port, i.engine) for i in again.instances] == \
        [(i.name, i.port, i.engine) for i in big.instances]
    sc = load([EXAMPLES / "sim" / "tiny.toml"])
    back = parse(tomllib.loads(dumps(scenario_doc(sc, sc.modes[0]))))
    assert back.modes[0] == sc.modes[0] and back.workload == sc.workload and back.model == sc.model


def test_single_chunk_packing_runs_tail_chunks_alone():
    from pdd.sim.runner import run_mode
    from pdd.sim.scenario import load
    from pdd.sim.workload import FixedHitWorkload

    sc = load([EXAMPLES / "sim" / "tiny.toml"])
    wl = FixedHitWorkload(duration_s=40.0, num_users=8, prompt_tokens=8192, output_tokens=16,
                          hit_rate=0.5, turns=4, think_time_s=0.5, block_size=64)
    sc = dataclasses.replace(sc, workload=wl, settings=dataclasses.replace(sc.settings, warmup_s=0.0))
    mode = next(m for m in sc.modes if m.name == "colocated")
    steps = {}
    for packing in ("packed", "single"):
        m = dataclasses.replace(mode, pools=tuple(dataclasses.replace(p, chunk_packing=packing)
                                                  for p in mode.pools))
        e, _, _ = run_mode(sc, m)
        assert e["num_failed"] == 0
        assert e["prefix_hit_rate"] == pytest.approx(0.5 * 3 / 4, abs=0.06)
        steps[packing] = sum(p["steps"] for p in e["sim"]["pools"].values())
    assert steps["single"] > steps["packed"]


def test_filtered_requests_with_a_hot_shared_prefix_warm_md():
    """Long-input / 2-token calls sharing 256 instruction tokens: the WAN stays
    free for the first ones; once P has seen the prefix reused twice, the
    filtered request still pushes those 16 blocks to MD, and a later normal
    request with that prefix finds them there. (Four abnormal calls of five
    requests: the relay budgets are lifted here; they have their own tests.)"""
    shared = ids(500, 256)
    reqs = [WorkloadRequest(f"a{k}", 8.0 * k, shared + ids(600 + k, 400), 2) for k in range(4)]
    reqs.append(WorkloadRequest("n0", 40.0, shared + ids(700, 40), 64))
    wl = Workload("warm", reqs, {"kind": "test"}, 16)
    # 30 MB of KV on a 40 Mbit/s line: 6 s, far longer than P's 2-4 s
    # prefill can hide (streamed layer by layer, a 100 Mbit/s line would
    # carry it almost all during the prefill, and direct would be right).
    mode = RuntimeMode("pdd", str(EXAMPLES / "pdd.toml"),
                       {"policy": {"relay_only_max_share": 1.0, "relay_max_token_share": 1.0,
                                   "filter_min_io_ratio": 100.0},        # 656 / 2 tokens: in the class
                        "links": {"bandwidth_mbps": 40.0}})
    entry, records, _ = run_runtime_mode(mode, wl, Sla(3.0, 0.25))
    by_id = {r.request_id: r for r in records}
    assert [by_id[f"a{k}"].pipeline for k in range(4)] == ["relay_filtered"] * 4
    kv_block = 16 * 46080 * load_spec(EXAMPLES / "pdd.toml").instances[0].engine.dtype_bytes // 4
    assert [by_id[f"a{k}"].wan_bytes for k in range(4)] == [0, 0, 0, 16 * kv_block]
    # MD held the shared prefix: only the follow-up's own 2 full blocks (of
    # 40 tokens; MD computes the partial one) crossed the WAN, straight to MD.
    n0 = by_id["n0"]
    assert n0.pipeline == "direct" and n0.wan_bytes == 2 * kv_block


def _pdd_run_folder(tmp_path: Path):
    """A bench mode folder of examples/pdd.toml with RLD moved onto MD's core
    at MD's priority (the example's layout until session 20): (folder, spec,
    MD's name, RLD's name)."""
    from test_sim_events import pdd_as_written

    d = tmp_path / "run" / "pdd"
    d.mkdir(parents=True)
    pdd_as_written(d / "deploy.toml")
    spec = load_spec(d / "deploy.toml")
    md = next(i.name for i in spec.instances if i.role.value == "main")
    rld = next(i.name for i in spec.instances if i.role.value == "relay")
    return d, spec, md, rld


def test_steps_of_a_shared_core_count_as_alone_when_no_neighbour_ran(tmp_path):
    """MD and RLD share core 1 (`_pdd_run_folder`): an MD step during which
    RLD ran no step measures MD's own speed and joins the fit; one that
    overlapped an RLD step carries RLD's time slices and does not."""
    d, spec, md, rld = _pdd_run_folder(tmp_path)
    step = {"num_prefill_tokens": 0, "num_decode_tokens": 2, "batch_size": 2, "context_lens": [500, 600]}
    rows = [
        {"instance": md, "start_s": 100.0, "wall_s": 0.5, **step},    # alone
        {"instance": rld, "start_s": 100.6, "wall_s": 0.5, **step},   # overlaps MD's 2nd
        {"instance": md, "start_s": 101.0, "wall_s": 0.5, **step},    # overlaps RLD's 1st
        {"instance": md, "start_s": 101.7, "wall_s": 0.2, **step},    # alone (RLD ended at 101.1)
        {"instance": rld, "start_s": 102.0, "wall_s": 0.1, **step},   # alone
        {"instance": md, "start_s": 103.0, "wall_s": 0.2, **{k: v for k, v in step.items()}},
    ]
    rows[-1].pop("start_s")                                             # no clock: stays shared
    (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from pdd.sim.calibration_steps import load_records, read_records

    # The fit takes the steps that ran alone (all three of them, nothing else).
    recs = load_records(read_records([tmp_path / "run"]))[1]
    assert [(r["name"], r["start_s"]) for r in recs] == [(md, 100.0), (md, 101.7), (rld, 102.0)]
    assert all(r["alone"] and r["group"] == "decode" for r in recs)


def test_calibration_measures_batch_kernels_and_a_shared_core(tmp_path):
    """Steps made by a known engine: batch-2 decode steps 20% under the smooth
    model, batch-4 ones 20% over it; MD and RLD (on one core, `_pdd_run_folder`)
    sometimes step together, each at 0.8 / 2 of the core meanwhile. The fit
    finds both and the replayed mode carries them."""
    from pdd.sim.calibration_factors import _speed_factor

    model = get_model("smollm2-135m")
    truth = CostModel(model, get_profile("cpu"), mfu=0.4, mbu=0.5, overhead_s=0.01, per_seq_s=0.005)
    kernel = {1: 1.0, 2: 0.8, 3: 1.0, 4: 1.2}
    eff = 0.8
    rng = random.Random(3)
    d, spec, md, rld = _pdd_run_folder(tmp_path)

    def decode(b: int) -> tuple[dict, float]:
        rec = {"num_prefill_tokens": 0, "num_decode_tokens": b, "batch_size": b,
               "context_lens": [rng.randint(500, 1500) for _ in range(b)]}
        return rec, truth.step_time(StepShape.from_record(rec)) * kernel[b] * rng.uniform(0.98, 1.02)

    rows, t = [], 1000.0
    for k in range(400):
        if k % 4 == 3:      # both step at once: each ends after 2 A / eff
            rec, alone = decode(2)
            wall = 2 * alone / eff
            for name in (md, rld):
                rows.append({"instance": name, "start_s": t, "wall_s": wall, **rec})
            t += wall + 0.001
        else:               # one alone
            rec, wall = decode(rng.randint(1, 4))
            rows.append({"instance": md if k % 2 else rld, "start_s": t, "wall_s": wall, **rec})
            t += wall + 0.001
    (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cal = fit([tmp_path / "run"], model)
    f = cal.fit_for(1, "main")
    bf = f.row_factors
    assert len(bf) == 4
    fitted = CostModel(model, get_profile("cpu"), mfu=f.mfu, mbu=f.mbu, overhead_s=f.overhead_s,
                       per_seq_s=f.per_seq_s, attn_cost=f.attn_cost)
    for b in (1, 2, 3, 4):      # the smooth fit alone misses by up to ~12%; with the factors, <4%
        s = StepShape(0, b, b, (1000,) * b)
        real = truth.step_time(s) * kernel[b]
        assert fitted.step_time(s) * bf[b - 1] * cal.instance_load[f"pdd/{md}"] == pytest.approx(real, rel=0.04)
    assert cal.core_sharing == pytest.approx(eff, abs=0.05)
    mode = mode_from_spec(spec, "pdd", cal, run="pdd")
    assert mode.core_sharing == cal.core_sharing
    own = cal.row_factors(1, "main", "pdd", md)         # the role's, times MD's own (noise here)
    assert {p.name: p.row_factors for p in mode.pools}[md] == own
    assert own == pytest.approx(bf, rel=0.03)
    again = CpuCalibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert again.core_sharing == cal.core_sharing and again.fit_for(1, "relay").row_factors == bf
    # An instance's speed is its mean ratio (TPOT is a mean), a gross outlier left out.
    assert _speed_factor([(1.0, 1.0), (1.0, 1.0), (1.3, 2.0)]) == pytest.approx(1.15)
    assert _speed_factor([(1.0, 1.0)] * 9 + [(10.0, 1.0)]) == pytest.approx(1.0)


def test_calibration_measures_a_decoders_steps_that_decode_nothing(tmp_path):
    """Two runs alike but for a decoder's lone chunks (a sequence's first step
    with nothing else decoding, ~3% of its steps as on the servers), which
    ran 1.5x slower in the second: the fit's lone-chunk factor tells them
    apart by that much (unshrunk from its prior), keeps it through the
    calibration file, and the replayed decoders carry it; P's pool does not."""
    from pdd.sim.calibration_factors import MIN_LONE_STEPS, ROW_PRIOR

    model = get_model("smollm2-135m")
    truth = CostModel(model, get_profile("cpu"), mfu=0.4, mbu=0.5, overhead_s=0.01, per_seq_s=0.005)

    def run(sub: str, slower: float):
        rng = random.Random(5)
        d, spec, md, rld = _pdd_run_folder(tmp_path / sub)
        rows, t, lone = [], 1000.0, 0
        for k in range(900):
            if k % 30 == 29:
                rec = {"num_prefill_tokens": rng.randint(2, 15), "num_decode_tokens": 0, "batch_size": 1,
                       "context_lens": [rng.randint(1000, 2000)]}
                wall, lone = truth.step_time(StepShape.from_record(rec)) * slower, lone + 1
            else:
                b = rng.randint(1, 4)
                rec = {"num_prefill_tokens": 0, "num_decode_tokens": b, "batch_size": b,
                       "context_lens": [rng.randint(500, 1500) for _ in range(b)]}
                wall = truth.step_time(StepShape.from_record(rec)) * rng.uniform(0.98, 1.02)
            rows.append({"instance": md if k % 2 else rld, "start_s": t, "wall_s": wall, **rec})
            t += wall + 0.001
        (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        assert lone >= MIN_LONE_STEPS
        cal = fit([tmp_path / sub / "run"], model)
        f = cal.fit_for(1, "main").lone_chunk
        return cal, spec, ((lone + ROW_PRIOR) * f - ROW_PRIOR) / lone      # the factor before the prior

    _, _, plain = run("a", 1.0)
    cal, spec, slow = run("b", 1.5)
    assert slow / plain == pytest.approx(1.5, rel=0.03)
    f = cal.fit_for(1, "main").lone_chunk
    again = CpuCalibration.from_dict(json.loads(json.dumps(cal.to_dict())))
    assert again.fit_for(1, "relay").lone_chunk == f != 1.0
    old = cal.to_dict()
    for fits in [old["fits"], *old["role_fits"].values()]:
        for v in fits.values():
            v.pop("lone_chunk")
    assert CpuCalibration.from_dict(old).fit_for(1, "main").lone_chunk == 1.0    # a file from before it
    mode = mode_from_spec(spec, "pdd", cal, run="pdd")
    factors = {p.role: p.lone_chunk_factor for p in mode.pools}
    assert factors[Role.MAIN] == factors[Role.RELAY] == f


def test_everything_due_at_a_step_boundary_runs_before_the_next_step():
    """As the server's engine loop drains every queued command between two
    steps, two submits due at one boundary both join the step after it: the
    first one's kick must not start that step without the second."""
    from pdd.sim.instance import Seq
    from pdd.sim.request import RequestSpec, SimRequest

    spec = load_spec(EXAMPLES / "pd-local.toml")
    mode = mode_from_spec(spec, "pd-local")
    sc = Scenario(model_shape(spec), None, Sla(60.0, 1.0), (mode,), SimSettings(drain_s=1e6))
    cluster = Cluster(mode, sc, BenchStream(chain_workload(), 16))
    d = next(i for i in cluster.instances.values() if i.role is Role.DECODE)

    def seq(rid: str) -> Seq:
        r = SimRequest(RequestSpec(rid, 0.0, 100, 50, 50, ()))
        r.num_generated = 1
        return Seq(r, 101, 8, relay=False)

    d.add_seq(seq("running"))
    (end,) = cluster._kick(d, 0.0)                 # a decode step under way
    for rid in ("x", "y"):
        d.wait_boundaries(1, lambda t, s=seq(rid): cluster._submit(d, s, t))
    cluster._step_done(d, end.time)
    assert sorted(s.req.spec.request_id for s in d._batch) == ["running", "x", "y"]


def test_core_sharing_reads_each_steps_share_of_the_core():
    """A step of A seconds alone, overlapped by a neighbour for O seconds,
    runs at e x its share meanwhile: W = A + O (1 - e s). Steps of an engine
    niced below its neighbour (s = 1/4) and of that neighbour (s = 3/4) give
    back the same e as two engines of equal priority (s = 1/2)."""
    from pdd.sim.calibration import core_sharing

    e = 0.8
    def rec(alone_s: float, overlap_s: float, share: float | None) -> dict:
        r = {"alone": False, "wall_s": alone_s + overlap_s * (1 - e * (0.5 if share is None else share)),
             "overlap_s": overlap_s, "A": alone_s}
        if share is not None:
            r["share"] = share
        return r
    weighted = [rec(0.3, 0.3, 0.25) for _ in range(20)] + [rec(0.4, 0.4, 0.75) for _ in range(20)]
    assert core_sharing(weighted, lambda r: r["A"]) == pytest.approx(e)
    equal = [rec(0.3, 0.3, None) for _ in range(40)]          # no "share": two of equal priority
    assert core_sharing(equal, lambda r: r["A"]) == pytest.approx(e)
    # Read as equal shares, the niced engine's long walls would have said less.
    as_equal = [{k: v for k, v in r.items() if k != "share"} for r in weighted]
    assert core_sharing(as_equal, lambda r: r["A"]) != pytest.approx(e, abs=0.05)


def test_a_niced_neighbours_steps_carry_its_share_of_the_core(tmp_path):
    """examples/pdd.toml: RLD shares P's core at nice 5. A P step that RLD
    overlapped ran at ~3/4 of the core meanwhile, an RLD step at ~1/4; MD,
    alone on its core, is never marked."""
    from pdd.sim.calibration_steps import read_records

    d = tmp_path / "run" / "pdd"
    d.mkdir(parents=True)
    (d / "deploy.toml").write_text((EXAMPLES / "pdd.toml").read_text())
    spec = load_spec(d / "deploy.toml")
    by_role = {i.role.value: i for i in spec.instances}
    p, rld, md = by_role["prefill"], by_role["relay"], by_role["main"]
    assert p.cpu == rld.cpu != md.cpu and (p.nice, rld.nice) == (0, 5)
    pre = {"num_prefill_tokens": 512, "num_decode_tokens": 0, "batch_size": 1, "context_lens": [512]}
    dec = {"num_prefill_tokens": 0, "num_decode_tokens": 1, "batch_size": 1, "context_lens": [900]}
    rows = [{"instance": p.name, "start_s": 10.0, "wall_s": 0.5, **pre},
            {"instance": rld.name, "start_s": 10.2, "wall_s": 0.4, **dec},
            {"instance": md.name, "start_s": 10.1, "wall_s": 0.1, **dec}]
    (d / "steps.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recs = {r["name"]: r for r in read_records([tmp_path / "run"])}
    w = 1.25 ** -5
    assert recs[p.name]["share"] == pytest.approx(1 / (1 + w))
    assert recs[rld.name]["share"] == pytest.approx(w / (1 + w))
    assert recs[p.name]["overlap_s"] == pytest.approx(0.3) and not recs[p.name]["alone"]
    assert recs[md.name]["alone"] and "share" not in recs[md.name]


def test_blocks_landed_at_the_head_of_a_copy_still_crossing_are_not_sent_again(tmp_path):
    """The receiver holds each block as it lands, in order: a third cold
    request whose system prompt another copy has already brought (whole, at
    the head of that copy: P held those blocks) sends only its own blocks,
    though both earlier copies are still crossing (as in the real
    `results/wan-bound-54`: the simulator sent them again, 2.2 MB for each
    of four cold turns of pd-wan-drc, and its replay's TTFT p90 read -21%)."""
    from pdd.deploy.spec import link_overrides

    system = ids(1, 96)                          # six 16-token blocks, shared
    reqs = [WorkloadRequest("a", 0.0, system + ids(2, 504), 4),
            WorkloadRequest("b", 0.5, system + ids(3, 504), 4),
            WorkloadRequest("c", 15.0, system + ids(4, 504), 4)]
    wl = Workload("test", reqs, {"kind": "test"}, 16)
    mode = RuntimeMode("pd-wan-drc", str(EXAMPLES / "pd-wan-drc.toml"), link_overrides(4.0))
    _, records, _ = run_runtime_mode(mode, wl, Sla(300.0, 1.0))
    by_id = {r.request_id: r for r in records}
    spec = load_spec(EXAMPLES / "pd-wan-drc.toml")
    block_bytes = 16 * model_shape(spec).kv_bytes_per_token
    for r in ("a", "b"):         # both copies still cross when c asks
        assert by_id[r].arrival_s + by_id[r].ttft_s > 15.0 + 1.0
    assert by_id["a"].wan_bytes == 37 * block_bytes
    assert by_id["b"].wan_bytes == 37 * block_bytes    # P computes a's prefix: nothing landed yet at b's HAVE
    assert by_id["c"].wan_bytes == 31 * block_bytes    # b's copy brought the six shared blocks first


def test_calibration_measures_the_wan_handshake_past_the_lines_round_trip(tmp_path):
    """The handshakes P's sender timed (records.jsonl) beyond the line's nominal
    round trip, as bytes at the line's rate; sibling waits (>= 1 s) left out.
    Replaying, a transfer's BEGIN waits at least that long on the line."""
    from pdd.sim.link import Link

    run = _fake_run(tmp_path)
    line = load_spec(run / "pdd" / "deploy.toml").links[0]
    rate, nominal = line.bandwidth_mbps * 1e6 / 8, (2 * line.latency_ms + line.jitter_ms) / 1e3
    shakes = [nominal + 0.010, nominal + 0.030, nominal + 0.050, 4.0]        # the last: a sibling wait
    with open(run / "pdd" / "records.jsonl", "w") as f:
        for k, h in enumerate(shakes):
            events = [{"name": "kv_transfer", "link": "wan", "handshake_s": h},
                      {"name": "kv_transfer", "link": "local", "handshake_s": 0.5}]
            f.write(json.dumps(RequestRecord(f"r{k}", 0.0, 100, 1, events=events).to_dict()) + "\n")
    cal = fit([run], get_model("smollm2-135m"))
    assert cal.handshake_queue_bytes("wan", "pdd") == pytest.approx(0.030 * rate)
    assert cal.handshake_queue_bytes("wan", "pd-local") == pytest.approx(0.030 * rate)   # pooled
    assert cal.handshake_queue_bytes("local", "pdd") == 0.0
    path = tmp_path / "cal.json"
    cal.save(path)
    assert CpuCalibration.read(path).handshake_queue == cal.handshake_queue
    mode = mode_from_spec(load_spec(run / "pdd" / "deploy.toml"), calibration=cal, run="pdd")
    assert mode.wan.handshake_queue_bytes == pytest.approx(0.030 * rate)
    idle = Link("wan", rate, nominal, handshake_queue_bytes=mode.wan.handshake_queue_bytes)
    assert idle.queue_s(0.0) == pytest.approx(0.030)
    assert Link("wan", rate, nominal).queue_s(0.0) == 0.0
    # a run at another line rate (`--wan-mbps`, saved as overrides.json): its own rate
    (run / "pdd" / "overrides.json").write_text(json.dumps({"links": {"bandwidth_mbps": 4 * line.bandwidth_mbps}}))
    assert fit([run], get_model("smollm2-135m")).handshake_queue_bytes("wan", "pdd") == pytest.approx(0.120 * rate)


def test_one_instances_slow_class_of_steps_is_its_own_not_its_roles(tmp_path):
    """pd-local's P runs its chunks of 33-128 tokens 1.3x slower than its
    other steps (and than the same deployment's P in another mode): the
    calibration gives each P a factor of its own by row class over their
    role's, the replay's pool of P takes it; a saved calibration keeps it; a
    replayed run's own steps replace it. Decoders keep their role's."""
    from pdd.sim.calibration import with_run_speeds

    run = _fake_run(tmp_path, steps=800)
    shutil.copytree(run / "pd-local", run / "pd-local-b")       # the same deployment, another mode
    f = run / "pd-local" / "steps.jsonl"
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    slow = lambda r: r["instance"] == "p0" and 33 <= r["num_prefill_tokens"] <= 128
    f.write_text("".join(json.dumps(r | {"wall_s": r["wall_s"] * (1.3 if slow(r) else 1.0)}) + "\n" for r in rows))
    cal = fit([run], get_model("smollm2-135m"))
    assert {"pd-local/p0", "pd-local-b/p0"} <= set(cal.instance_rows)
    mine = cal.row_factors(1, "prefill", "pd-local", "p0")
    other = cal.row_factors(1, "prefill", "pd-local-b", "p0")
    # the slow P against the other, class by class: 1.3 for the 65-128-token
    # chunks (less the pull towards 1 of a class of ~25 steps), 1 for the 257-512-token ones
    at = lambda fs, k: fs[k - 1] if k <= len(fs) else 1.0
    ratio = lambda k: (cal.time_scale("pd-local", "p0") * at(mine, k)) / (cal.time_scale("pd-local-b", "p0") * at(other, k))
    assert 1.15 < ratio(row_bucket(100)) < 1.32
    assert ratio(row_bucket(400)) == pytest.approx(1.0, abs=0.05)
    assert cal.row_factors(1, "decode", "pd-local", "d0") == cal.row_factors(1, "decode")
    path = tmp_path / "cal.json"
    cal.save(path)
    assert CpuCalibration.read(path).instance_rows == cal.instance_rows
    spec = load_spec(run / "pd-local" / "deploy.toml")
    pool = next(p for p in mode_from_spec(spec, calibration=cal, run="pd-local").pools if p.name == "p0")
    assert pool.row_factors == mine
    even = _fake_run(tmp_path / "again", steps=800)      # the same run without P's slow classes
    again = with_run_speeds(cal, [even], get_model("smollm2-135m"))
    flat = again.row_factors(1, "prefill", "pd-local", "p0")
    assert at(flat, row_bucket(100)) / at(flat, row_bucket(400)) < at(mine, row_bucket(100)) / at(mine, row_bucket(400)) - 0.1
