"""`pdd sim report`: the technical report's figures, reproduced by simulation.

    main        report-88a / report-xdc-naive / report-pdd on the one-hour
                agentic 64K-context / 1K-output workload (--quick: 15 min),
                plus naive cross-DC PD whose D keeps a prefix cache
                -> ttft_cdf.png, cost_table.png, the cost table, rld_share.png
    bathtub     BCR and P's prefill efficiency vs average prefix-hit rate on
                fixed-hit closed-loop users, with chunks packed, one chunk per
                step (tail chunks alone) and one chunk per step with more cache
                -> bathtub.png
    wan         mean WAN bandwidth PDD needs vs hit rate, with and without DRC
                (an unconstrained line, to measure demand) -> wan_vs_hit.png
    rld         RLD's share of output tokens vs WAN per-flow speed
                (part of rld_share.png)

The sweeps run a 2 P + 1 RLD + 2 MD slice of report-pdd for 300 simulated
seconds each (--quick: 180) on 96 closed-loop users with 16K-token prompts,
so the whole report takes a few minutes.
Everything lands in OUT: PNGs, report.md and report.json (the numbers).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from pdd.measure.files import write_json
from pdd.sim.runner import run_mode
from pdd.sim.scenario import Scenario, load
from pdd.sim.workload import FixedHitWorkload

EXAMPLES = Path(__file__).resolve().parents[3] / "examples" / "sim"
REPORT_FILES = ("report-88a.toml", "report-xdc-naive.toml", "report-pdd.toml")
# The slice of report-pdd the sweeps run (instances per role).
SLICE = {"prefill": 2, "relay": 1, "main": 2}
# Sweep workload: 16K-token prompts (two 8K chunks when uncached) and enough
# users to keep the slice's P near saturation at mid hit rates, where a tail
# chunk's wasted step turns into queueing and missed SLAs.
PROMPT_TOKENS = 16384
USERS = 96


def _examples() -> Path:
    if (EXAMPLES / REPORT_FILES[0]).is_file():
        return EXAMPLES
    return Path("examples/sim")


def _with_duration(sc: Scenario, duration_s: float, warmup_s: float) -> Scenario:
    return dataclasses.replace(
        sc, workload=dataclasses.replace(sc.workload, duration_s=duration_s),
        settings=dataclasses.replace(sc.settings, warmup_s=warmup_s))


# --- the scenarios ------------------------------------------------------------
def main_modes(sc: Scenario):
    """report files' modes plus naive cross-DC PD with a decode-side prefix cache."""
    naive = next(m for m in sc.modes if m.name == "xdc-naive")
    cached = dataclasses.replace(
        naive, name="xdc-cache",
        policy=dataclasses.replace(naive.policy, enable_drc=True),
        pools=tuple(dataclasses.replace(p, prefix_cache=True) for p in naive.pools))
    return list(sc.modes) + [cached]


def sweep_mode(sc: Scenario, packing: str = "packed", mem_fraction: float | None = None,
               drc: bool = True, wan_gbps: float | None = None):
    pdd = next(m for m in sc.modes if m.name == "pdd")
    # RLD holds no prefix cache: its memory stays as configured.
    pools = tuple(dataclasses.replace(
        p, count=SLICE[p.role.value], chunk_packing=packing,
        mem_fraction=p.mem_fraction if mem_fraction is None or p.role.value == "relay" else mem_fraction)
        for p in pdd.pools)
    wan = pdd.wan
    if wan_gbps is not None:
        wan = dataclasses.replace(wan, gbps=wan_gbps, max_flow_gbps=None)
    return dataclasses.replace(pdd, pools=pools, wan=wan,
                               policy=dataclasses.replace(pdd.policy, enable_drc=drc))


def fixed_hit(sc: Scenario, hit: float, duration_s: float, prompt_tokens: int = PROMPT_TOKENS,
              users: int = USERS, turns: int = 10) -> Scenario:
    wl = FixedHitWorkload(duration_s=duration_s, num_users=users, prompt_tokens=prompt_tokens,
                          output_tokens=256, hit_rate=hit, turns=turns, think_time_s=2.0,
                          block_size=sc.workload.block_size)
    return dataclasses.replace(sc, workload=wl, settings=dataclasses.replace(
        sc.settings, warmup_s=duration_s / 6, drain_s=120.0, token_stride=8))


def prefill_efficiency(entry: dict, records: list, num_p: int) -> float:
    """Uncached prompt tokens P computed per second of P busy time."""
    busy = sum(v["utilization"] * v["instances"] for k, v in entry["sim"]["pools"].items()
               if k.startswith("prefill/")) * entry["sim"]["simulated_s"]
    tokens = sum(r.prompt_tokens - r.cached_tokens for r in records)
    return tokens / busy if busy > 0 else 0.0


