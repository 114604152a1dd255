"""`pdd sim sweep`: TTFT of the modes against the WAN line rate.

    pdd sim sweep -c examples/pd-local.toml -c examples/pd-wan-drc.toml -c examples/pdd.toml \\
        --preset wan-bound --rates 25,50,100,200,400 [--calibration CAL] \\
        [--real results/wb-50 results/wb-100 ...] --out results/wan-sweep

The simulator runs every deployment file at every rate (`--wan-mbps` for
each) on the very workload `pdd bench` would send; `--real` adds bench runs
(each a `pdd bench --wan-mbps R` folder: its rate is read from its
summary's overrides or deployment file) as markers on the same axes. Writes
wan_sweep.json (every point) and wan_sweep.png (TTFT p50 and p90 against
the rate, log scale). Where the lines meet is where PDD stops mattering.
"""

from __future__ import annotations

import json
from pathlib import Path

METRICS = ("p50", "p90")


def simulate(configs: list[Path], rates: list[float], workload, sla, calibration, opts, warmup: int = 0) -> dict:
    """TTFT percentiles per deployment file and line rate; `warmup`: the
    requests routed before each run, as `pdd bench --warmup` sends them."""
    from pdd.deploy.spec import link_overrides
    from pdd.sim.runtime import RuntimeMode, run_runtime_mode

    out: dict = {}
    for c in configs:
        for rate in rates:
            entry, _, _ = run_runtime_mode(RuntimeMode(c.stem, str(c), link_overrides(rate)), workload, sla,
                                           calibration, opts, warmup=warmup)
            out.setdefault(c.stem, []).append({"wan_mbps": rate, **{m: entry["ttft_s"][m] for m in METRICS},
                                                "rld_token_share": entry["rld_token_share"],
                                                "num_failed": entry["num_failed"]})
    return out


def run_rate(summary: dict, mode: dict) -> float | None:
    """The line rate a bench mode ran at: its --wan-mbps override, else its file's."""
    over = (mode.get("overrides") or {}).get("links", {}).get("bandwidth_mbps")
    if over is not None:
        return float(over)
    from pdd.deploy.spec import load_spec

    spec = load_spec(mode["config"])
    return spec.links[0].bandwidth_mbps if spec.links else None


def real_points(runs: list[Path]) -> dict:
    out: dict = {}
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        for name, mode in summary["modes"].items():
            if "error" in mode:
                continue
            rate = run_rate(summary, mode)
            if rate is None:
                continue
            out.setdefault(name, []).append({"wan_mbps": rate, "run": str(run),
                                             **{m: mode["ttft_s"][m] for m in METRICS},
                                             "rld_token_share": mode["rld_token_share"],
                                             "num_failed": mode["num_failed"]})
    return out


def plot(path: Path, sim: dict, real: dict) -> None:
    from pdd.measure.plots import MARKERS, pyplot

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharex=True)
    colors = {}
    for k, name in enumerate(sorted(set(sim) | set(real))):
        colors[name] = f"C{k}"
    for ax, metric in zip(axes, METRICS):
        for name, pts in sim.items():
            pts = sorted(pts, key=lambda p: p["wan_mbps"])
            ax.plot([p["wan_mbps"] for p in pts], [p[metric] for p in pts], "-", color=colors[name],
                    label=f"{name} (simulated)")
        for k, (name, pts) in enumerate(real.items()):
            ax.plot([p["wan_mbps"] for p in pts], [p[metric] for p in pts], MARKERS[k % len(MARKERS)],
                    color=colors[name], markersize=8, label=f"{name} (real run)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        rates = sorted({p["wan_mbps"] for pts in (*sim.values(), *real.values()) for p in pts})
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.minorticks_off()
        ax.set_xlabel("WAN line rate (Mbit/s)")
        ax.set_ylabel(f"TTFT {metric} (s)")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=7)
    fig.suptitle("TTFT against the WAN rate: lines simulated, markers real runs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_sweep(args) -> int:
    from pdd.measure.flags import build_workload, sla_from_args
    from pdd.sim.cli import _calibration, _options

    rates = sorted(float(r) for r in args.rates.split(","))
    if not rates or min(rates) <= 0:
        print("pdd sim sweep: --rates needs positive Mbit/s values")
        return 2
    wl = build_workload(args)
    sla = sla_from_args(args)
    sim = simulate(args.config, rates, wl, sla, _calibration(args), _options(args), warmup=args.warmup)
    real = real_points(args.real or [])
    out = args.out or Path("results/wan-sweep")
    out.mkdir(parents=True, exist_ok=True)
    (out / "wan_sweep.json").write_text(json.dumps({"simulated": sim, "real": real}, indent=2) + "\n")
    plot(out / "wan_sweep.png", sim, real)
    for name, pts in sim.items():
        print(f"{name:<12}" + "  ".join(f"{p['wan_mbps']:g}: {p['p50']:.2f}/{p['p90']:.2f}" for p in pts))
    for name, pts in real.items():
        print(f"{name:<12}" + "  ".join(f"{p['wan_mbps']:g}: {p['p50']:.2f}/{p['p90']:.2f} (real)" for p in pts))
    print(f"wrote {out / 'wan_sweep.json'} and {out / 'wan_sweep.png'}")
    return 0
