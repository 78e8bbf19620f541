"""``bench_serve.png``: each point's time to first token and inter-token latency, as distributions.

Drawn the way ``trace-plot`` draws: matplotlib (the ``bench`` extra) with the Agg backend,
imported only here, so the load itself needs none of it. Each panel holds one curve per load
point: the share of requests (TTFT) or of gaps between two chunks (ITL) at or under each value,
on a log scale, so a point's median and its tail read off the same curve.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from corelib.errors import ConfigError


def plot_latencies(result: Mapping[str, object], out: Path) -> Path:
    """Draw the TTFT and ITL of every point of a bench-serve ``result`` into a PNG at ``out``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("the plot is drawn with matplotlib, which is not installed: "
                          "pip install 'corelib[bench]'") from None
    points = result.get("points")
    assert isinstance(points, list), "a bench-serve result holds its points"
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, key, title in ((axes[0], "ttfts_ms", "time to first token"),
                           (axes[1], "itls_ms", "inter-token latency (between two chunks)")):
        drawn = False
        for point in points:
            values = sorted(float(v) for v in point.get(key) or ())
            if not values:
                continue
            unit = "req/s" if point["mode"] == "rate" else "clients"
            ax.step(values, _shares(values), where="post", label=f"{point['load']:g} {unit}")
            drawn = True
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_xlabel("ms")
        ax.set_ylabel("share at or under")
        ax.set_ylim(0, 1.02)
        if drawn:
            ax.set_xscale("log")
            ax.legend(fontsize=8, frameon=False)
        else:
            ax.text(0.5, 0.5, "no completed requests", ha="center", va="center", transform=ax.transAxes)
        ax.grid(color="#e0e0e0", linewidth=0.6)
        ax.set_axisbelow(True)
    fig.suptitle(f"bench-serve {result.get('url')} ({result.get('endpoint')}, {result.get('model')})", fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _shares(ordered: Sequence[float]) -> list[float]:
    count = len(ordered)
    return [(i + 1) / count for i in range(count)]
