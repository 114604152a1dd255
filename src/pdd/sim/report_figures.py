"""Figures and report.md of `pdd sim report` (matplotlib Agg, imported lazily)."""

from __future__ import annotations

from pathlib import Path

from pdd.measure.metrics import cost_per_million_tokens, relative_change
from pdd.measure.plots import pyplot
from pdd.measure.report import REPORT

LABELS = {"pd-88a": "in-DC PD, 88 x A", "xdc-naive": "naive cross-DC PD (full KV over WAN)",
          "xdc-cache": "naive cross-DC PD (D prefix cache)", "pdd": "PDD, 43 A + 32 B"}


def _save(fig, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)


def ttft_cdf(path: Path, records: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, recs in records.items():
        xs = sorted(r.ttft_s for r in recs if not r.failed and r.ttft_s is not None)
        if not xs:
            continue
        ys = [(i + 1) / len(xs) for i in range(len(xs))]
        for ax in axes:
            ax.step(xs, ys, where="post", label=LABELS.get(name, name))
    axes[0].set_xlim(0, 20)
    axes[0].set_title("TTFT CDF (first 20 s)")
    axes[1].set_xscale("log")
    axes[1].set_title("TTFT CDF (log scale)")
    for ax in axes:
        ax.set_xlabel("TTFT (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, loc="lower right")
    _save(fig, path)


def cost_table_rows(entries: dict) -> list[dict]:
    rows = []
    for name in ("pd-88a", "pdd"):
        e = entries.get(name)
        if e is None:
            continue
        rows.append({"mode": name, "chips": e["sim"]["chips"], "cost_per_hour": e["cost_per_hour"],
                     "goodput_rps": e["goodput_rps"], "sla_attainment": e["sla_attainment"],
                     "bcr": e["bcr"], "ttft_p50": e["ttft_s"]["p50"], "ttft_p90": e["ttft_s"]["p90"],
                     "tpot_p50": e["tpot_s"]["p50"],
                     "cost_per_mtok": cost_per_million_tokens(e["cost_per_hour"], e["throughput_tok_s"])})
    return rows


def cost_table(path: Path, entries: dict) -> None:
    rows = cost_table_rows(entries)
    if len(rows) < 2:
        return
    plt = pyplot()
    base = rows[0]
    keys = [("cost_per_hour", "cost / hour"), ("goodput_rps", "SLA goodput"), ("bcr", "BCR"),
            ("ttft_p50", "TTFT p50"), ("cost_per_mtok", "cost / M tokens")]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(keys))
    ax.bar([x - 0.2 for x in xs], [1.0] * len(keys), 0.4, label=LABELS["pd-88a"], color="tab:gray")
    ax.bar([x + 0.2 for x in xs], [rows[1][k] / base[k] if base[k] else 0 for k, _ in keys], 0.4,
           label=LABELS["pdd"], color="tab:blue")
    ax.set_xticks(list(xs), [lbl for _, lbl in keys])
    ax.set_ylabel("relative to 88 x A")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.legend(fontsize=8)
    ax.set_title("Cost table: 88 x A in-DC vs 43 A + 32 B PDD")
    _save(fig, path)


def bathtub(path: Path, data: dict) -> None:
    plt = pyplot()
    hit = "prefix-hit rate of a later turn (nominal)"
    panels = [  # row key, scale, x label, y label, title
        ("bcr", 1e3, hit[:-1] + "; realised is lower: cold first turns, eviction)",
         "BCR (SLA goodput per cost/h, x1e-3)", "BCR vs hit rate"),
        ("prefill_tok_per_busy_s", 1.0, hit, "uncached tokens per P-busy second",
         "P prefill efficiency: tail-chunk valleys"),
        ("revenue_bcr", 1.0, hit, "SLA revenue per hardware cost", "revenue BCR (cached input billed at 25%)"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(16, 4))
    for ax, (key, scale, xlabel, ylabel, title) in zip(axes, panels):
        for label, rows in data.items():
            if all(key in r for r in rows):
                ax.plot([r["nominal_hit"] for r in rows], [r[key] * scale for r in rows], marker=".",
                        label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, path)


def wan_vs_hit(path: Path, data: dict) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for label, rows in data.items():
        xs = [r["hit"] for r in rows]
        axes[0].plot(xs, [r["wan_gbps"] for r in rows], marker="o", label=label)
        axes[1].plot(xs, [r["wan_gb_per_request"] for r in rows], marker="o", label=label)
    w, wo = data.get("with DRC", []), data.get("without DRC", [])
    for a, b in zip(w, wo):
        if a["wan_gb_per_request"] > 0:
            axes[1].annotate(f"{b['wan_gb_per_request'] / a['wan_gb_per_request']:.1f}x",
                             (a["hit"], a["wan_gb_per_request"]), textcoords="offset points",
                             xytext=(0, -12), ha="center", fontsize=7)
    axes[0].set_ylabel("mean WAN bandwidth used (Gbit/s)")
    axes[0].set_title("WAN demand (unconstrained line)")
    axes[1].set_ylabel("WAN GB per request")
    axes[1].set_title("WAN bytes per request (without / with DRC)")
    for ax in axes:
        ax.set_xlabel("average prefix-hit rate (realised)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, path)


def rld_share(path: Path, entries: dict, rld: list[dict]) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    e = entries.get("pdd")
    if e is not None:
        s = e["rld_token_share"]
        axes[0].pie([s, 1 - s], labels=[f"RLD {s:.1%}", f"MD {1 - s:.1%}"],
                    colors=["tab:orange", "tab:blue"], startangle=90)
        axes[0].set_title(f"output tokens, 64K/1K scenario (report: RLD {REPORT['rld_token_share']:.1%})")
    axes[1].plot([r["flow_gbps"] for r in rld], [r["rld_token_share"] * 100 for r in rld], marker="o")
    axes[1].axhline(REPORT["rld_token_share"] * 100, color="k", ls="--", lw=0.8, label="report 6.2%")
    axes[1].set_xscale("log")
    axes[1].set_xlabel("WAN speed of one transfer (Gbit/s)")
    axes[1].set_ylabel("RLD share of output tokens (%)")
    axes[1].set_title("RLD share vs WAN per-flow speed")
    axes[1].grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    _save(fig, path)


def write_all(out: Path, entries: dict, records: dict, bath: dict, wan: dict, rld: list) -> list[str]:
    figs = {"ttft_cdf.png": lambda p: ttft_cdf(p, records),
            "cost_table.png": lambda p: cost_table(p, entries),
            "bathtub.png": lambda p: bathtub(p, bath),
            "wan_vs_hit.png": lambda p: wan_vs_hit(p, wan),
            "rld_share.png": lambda p: rld_share(p, entries, rld)}
    for name, draw in figs.items():
        draw(Path(out) / name)
    return list(figs)


def _pct(x) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def markdown(data: dict) -> str:
    m = data["main"]
    lines = ["# Simulated report figures", "",
             f"Main scenario: {data['main_simulated_s']:.0f} simulated s of the agentic 64K-context / "
             f"1K-output workload (examples/sim/report-*.toml); sweeps: "
             f"{data['sweep_simulated_s']:.0f} simulated s each on a 2 P + 1 RLD + 2 MD slice of "
             f"report-pdd. Wall time {data.get('wall_s', 0):.0f} s.", "",
             "## TTFT: in-DC vs naive cross-DC vs PDD (ttft_cdf.png)", "",
             "| mode | TTFT p50 | p90 | p99 | TPOT p50 | SLA | goodput/s | $/h | BCR | RLD tokens |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, e in m.items():
        lines.append(f"| {LABELS.get(name, name)} | {e['ttft_s']['p50']:.2f} s | {e['ttft_s']['p90']:.2f} s"
                     f" | {e['ttft_s']['p99']:.2f} s | {e['tpot_s']['p50'] * 1e3:.1f} ms"
                     f" | {e['sla_attainment']:.1%} | {e['goodput_rps']:.2f} | {e['cost_per_hour']:.0f}"
                     f" | {e['bcr']:.4f} | {e['rld_token_share']:.1%} |")
    base, pdd = m.get("pd-88a"), m.get("pdd")
    xdc = m.get("xdc-cache")
    rep = REPORT["pdd_vs_in_dc"]
    if base and pdd:
        lines += ["", "## Cost table: 88 x A in-DC vs 43 A + 32 B PDD (cost_table.png)", "",
                  "| deployment | chips | $/h | SLA goodput/s | SLA | BCR | TTFT p50 / p90 | TPOT p50 | $/M tokens |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in cost_table_rows(m):
            chips = " + ".join(f"{n} x {hw}" for hw, n in r["chips"].items())
            lines.append(f"| {LABELS.get(r['mode'], r['mode'])} | {chips} | {r['cost_per_hour']:.0f} | "
                         f"{r['goodput_rps']:.2f} | {r['sla_attainment']:.1%} | {r['bcr']:.4f} | "
                         f"{r['ttft_p50']:.2f} / {r['ttft_p90']:.2f} s | {r['tpot_p50'] * 1e3:.1f} ms | "
                         f"{r['cost_per_mtok']:.2f} |")
        lines += ["",
                  f"- cost: {_pct(relative_change(pdd['cost_per_hour'], base['cost_per_hour']))} "
                  "(report: 3.5-7.1% cheaper)",
                  f"- TTFT p50: {_pct(relative_change(pdd['ttft_s']['p50'], base['ttft_s']['p50']))} "
                  f"(report: {rep['ttft']:+.1%})",
                  f"- SLA goodput: {_pct(relative_change(pdd['goodput_rps'], base['goodput_rps']))} "
                  f"(report: {rep['goodput']:+.1%})",
                  f"- BCR: {_pct(relative_change(pdd['bcr'], base['bcr']))} (report: up to {rep['bcr']:+.1%})"]
    naive = m.get("xdc-naive")
    if pdd and xdc:
        q = lambda e: "/".join(f"{e['ttft_s'][k]:.2f}" for k in ("p50", "p90", "p99"))
        lines += [f"- same chips as PDD, no RLD (naive cross-DC PD): with a decode-side prefix cache "
                  f"TTFT p50/p90/p99 {q(xdc)} s vs PDD {q(pdd)} s"
                  + (f"; shipping every prompt's full KV instead {q(naive)} s (the line saturates)"
                     if naive else "")
                  + " (report: in-DC P50 4.2 s -> 6.7 s cross-DC without PDD)"]
    lines += ["", "## Bathtub: BCR vs average prefix-hit rate (bathtub.png)", ""]
    for label, rows in data["bathtub"].items():
        worst = min(rows, key=lambda r: r["prefill_tok_per_busy_s"] or 1e30)
        mid = [r for r in rows if 0.3 <= r["nominal_hit"] <= 0.7]
        dip = min(mid, key=lambda r: r["prefill_tok_per_busy_s"]) if mid else worst
        lines.append(f"- {label}: BCR x1e3 {rows[0]['bcr'] * 1e3:.1f} at nominal hit 0% -> "
                     f"{rows[-1]['bcr'] * 1e3:.1f} at {rows[-1]['nominal_hit']:.0%} (realised "
                     f"{rows[-1]['hit']:.0%}); P efficiency valley {dip['prefill_tok_per_busy_s']:.0f} tok/s "
                     f"at nominal hit {dip['nominal_hit']:.1%} (BCR x1e3 there {dip['bcr'] * 1e3:.1f})")
        if all("revenue_bcr" in r for r in rows):
            curve = ", ".join(f"{r['nominal_hit']:.0%}: {r['revenue_bcr']:.2f}" for r in rows)
            lines.append(f"  revenue BCR by nominal hit: {curve}")
    lines += ["", "## WAN bandwidth needed vs hit rate (wan_vs_hit.png)", ""]
    w, wo = data["wan"].get("with DRC", []), data["wan"].get("without DRC", [])
    for a, b in zip(w, wo):
        per = a["wan_gb_per_request"]
        ratio = b["wan_gb_per_request"] / per if per else float("inf")
        lines.append(f"- nominal hit {a['nominal_hit']:.0%} (realised {a['hit']:.0%}): "
                     f"{per:.2f} GB/request with DRC, {b['wan_gb_per_request']:.2f} without "
                     f"({ratio:.1f}x less); {a['wan_gbps']:.1f} vs {b['wan_gbps']:.1f} Gbit/s used")
    lines += ["", "## RLD's share of output tokens (rld_share.png)", ""]
    if pdd:
        lines.append(f"- main scenario: RLD emits {pdd['rld_token_share']:.1%} of output tokens "
                     f"(report: {REPORT['rld_token_share']:.1%}); pipelines {pdd['sim']['pipelines']}")
    for r in data["rld"]:
        lines.append(f"- WAN {r['flow_gbps']:g} Gbit/s per transfer: RLD share {r['rld_token_share']:.1%}, "
                     f"TTFT p50 {r['ttft_p50']:.2f} s")
    return "\n".join(lines) + "\n"
