"""``onebit-stats simulate --plot FILE.png``: per-layer hit rate and tok/s against bandwidth.

matplotlib is the optional ``plot`` extra (``pip install 'onebit-predict[plot]'``);
``require_matplotlib`` raises ``PlotUnavailable`` with that hint when it is missing.
"""

from __future__ import annotations

from pathlib import Path

from .simulate import SimResult


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(
            "--plot needs matplotlib, the optional 'plot' extra: "
            "pip install 'onebit-predict[plot]' (or pip install matplotlib)"
        ) from None


def plot_simulation(result: SimResult, path: str | Path, title: str, marked: list[float]) -> None:
    """Write a two-panel PNG: hit rate per layer per predictor; tok/s per predictor over ``result``'s bandwidths."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in result.predictors:
        per_layer = result.layer_counts[name]
        layers = list(per_layer)
        left.plot(layers, [100 * (per_layer[layer].hit_rate or 0.0) for layer in layers], marker="o", label=name)
        bws = result.bandwidths
        right.plot([b / 1e9 for b in bws], [result.run(name, b).tok_s or 0.0 for b in bws], marker=".", label=name)
    left.set_xlabel("layer")
    left.set_ylabel("cache hit rate, %")
    left.set_ylim(0, 105)
    left.set_title(f"hit rate, {result.cache.slots} slots/layer, {result.cache.policy}")
    left.legend(fontsize="small")
    for b in marked:
        right.axvline(b / 1e9, color="grey", linewidth=0.6, linestyle=":")
    right.set_xscale("log")
    right.set_xlabel("drive bandwidth, GB/s")
    right.set_ylabel("decode tok/s (modelled)")
    right.set_title("tok/s against bandwidth")
    right.legend(fontsize="small")
    fig.suptitle(title, fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
