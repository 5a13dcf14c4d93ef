"""The plots: ``onebit-stats simulate --plot FILE.png`` (per-layer hit rate and tok/s against
bandwidth), ``onebit-stats plot-memory REPORT.json --png FILE.png`` (tok/s against the memory limit) and
``onebit-stats plot-drives REPORT.json --png-dir DIR`` (per drive, each configuration's ratio to off per cell,
and, from reports that record it, where each token's time went: compute under waiting, per cell, beside its limits).

matplotlib is the optional ``plot`` extra (``pip install 'onebit-predict[plot]'``);
``require_matplotlib`` raises ``PlotUnavailable`` with that hint when it is missing. A plot is
drawn to a temporary name with the same suffix (matplotlib picks the format by it) and renamed
onto the file asked for once whole (onebit_predict/atomic.py): a full disk is an OSError.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..atomic import atomic_path
from .simulate import SimResult


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def _save(fig: Any, path: str | Path) -> None:
    """``fig`` as ``path`` (its format by the suffix), whole or not at all; the figure is closed."""
    import matplotlib.pyplot as plt

    fmt = Path(path).suffix[1:] or plt.rcParams["savefig.format"]  # the temporary name's suffix is not asked
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120, format=fmt)
    except Exception as e:
        # a backend cleaning up after a failed write can raise something else (the PDF one a
        # zlib.error) over the OSError that made it fail: report that one (exit 2)
        cause = _os_error(e)
        if cause is None or cause is e:
            raise
        raise OSError(cause.errno, f"cannot write the plot: {cause.strerror or cause}", str(path)) from e
    finally:
        plt.close(fig)


def _os_error(e: BaseException | None) -> OSError | None:
    """The first OSError in ``e``'s chain (itself, then its __context__), or None."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        if isinstance(e, OSError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def require_matplotlib(option: str = "--plot") -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotUnavailable(
            f"{option} needs matplotlib, the optional 'plot' extra: "
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
    _save(fig, path)


LINE_STYLES = ("-", "--", ":", "-.")


def plot_memory(
    series: list[tuple[str, str, list[tuple[float, float, float | None, float | None]]]],
    path: str | Path,
    title: str,
    resident_at: dict[str, float],
) -> None:
    """Decode tok/s against the memory limit: one line per (expert size, configuration), a colour per
    configuration, a line style per expert size; ``series`` is (size label, configuration, points of
    (limit MiB, tok/s, min, max)); ``resident_at``: where each size's resident runs are drawn."""
    require_matplotlib("--png")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(s for s, _, _ in series))
    configs = list(dict.fromkeys(c for _, c, _ in series))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, ax = plt.subplots(figsize=(9, 5.2))
    for size, config, points in series:
        points = sorted(points)
        xs = [p[0] for p in points]
        ys = [p[1] for p in points]
        lo = [p[1] - (p[2] if p[2] is not None else p[1]) for p in points]
        hi = [(p[3] if p[3] is not None else p[1]) - p[1] for p in points]
        ax.errorbar(
            xs,
            ys,
            yerr=[lo, hi],
            color=colours[configs.index(config) % len(colours)],
            linestyle=LINE_STYLES[sizes.index(size) % len(LINE_STYLES)],
            marker="o",
            markersize=3.5,
            capsize=2,
            linewidth=1.2,
            label=f"{config} ({size})" if len(sizes) > 1 else config,
        )
    for size, x in resident_at.items():
        ax.axvline(x, color="grey", linewidth=0.6, linestyle=LINE_STYLES[sizes.index(size) % len(LINE_STYLES)])
        label = f"resident ({size})" if len(sizes) > 1 else "resident"
        ax.text(x, 0.02, label, transform=ax.get_xaxis_transform(), fontsize="x-small", color="grey", rotation=90)
    ax.set_xlabel("memory limit, MiB (the cgroup's; resident: no limit)")
    ax.set_ylabel("decode tok/s (median; bars: min-max)")
    values = [p[1] for _, _, pts in series for p in pts if p[1] > 0]
    if values and max(values) / min(values) > 20:  # resident runs far above the limited ones
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize="medium")
    ax.grid(True, linewidth=0.3)
    ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    _save(fig, path)


