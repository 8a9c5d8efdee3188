"""The PNG of a serving benchmark: TTFT and TPOT percentiles (p50, p90, p99) against the
request rate, and output tokens/s, one panel each (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path


def plot_rates(runs: list[dict], path: str | Path, title: str = "") -> Path:
    """runs: the JSON's "runs" (each with "rate" and the summary). inf rates are drawn
    at the right end, labelled "burst"."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = [r["rate"] for r in runs if r["rate"] != "inf"]
    burst_x = (max(finite) * 1.5 if finite else 1.0)
    xs = [burst_x if r["rate"] == "inf" else r["rate"] for r in runs]
    labels = ["burst" if r["rate"] == "inf" else f"{r['rate']:g}" for r in runs]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for ax, metric in zip(axes[:2], ("ttft", "tpot")):
        for key, style in (("median_ms", "o-"), ("p90_ms", "s--"), ("p99_ms", "^:")):
            ax.plot(xs, [r[metric][key] for r in runs], style, label=key.replace("_ms", "").replace("median", "p50"))
        ax.set_title(f"{metric.upper()} (ms)")
        ax.legend()
    axes[2].plot(xs, [r["output_throughput"] for r in runs], "o-")
    axes[2].set_title("output tokens/s")
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
