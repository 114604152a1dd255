"""Side-by-side tables: our modes against each other and against the report.

Works on the summary.json dict only (no records), so `make demo` and any
later reader can print the same table from a file.
"""

from __future__ import annotations

import math
import sys
from typing import TextIO

from pdd.measure.metrics import cost_per_million_tokens, relative_change
from pdd.measure.step_speed import speed_rows

# Figures of the PDD technical report (docs: /work/shared/MISSION.md).
REPORT = {
    "pdd_vs_in_dc": {"ttft": -0.515, "cost_per_token": -0.375, "goodput": 0.278, "bcr": 0.375},
    "cross_dc_ttft_s": {"in_dc_p50": 4.2, "p50": 6.7, "p90": 18.3, "p99": 29.7},
    "share_hit_above_95": (0.70, 0.80),
    "abnormal_fraction": (0.03, 0.04),
    "mean_hit_rate": 0.90,
    "rld_token_share": 0.062,   # 64K-context, 1K-output scenario
    "handoff_100_tokens_ms": {"kv_over_wan_mean": 185.0, "kv_over_wan_peak": 512.6,
                              "recompute_mean": 305.0, "recompute_max": 321.4},
}

ROLE_LABELS = {"pdd": "PDD", "cross_dc_pd": "naive cross-DC PD", "in_dc_pd": "in-DC PD",
               "colocated": "co-located", "other": "other"}


def mode_role(name: str) -> str:
    """Guess what a mode is from its name (the config file stem)."""
    base = name.lower().split("+")[0]
    if base.startswith("pdd"):
        return "pdd"
    if "coloc" in base:
        return "colocated"
    if "wan" in base or "cross" in base:
        return "cross_dc_pd"
    if "pd" in base:
        return "in_dc_pd"
    return "other"


def ok_modes(summary: dict) -> dict[str, dict]:
    return {k: v for k, v in summary.get("modes", {}).items() if "error" not in v}


def pick_baseline(summary: dict, wanted: str | None = None) -> str | None:
    """`wanted` if it ran, else the first in-DC PD mode, else the first mode that ran."""
    modes = ok_modes(summary)
    if wanted in modes:
        return wanted
    return next((m for m in modes if mode_role(m) == "in_dc_pd"), next(iter(modes), None))


