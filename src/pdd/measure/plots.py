"""PNG figures of a bench run (matplotlib, Agg backend, imported lazily)."""

from __future__ import annotations

from pathlib import Path

from pdd.measure.records import RequestRecord
from pdd.measure.workload import HIT_RATE_BINS, Workload, hit_rate_histogram

RLD_COLOR, MD_COLOR = "tab:orange", "tab:blue"
MARKERS = "os^Dv<>p"   # modes often overlap: tell them apart by shape too


def pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def ttft_cdf(path: Path, modes: dict[str, list[RequestRecord]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, recs in modes.items():
        xs = sorted(r.ttft_s for r in recs if not r.failed and r.ttft_s is not None)
        if xs:
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=name)
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _pick_timelines(recs: list[RequestRecord], k: int = 4) -> list[RequestRecord]:
    ok = [r for r in recs if not r.failed and r.token_times_s]
    relayed = sorted((r for r in ok if r.rld_tokens > 0), key=lambda r: -r.rld_tokens)
    direct = [r for r in ok if r.rld_tokens == 0]
    picked = relayed[:k - 1] + direct[:1] if relayed else ok[:k]
    return picked[:k]


def token_timelines(path: Path, modes: dict[str, list[RequestRecord]]) -> None:
    """Tokens over time since arrival; RLD-emitted tokens in orange, MD's in blue."""
    plt = pyplot()
    shown = {n: r for n, r in modes.items() if any(x.rld_tokens for x in r)} or dict(
        list(modes.items())[:1])
    shown = dict(list(shown.items())[:4])
    fig, axes = plt.subplots(1, max(1, len(shown)), figsize=(5 * max(1, len(shown)), 4),
                             squeeze=False)
    for ax, (name, recs) in zip(axes[0], shown.items()):
        for r in _pick_timelines(recs):
            t = [x - r.arrival_s for x in r.token_times_s]
            n = list(range(1, len(t) + 1))
            k = min(r.rld_tokens, len(t))
            if k:
                ax.plot(t[:k], n[:k], color=RLD_COLOR, marker=".", ms=3, lw=1.5)
            ax.plot(t[max(k - 1, 0):], n[max(k - 1, 0):], color=MD_COLOR, marker=".", ms=3, lw=1)
            if 0 < k < len(t):
                ax.axvline(t[k], color="grey", lw=0.5, ls=":")
            ax.annotate(r.request_id, (t[-1], n[-1]), fontsize=6)
        ax.set_title(f"{name}: RLD (orange) -> MD (blue)", fontsize=9)
        ax.set_xlabel("time since arrival (s)")
        ax.set_ylabel("output tokens")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def wan_vs_hit(path: Path, modes: dict[str, list[RequestRecord]]) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (name, recs) in enumerate(modes.items()):
        ok = [r for r in recs if not r.failed]
        ax.scatter([r.hit_rate * 100 for r in ok], [r.wan_bytes / 1e6 for r in ok],
                   s=14, alpha=0.6, marker=MARKERS[i % len(MARKERS)], label=name)
    ax.set_xlabel("prefix hit rate (%)")
    ax.set_ylabel("KV over the WAN (MB)")
    ax.set_title("WAN bytes per request vs hit rate")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def hit_histogram(path: Path, modes: dict[str, list[RequestRecord]], workload: Workload) -> None:
    plt = pyplot()
    labels = [b[0] for b in HIT_RATE_BINS]
    series = {"theoretical": hit_rate_histogram(workload.hit_rates())}
    for name, recs in modes.items():
        series[name] = hit_rate_histogram([r.hit_rate for r in recs if not r.failed])
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(series)
    for i, (name, hist) in enumerate(series.items()):
        ax.bar([j + i * width for j in range(len(labels))], [hist[b] * 100 for b in labels],
               width=width, label=name)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(labels))], labels)
    ax.set_xlabel("prefix hit rate bin")
    ax.set_ylabel("% of requests")
    ax.set_title("Prefix-hit distribution (report: 70-80 % above 95 %)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_all(out: Path, modes: dict[str, list[RequestRecord]], workload: Workload) -> list[str]:
    """Write every figure under `out`; returns their file names."""
    out = Path(out)
    figs = {
        "ttft_cdf.png": lambda p: ttft_cdf(p, modes),
        "token_timelines.png": lambda p: token_timelines(p, modes),
        "wan_vs_hit.png": lambda p: wan_vs_hit(p, modes),
        "hit_histogram.png": lambda p: hit_histogram(p, modes, workload),
    }
    for name, draw in figs.items():
        draw(out / name)
    return list(figs)