def plot_drive_ratios(
    configurations: list[str],
    cells: list[tuple[str, list[tuple[float | None, float | None, float | None]]]],
    path: str | Path,
    title: str,
) -> None:
    """One drive's decode tok/s over patched off's: a group of bars per configuration, a bar per cell
    (expert size x limit); ``cells`` is (cell label, per configuration (ratio, min, max) over off's
    median, None where the cell lacks it). Lines at 1.0 (off) and 0.98 (a 2 % loss)."""
    require_matplotlib("--png-dir")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    n = max(1, len(cells))
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(9.0, 1.0 + 0.35 * n * len(configurations)), 5.2))
    for i, (label, points) in enumerate(cells):
        xs, ys, lo, hi = [], [], [], []
        for j, (ratio, low, high) in enumerate(points):
            if ratio is None:
                continue
            xs.append(j - 0.4 + width * (i + 0.5))
            ys.append(ratio)
            lo.append(max(0.0, ratio - (low if low is not None else ratio)))
            hi.append(max(0.0, (high if high is not None else ratio) - ratio))
        ax.bar(
            xs,
            ys,
            width=width * 0.92,
            yerr=[lo, hi],
            capsize=1.5,
            error_kw={"linewidth": 0.7},
            color=colours[i % len(colours)],
            label=label,
        )
    ax.axhline(1.0, color="black", linewidth=0.8, label="1.0: patched off")
    ax.axhline(0.98, color="grey", linewidth=0.8, linestyle=":", label="0.98: a 2 % loss")
    ax.set_xticks(range(len(configurations)))
    ax.set_xticklabels(configurations, rotation=30, ha="right", fontsize="small")
    ax.set_xlim(-0.6, len(configurations) - 0.4)
    ax.set_ylabel("decode tok/s over patched off's\n(median; bars: min-max over off's median)")
    ax.set_title(title, fontsize="medium")
    ax.grid(True, axis="y", linewidth=0.3)
    ax.legend(
        fontsize="x-small",
        title="expert size, limit",
        title_fontsize="x-small",
        loc="upper left",
        bbox_to_anchor=(1.005, 1.0),
    )
    fig.tight_layout()
    _save(fig, path)


# a cell of plot_drive_split: its label, per configuration (compute ms, waiting ms) per token or None, and its
# limits as ms per token (physical, retention-aware; None where unknown)
SplitCell = tuple[str, list[tuple[float, float] | None], float | None, float | None]


def drive_split_figure(configurations: list[str], cells: list[SplitCell], title: str) -> Any:
    """One drive's ms per decoded token: a group of bars per configuration, a stacked bar per cell, compute
    (solid) under waiting (hatched); per cell a dashed line at the physical limit's ms per token and a
    dotted one at the retention-aware limit's (a bar that reaches a line is at that limit). The figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    n = max(1, len(cells))
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(9.0, 1.0 + 0.35 * n * len(configurations)), 5.2))
    for i, (label, points, physical_ms, retention_ms) in enumerate(cells):
        colour = colours[i % len(colours)]
        drawn = [(j, p) for j, p in enumerate(points) if p is not None]
        xs = [j - 0.4 + width * (i + 0.5) for j, _ in drawn]
        compute = [p[0] for _, p in drawn]
        wait = [p[1] for _, p in drawn]
        ax.bar(xs, compute, width=width * 0.92, color=colour, label=f"{label}: compute")
        ax.bar(
            xs,
            wait,
            width=width * 0.92,
            bottom=compute,
            color=colour,
            alpha=0.35,
            hatch="//",
            label=f"{label}: waiting",
        )
        if physical_ms is not None:
            ax.axhline(physical_ms, color=colour, linewidth=0.9, linestyle="--", label=f"{label}: physical limit")
        if retention_ms is not None:
            ax.axhline(
                retention_ms, color=colour, linewidth=0.9, linestyle=":", label=f"{label}: retention-aware limit"
            )
    ax.set_xticks(range(len(configurations)))
    ax.set_xticklabels(configurations, rotation=30, ha="right", fontsize="small")
    ax.set_xlim(-0.6, len(configurations) - 0.4)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("ms per decoded token (median)\ncompute: the decoding thread's CPU; waiting: off CPU")
    ax.set_title(title, fontsize="medium")
    ax.grid(True, axis="y", linewidth=0.3)
    ax.legend(fontsize="x-small", title="expert size, limit", title_fontsize="x-small", loc="upper left",
              bbox_to_anchor=(1.005, 1.0))  # fmt: skip
    fig.tight_layout()
    return fig


def plot_drive_split(configurations: list[str], cells: list[SplitCell], path: str | Path, title: str) -> None:
    """:func:`drive_split_figure` as ``path``."""
    require_matplotlib("--png-dir")
    _save(drive_split_figure(configurations, cells, title), path)