def _num(x) -> float | None:
    return x if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _fmt(x, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    x = _num(x)
    return "-" if x is None else f"{x * scale:{spec}}{suffix}"


def _gaps(m: dict, ratio: str, count: str) -> str:
    """Gaps over the median inter-token gap: 'p50 / max (n)'; `ratio` names
    the summary's ratio (`handoff_gap_ratio`: at handoffs; `first_gap_ratio`:
    before the second token, after a first one from P), `count` its count."""
    if _num(m.get(ratio)) is None:
        return "-"
    return f"{_fmt(m.get(ratio + '_p50'), '.1f')} / {_fmt(m[ratio], '.1f')}x ({m.get(count, '?')})"


def _pct(x) -> str:
    return "-" if _num(x) is None else f"{x * 100:+.1f}%"


def cost_per_mtok(m: dict) -> float | None:
    c = cost_per_million_tokens(m.get("cost_per_hour") or 0.0, m.get("throughput_tok_s") or 0.0)
    return c if math.isfinite(c) else None


COLUMNS = [  # header, getter(mode name, mode summary) -> cell
    ("mode", lambda n, m: n),
    ("ok/n", lambda n, m: f"{m['num_requests'] - m['num_failed']}/{m['num_requests']}"),
    ("TTFT p50", lambda n, m: _fmt(m["ttft_s"]["p50"])),
    ("p90", lambda n, m: _fmt(m["ttft_s"]["p90"])),
    ("p99", lambda n, m: _fmt(m["ttft_s"]["p99"])),
    ("TPOT p50", lambda n, m: _fmt(m["tpot_s"]["p50"], ".3f")),
    ("SLA", lambda n, m: _fmt(m["sla_attainment"], ".0f", 100, "%")),
    ("goodput r/s", lambda n, m: _fmt(m["goodput_rps"], ".3f")),
    ("cost/h", lambda n, m: _fmt(m["cost_per_hour"], ".2f")),
    ("BCR", lambda n, m: _fmt(m["bcr"], ".4f")),
    ("cost/Mtok", lambda n, m: _fmt(cost_per_mtok(m), ".1f")),
    ("WAN MB", lambda n, m: _fmt(m["wan_bytes"], ".2f", 1e-6)),
    ("hit", lambda n, m: _fmt(m["prefix_hit_rate"], ".1f", 100, "%")),
    ("RLD tok", lambda n, m: _fmt(m["rld_token_share"], ".1f", 100, "%")),
    ("gap/ITL p50 / max", lambda n, m: _gaps(m, "handoff_gap_ratio", "num_handoffs")),
    ("P-first gap/ITL", lambda n, m: _gaps(m, "first_gap_ratio", "num_first_from_p")),
]


def table_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    header = [h for h, _ in COLUMNS]
    rows = []
    for name, m in summary.get("modes", {}).items():
        if "error" in m:
            rows.append([name, "FAILED: " + m["error"][:60]] + [""] * (len(COLUMNS) - 2))
        else:
            rows.append([get(name, m) for _, get in COLUMNS])
    return header, rows


def comparisons(summary: dict) -> list[dict]:
    """Each mode against the baseline, with the report's figure where one applies."""
    modes = ok_modes(summary)
    base_name = summary.get("baseline") or pick_baseline(summary)
    if base_name not in modes:
        return []
    b = modes[base_name]
    out = []
    for name, m in modes.items():
        if name == base_name:
            continue
        role = mode_role(name)
        ref = REPORT["pdd_vs_in_dc"] if role == "pdd" and mode_role(base_name) == "in_dc_pd" else {}
        row = {
            "mode": name, "baseline": base_name, "role": ROLE_LABELS[role],
            "ttft_p50": relative_change(m["ttft_s"]["p50"], b["ttft_s"]["p50"]),
            "ttft_mean": relative_change(m["ttft_s"]["mean"], b["ttft_s"]["mean"]),
            "goodput": relative_change(m["goodput_rps"], b["goodput_rps"]),
            "bcr": relative_change(m["bcr"], b["bcr"]),
            "cost_per_token": relative_change(cost_per_mtok(m), cost_per_mtok(b)),
            "wan_bytes": relative_change(m["wan_bytes"], b["wan_bytes"]),
            "report": ref,
        }
        if role == "cross_dc_pd" and mode_role(base_name) == "in_dc_pd":
            c = REPORT["cross_dc_ttft_s"]
            row["report"] = {"ttft_p50": c["p50"] / c["in_dc_p50"] - 1.0}
        out.append(row)
    return out


def print_table(summary: dict, file: TextIO | None = None) -> None:
    """The modes side by side, then each against the baseline (and the report)."""
    file = file or sys.stdout
    header, rows = table_rows(summary)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    line = "  ".join(h.ljust(w) for h, w in zip(header, widths))
    print(line, file=file)
    print("-" * len(line), file=file)
    for r in rows:
        print("  ".join(str(x).ljust(w) for x, w in zip(r, widths)), file=file)
    wl = summary.get("workload", {})
    hist = wl.get("hit_rate_histogram") or {}
    if hist:
        above = sum(v for k, v in hist.items() if not k.startswith(("0-", "90-")))
        print(f"\nworkload: {wl.get('name')} x{wl.get('num_requests')}, theoretical hit "
              f"{_fmt(wl.get('theoretical_hit_rate'), '.1%')}, {above:.0%} of requests > 95 % hit "
              f"(report: 70-80 %)", file=file)
    for c in comparisons(summary):
        ref = c["report"]
        ref_ttft = ref.get("ttft_p50", ref.get("ttft"))
        print(f"{c['mode']} vs {c['baseline']}: TTFT p50 {_pct(c['ttft_p50'])}"
              + (f" (report {_pct(ref_ttft)})" if ref_ttft is not None else "")
              + f", goodput {_pct(c['goodput'])}"
              + (f" (report {_pct(ref['goodput'])})" if "goodput" in ref else "")
              + f", BCR {_pct(c['bcr'])}"
              + (f" (report {_pct(ref['bcr'])})" if "bcr" in ref else ""), file=file)


def _md_table(header: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return "\n".join(out)


def render_markdown(summary: dict) -> str:
    wl = summary.get("workload", {})
    sla = summary.get("sla", {})
    parts = [
        "# PDD benchmark",
        "",
        f"Workload `{wl.get('name')}`: {wl.get('num_requests')} requests, "
        f"{wl.get('num_sessions', 0)} sessions, {wl.get('num_abnormal', 0)} abnormal; "
        f"input p50 {wl.get('input_tokens', {}).get('p50')} tokens, output p50 "
        f"{wl.get('output_tokens', {}).get('p50')}; SLA TTFT <= {sla.get('ttft_s')} s, "
        f"TPOT <= {sla.get('tpot_s')} s. Baseline: `{summary.get('baseline')}`.",
        "",
        "## Modes",
        "",
        _md_table(*table_rows(summary)),
        "",
        "BCR = goodput within SLA (requests/s) / cost per hour. gap/ITL = the "
        "inter-token gap at an RLD->MD handoff over the median inter-token gap: the median "
        "handoff's, the largest, and (in brackets) the number of handoffs.",
        "",
        "## Against the report",
        "",
    ]
    rows = []
    for c in comparisons(summary):
        ref = c["report"]
        for key, label in (("ttft_p50", "TTFT p50"), ("ttft_mean", "TTFT mean"),
                           ("cost_per_token", "cost per token"), ("goodput", "SLA goodput"),
                           ("bcr", "BCR"), ("wan_bytes", "WAN bytes")):
            rkey = key if key in ref else {"ttft_p50": "ttft", "ttft_mean": "ttft"}.get(key, key)
            rows.append([f"{c['mode']} ({c['role']})", f"vs {c['baseline']}", label,
                         _pct(c[key]), _pct(ref.get(rkey)) if rkey in ref else ""])
    if rows:
        parts += [_md_table(["mode", "baseline", "metric", "ours", "report"], rows), ""]
    cd = REPORT["cross_dc_ttft_s"]
    parts += [
        f"Report, cross-DC PD without PDD: TTFT p50 {cd['in_dc_p50']} s in-DC -> {cd['p50']} s "
        f"cross-DC, p90 {cd['p90']} s, p99 {cd['p99']} s. PDD vs in-DC PD: TTFT -51.5 %, cost "
        "per token -37.5 %, SLA goodput +27.8 %, BCR up to +37.5 %. RLD emits 6.2 % of output "
        "tokens (64K context, 1K output). 100-token handoff: KV over WAN mean 185 ms, peaks "
        "512.6 ms; recompute mean 305 ms, max 321.4 ms.",
        "",
    ]
    speed = speed_rows(summary)
    if speed:
        parts += [
            "## Engine steps against the baseline's",
            "",
            _md_table(["mode", "decoder step CPU", "P step CPU", "P step wall"], speed),
            "",
            f"The same shape of step (batch, prompt tokens, context) in this mode's window over "
            f"`{summary.get('baseline')}`'s, medians, over the shapes both ran (steps compared in "
            "brackets). The decoder's core does the same kind of work in every mode: its CPU figure "
            "is mostly the machine's drift between the two windows. P's CPU beyond it is what P's "
            "core shares; P's wall beyond its CPU is time P waited for its core "
            "(`pdd.measure.step_speed`).",
            "",
        ]
    parts += [
        "## Prefix-hit distribution",
        "",
        _hit_table(summary),
        "",
        "Theoretical: an unbounded block prefix cache over the workload. Report: 70-80 % of "
        "requests above 95 % hit, a thin low-hit tail, ~3-4 % very-long-input / very-short-"
        "output requests, ~90 % mean hit.",
        "",
    ]
    figs = summary.get("figures") or []
    if figs:
        parts += ["## Figures", ""] + [f"![{f}]({f})" for f in figs] + [""]
    return "\n".join(parts)


def _hit_table(summary: dict) -> str:
    wl = summary.get("workload", {})
    hist = wl.get("hit_rate_histogram") or {}
    header = ["", *hist.keys(), "mean"]
    rows = [["theoretical", *(f"{v:.0%}" for v in hist.values()),
             _fmt(wl.get("theoretical_hit_rate"), ".1%")]]
    for name, m in ok_modes(summary).items():
        h = m.get("hit_rate_histogram")
        if h:
            rows.append([name, *(f"{h.get(k, 0):.0%}" for k in hist), _fmt(m["prefix_hit_rate"], ".1%")])
    return _md_table(header, rows)