# --- running --------------------------------------------------------------------
def run_main(sc: Scenario) -> tuple[dict, dict]:
    entries, records = {}, {}
    for mode in main_modes(sc):
        e, recs, _ = run_mode(sc, mode)
        entries[mode.name] = e
        records[mode.name] = recs
        print(f"  main {mode.name:<10} wall {e['sim']['wall_s']:5.1f}s  TTFT p50 "
              f"{e['ttft_s']['p50']:.2f}s  goodput {e['goodput_rps']:.2f}/s  BCR {e['bcr']:.4f}",
              flush=True)
    return entries, records


def run_bathtub(sc: Scenario, duration_s: float, hits: list[float]) -> dict:
    # Baseline: one chunk per step and a P cache too small for every user's
    # context; the remedies: pack chunks, or give the caches more memory.
    curves = {"one chunk per step (baseline)": dict(packing="single", mem_fraction=0.70),
              "packed chunks": dict(packing="packed", mem_fraction=0.70),
              "one chunk per step, more cache": dict(packing="single", mem_fraction=0.9)}
    out: dict = {}
    for label, kw in curves.items():
        mode = sweep_mode(sc, **kw)
        rows = []
        for h in hits:
            e, recs, _ = run_mode(fixed_hit(sc, h, duration_s), mode)
            rows.append({"nominal_hit": h, "hit": e["prefix_hit_rate"], "bcr": e["bcr"],
                         "revenue_bcr": e["revenue_bcr"],
                         "goodput_rps": e["goodput_rps"], "sla": e["sla_attainment"],
                         "prefill_tok_per_busy_s": prefill_efficiency(e, recs, SLICE["prefill"])})
        out[label] = rows
        print(f"  bathtub {label}: {len(rows)} points", flush=True)
    return out


def run_wan(sc: Scenario, duration_s: float, hits: list[float]) -> dict:
    out: dict = {}
    for label, drc in (("with DRC", True), ("without DRC", False)):
        mode = sweep_mode(sc, drc=drc, wan_gbps=3200.0)
        rows = []
        for h in hits:
            # Long sessions: a cold first turn in 20 keeps the realised rate near nominal.
            e, _, sim_s = run_mode(fixed_hit(sc, h, duration_s, turns=20), mode)
            rows.append({"nominal_hit": h, "hit": e["prefix_hit_rate"],
                         "wan_gbps": e["sim"]["link_bytes"].get("wan", 0.0) * 8 / 1e9 / max(sim_s, 1e-9),
                         "wan_gb_per_request": e["wan_bytes"] / 1e9 / max(e["num_requests"], 1),
                         "requests_per_s": e["num_requests"] / max(e["duration_s"], 1e-9)})
        out[label] = rows
        print(f"  wan {label}: {len(rows)} points", flush=True)
    return out


def run_rld(sc: Scenario, flows_gbps: list[float]) -> list[dict]:
    pdd = next(m for m in sc.modes if m.name == "pdd")
    rows = []
    for g in flows_gbps:
        mode = dataclasses.replace(pdd, wan=dataclasses.replace(pdd.wan, max_flow_gbps=g))
        e, _, _ = run_mode(sc, mode)
        rows.append({"flow_gbps": g, "rld_token_share": e["rld_token_share"],
                     "ttft_p50": e["ttft_s"]["p50"], "pipelines": e["sim"]["pipelines"]})
    print(f"  rld: {len(rows)} points", flush=True)
    return rows


def run_report(out: Path, quick: bool = False) -> int:
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ex = _examples()
    base = load([ex / f for f in REPORT_FILES])
    main_s = 900.0 if quick else 3600.0
    sweep_s = 180.0 if quick else 300.0
    sc = _with_duration(base, main_s, min(base.settings.warmup_s, main_s / 6))
    print(f"pdd sim report: main scenario, {main_s:.0f} simulated s", flush=True)
    entries, records = run_main(sc)
    # Hit rates on the block grid: k cached 512-token blocks of 32.
    n_blocks = PROMPT_TOKENS // base.workload.block_size
    hits = [k / n_blocks for k in range(0, n_blocks, 2 if quick else 1)]
    bathtub = run_bathtub(sc, sweep_s, hits)
    wan = run_wan(sc, sweep_s, [k / n_blocks for k in (0, 8, 16, 24, 28, 30, 31)])
    rld_sc = _with_duration(base, 900.0 if not quick else 600.0, 150.0)
    rld = run_rld(rld_sc, [25.0, 10.0, 5.0, 2.5])
    data = {"main": {k: {kk: vv for kk, vv in v.items()} for k, v in entries.items()},
            "main_simulated_s": main_s, "sweep_simulated_s": sweep_s,
            "bathtub": bathtub, "wan": wan, "rld": rld}
    from pdd.sim import report_figures as figs

    files = figs.write_all(out, entries, records, bathtub, wan, rld)
    data["wall_s"] = time.perf_counter() - t0
    data["figures"] = files
    write_json(out / "report.json", data)
    (out / "report.md").write_text(figs.markdown(data))
    print(f"wrote {out}/report.md, report.json and {len(files)} figures in {data['wall_s']:.0f}s")
    return 0
