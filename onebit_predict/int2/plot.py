"""``onebit-int2 plot QUALITY.json --out FILE.png``: the 2-bit study's plot, from a quality report.

The report is what ``onebit-int2 quality MODEL --json`` writes (int2/quality.py: ``Quality.labels``
and a ``Row.to_dict`` per row). The plot: mean KL divergence against F16 (y, log scale, error bars
from llama-perplexity's ``±``) over the routed experts' bytes read per token (x, log scale, KiB),
a point per row labelled with its variant; a compensated row (``compensator`` not null) is a
diamond, joined by an arrow from its variant's plain row and labelled ``VARIANT+comp`` with the
change of mean KLD (``-45 %``). A compensated row sits at its variant's expert bytes: the report
carries no figure for the compensator's own bytes (the footnote says so). The 2-bit types
(variants.TWO_BIT) lie close together at the left: where the report has others too, a second panel
shows them alone, closer (with their labels, and their region dashed on the first).

A row whose mean KLD is not > 0 (F16's is ~0, printed as ``-0.00000``: the base's log-probabilities
are rounded to 16 bits) cannot sit on a log axis: it is marked at the axis floor (a ▼), labelled,
and named in the footnote and on stderr. A row whose mean KLD is not a finite number is not drawn,
and stderr says so. Nothing is left off silently.

:func:`load_report` reads and checks the report (:class:`NotAQualityReport`, exit 2, on anything
else); :func:`plot_quality` draws it (matplotlib, the optional ``plot`` extra, imported only here,
with the Agg backend; the PNG is written whole or not at all, costmodel/plot.py's ``_save``);
:func:`labels`, :func:`table_rows` and :func:`table_parts` are the command's output.
"""

from __future__ import annotations

import json
import logging
import math
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..costmodel.plot import _save, require_matplotlib
from .variants import TWO_BIT, Int2Error

logger = logging.getLogger("onebit_predict")
KIB = 1024
DRAWN, FLOOR, NOT_DRAWN = "yes", "at floor", "no"


class NotAQualityReport(Int2Error):
    """The file is not JSON, or not what ``onebit-int2 quality --json`` writes (exit 2)."""


@dataclass(frozen=True)
class Point:
    """One row of the report, as the plot and the table use it."""

    variant: str
    compensator: str | None
    expert_type: str | None
    expert_bytes_per_token: int
    kld_mean: float
    kld_mean_pm: float | None
    recovers_pct: float | None

    @property
    def name(self) -> str:
        """``q2_k`` or, compensated, ``q2_k+<compensator file's stem>``."""
        return self.variant + (f"+{Path(self.compensator).stem}" if self.compensator else "")

    @property
    def drawn(self) -> str:
        """DRAWN at its value, FLOOR (mean KLD not > 0: at the axis floor) or NOT_DRAWN (not finite)."""
        if not math.isfinite(self.kld_mean):
            return NOT_DRAWN
        return DRAWN if self.kld_mean > 0 else FLOOR

    @property
    def why(self) -> str | None:
        """Why the row is not at its value on the plot (None when it is)."""
        if self.drawn == NOT_DRAWN:
            return f"mean KLD is {self.kld_mean}, not a number a plot can show: not drawn"
        if self.drawn == FLOOR:
            return f"mean KLD {self.kld_mean:.5f} is not > 0, which a log axis cannot show: marked at the axis floor"
        return None


@dataclass(frozen=True)
class QualityReport:
    """A quality report: the model, the text its figures are of, and its rows."""

    path: Path
    model: str
    model_sha256: str | None
    text: str  # the held-out text's description
    windows: str | None  # "windows of 256 tokens, 127 scored per window", where the report says
    points: list[Point]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _point(i: int, row: Any) -> Point:
    if not isinstance(row, dict):
        raise ValueError(f"rows[{i}] is not an object")
    variant = row.get("variant")
    if not isinstance(variant, str) or not variant:
        raise ValueError(f"rows[{i}] has no variant")
    where = f"rows[{i}] ({variant})"
    comp, etype, pm, gain = (row.get(k) for k in ("compensator", "expert_type", "kld_mean_pm", "recovers_pct"))
    if "compensator" not in row or not (comp is None or isinstance(comp, str)):
        raise ValueError(f"{where}: no compensator (null or a path)")
    ebt = row.get("expert_bytes_per_token")
    if not isinstance(ebt, int) or isinstance(ebt, bool) or ebt <= 0:
        raise ValueError(f"{where}: expert_bytes_per_token is not a positive integer: {ebt!r}")
    if not _number(row.get("kld_mean")):
        raise ValueError(f"{where}: kld_mean is not a number: {row.get('kld_mean')!r}")
    for key, value in (("kld_mean_pm", pm), ("recovers_pct", gain)):
        if value is not None and not _number(value):
            raise ValueError(f"{where}: {key} is not a number: {value!r}")
    etype = etype if isinstance(etype, str) else None
    pm = pm if pm is None or math.isfinite(pm) else None  # a ± llama-perplexity could not compute: none
    return Point(variant, comp, etype, ebt, float(row["kld_mean"]), pm, gain)


def load_report(path: Path) -> QualityReport:
    """The report in ``path``; NotAQualityReport (naming the file and what is wrong) when it is not one."""
    try:
        data = json.loads(path.read_text())
    except UnicodeDecodeError as e:
        raise NotAQualityReport(f"{path}: not JSON (not UTF-8 text: {e.reason})") from None
    except json.JSONDecodeError as e:
        raise NotAQualityReport(f"{path}: not JSON ({e})") from None
    what = f"{path}: not an 'onebit-int2 quality --json' report"
    if not isinstance(data, dict):
        raise NotAQualityReport(f"{what}: not a JSON object")
    text = data.get("text")
    if not isinstance(data.get("model"), str) or not isinstance(text, dict) or "description" not in text:
        raise NotAQualityReport(f"{what}: no 'model' and 'text' (with its description)")
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise NotAQualityReport(f"{what}: no rows")
    try:
        points = [_point(i, r) for i, r in enumerate(rows)]
    except ValueError as e:
        raise NotAQualityReport(f"{what}: {e}") from None
    ctx, scored = data.get("ctx"), data.get("scored_per_window")
    windows = f"windows of {ctx} tokens, {scored} scored per window" if _number(ctx) and _number(scored) else None
    sha = data.get("model_sha256")
    return QualityReport(
        path, data["model"], sha if isinstance(sha, str) else None, str(text["description"]), windows, points
    )


def _pm(value: float, pm: float | None) -> str:
    return f"{value:.5f}" + ("" if pm is None else f" ± {pm:.5f}")


def table_rows(report: QualityReport) -> list[dict[str, Any]]:
    """A row per report row, in its order: what is plotted and where."""
    return [
        {
            "row": p.name,
            "variant": p.variant,
            "compensator": p.compensator,
            "compensated": p.compensator is not None,
            "expert_type": p.expert_type,
            "expert_bytes_per_token": p.expert_bytes_per_token,
            "kld_mean": p.kld_mean,
            "kld_mean_pm": p.kld_mean_pm,
            "on_plot": p.drawn,
            "why": p.why,
        }
        for p in report.points
    ]


def labels(report: QualityReport, png: Path) -> dict[str, Any]:
    """What the table is of: the report, the model, the text, the PNG."""
    return {
        "report": str(report.path),
        "model": report.model,
        "model_sha256": report.model_sha256,
        "text": report.text,
        "png": str(png),
    }


def table_parts(report: QualityReport, png: Path) -> tuple[list[str], list[str], list[list[str]]]:
    """The table's lines above it (the model, the text, the PNG), its titles and its cells."""
    sha = f" (sha256 {report.model_sha256[:16]})" if report.model_sha256 else ""
    head = [f"model: {report.model}{sha}", f"text: {report.text}", f"plot: {png}"]
    titles = ["row", "compensated", "expert type", "expert bytes/token", "mean KLD", "on plot"]
    cells = [
        [p.name, "yes" if p.compensator else "no", p.expert_type or "-", str(p.expert_bytes_per_token)]
        + [_pm(p.kld_mean, p.kld_mean_pm), p.drawn]
        for p in report.points
    ]
    return head, titles, cells


def _floor(points: list[Point]) -> tuple[float, float]:
    """The y axis's (floor, top): whole decades around the drawn points and their error bars."""
    drawn = [p for p in points if p.drawn == DRAWN]
    if not drawn:
        return 1e-6, 1.0
    low = min(p.kld_mean - (p.kld_mean_pm or 0.0) for p in drawn)
    low = low if low > 0 else min(p.kld_mean for p in drawn) / 2
    high = max(p.kld_mean + (p.kld_mean_pm or 0.0) for p in drawn)
    return 10 ** math.floor(math.log10(low)), 10 ** math.ceil(math.log10(high) + 0.15)


def _footnote(report: QualityReport, compensated: bool) -> str:
    notes = ["Error bars: the ± llama-perplexity prints with the mean KLD."]
    floor = [f"{p.name} ({p.kld_mean:.5f})" for p in report.points if p.drawn == FLOOR]
    if floor:
        notes.append(f"▼ at the axis floor: mean KLD not > 0, which a log axis cannot show: {', '.join(floor)}.")
    lost = [f"{p.name} ({p.kld_mean})" for p in report.points if p.drawn == NOT_DRAWN]
    if lost:
        notes.append(f"Not drawn, mean KLD not a finite number: {', '.join(lost)}.")
    if compensated:
        notes.append(
            "◆ with a compensator (+comp; the table names the file), at its variant's expert bytes (the compensator's "
            "own bytes are not in the report); the arrow goes from the plain variant to it. Its label's -45 %: the "
            "change of mean KLD, the compensator recovers 45 % of the variant's."
        )
    return "\n".join(textwrap.fill(n, 150) for n in notes)


# where a label may go, in points from its point: (dx, dy, horizontal and vertical alignment); NEAR
# beside it, FAR a little off with a thin leader line back to it
NEAR = ((6, 2, "left", "bottom"), (6, -2, "left", "top"), (-6, 2, "right", "bottom"), (-6, -2, "right", "top"))
FAR = (
    *((dx * 3, dy * 6, ha, va) for dx, dy, ha, va in NEAR),
    (26, 0, "left", "center"),
    (-26, 0, "right", "center"),
    (0, 16, "center", "bottom"),
    (0, -16, "center", "top"),
)
Pair = tuple[tuple[float, float], tuple[float, float]]


def _place_labels(fig: Any, ax: Any, labels: list[tuple[float, float, str, str, bool]], arrows: list[Pair]) -> None:
    """Each label (x, y, text, colour, below first) where it stays in the axes and covers no other point,
    arrow nor label: beside its point (:data:`NEAR`) where it can, else a little off (:data:`FAR`) with a
    leader line; where no place is clear, the one that covers the fewest."""
    import numpy as np
    from matplotlib.transforms import Bbox

    renderer = fig.canvas.get_renderer()
    inside = ax.get_window_extent(renderer)
    r = 5 * fig.dpi / 72  # a marker's half width, in pixels
    dots = [ax.transData.transform((x, y)) for x, y, *_ in labels]
    ends = [(ax.transData.transform(a), ax.transData.transform(b)) for a, b in arrows]  # (from, to) in pixels
    taken: list[Any] = [Bbox.from_extents(*(np.minimum(a, b) - 2), *(np.maximum(a, b) + 2)) for a, b in ends]
    for i, (x, y, text, colour, below) in enumerate(labels):
        others = [Bbox.from_extents(u - r, v - r, u + r, v + r) for j, (u, v) in enumerate(dots) if j != i]
        near = [NEAR[k] for k in ((1, 0, 3, 2) if below else (0, 1, 2, 3))]
        best: tuple[float, Any, Any] | None = None
        for n, (dx, dy, ha, va) in enumerate([*near, *FAR]):
            far = n >= len(near)
            leader = {"arrowstyle": "-", "color": colour, "linewidth": 0.5, "shrinkA": 0, "shrinkB": 4} if far else None
            kw = {"textcoords": "offset points", "ha": ha, "va": va, "fontsize": "small", "color": colour}
            note = ax.annotate(text, (x, y), xytext=(dx, dy), arrowprops=leader, **kw)
            box = note.get_window_extent(renderer)
            inner = inside.x0 <= box.x0 and box.x1 <= inside.x1 and inside.y0 <= box.y0 and box.y1 <= inside.y1
            cost = (0 if inner else 100) + 10 * sum(box.overlaps(b) for b in [*others, *taken]) + far + n / 100
            if best is None or cost < best[0]:
                if best is not None:
                    best[1].remove()
                best = (cost, note, box)
            else:
                note.remove()
            if cost < 1:  # beside its point, and clear
                break
        assert best is not None
        taken.append(best[2])


def _label(p: Point, report: QualityReport) -> str:
    """A point's label: its variant; compensated, ``+comp`` (``+<the file's stem>`` where the variant
    has more than one compensated row) and its mean KLD's change from the plain row (``-45 %``)."""
    if p.compensator is None:
        return p.variant
    several = sum(q.variant == p.variant and q.compensator is not None for q in report.points) > 1
    name = p.name if several else f"{p.variant}+comp"
    return name + ("" if p.recovers_pct is None else f" {-p.recovers_pct:+.0f} %")


Drawn = list[tuple[Point, float, float]]  # the rows on a panel, each at (x KiB, y)


def _draw(ax: Any, drawn: Drawn, colour: dict[str, str]) -> list[Pair]:
    """The rows' markers and error bars on ``ax``, an arrow from each plain row to its compensated
    rows; the arrows' (from, to)."""
    ax.set_xscale("log")
    ax.set_yscale("log")
    for p, x, y in drawn:
        c = colour[p.variant]
        if p.drawn == FLOOR:
            ax.plot([x], [y], marker="v", markersize=9, color=c, clip_on=False, zorder=3)
        else:
            err = [[min(p.kld_mean_pm or 0.0, y * 0.999)], [p.kld_mean_pm or 0.0]]  # a bar cannot reach 0 on a log axis
            ax.errorbar([x], [y], yerr=err, marker="D" if p.compensator else "o", markersize=7, color=c, capsize=3)
    plain = {p.variant: (x, y) for p, x, y in reversed(drawn) if p.compensator is None}  # where the arrows start
    arrows = []
    for p, x, y in drawn:
        if p.compensator and p.variant in plain:
            arrow = {"arrowstyle": "-|>", "color": colour[p.variant], "linewidth": 1.2, "shrinkA": 5, "shrinkB": 5}
            ax.annotate("", xy=(x, y), xytext=plain[p.variant], arrowprops=arrow)
            arrows.append((plain[p.variant], (x, y)))
    return arrows


def _axes(ax: Any, drawn: Drawn, ylim: tuple[float, float], zoom: bool) -> None:
    """A panel's limits, ticks, labels and grid; the zoom's x ticks at its rows' bytes."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter, NullLocator

    xs = sorted({x for _, x, _ in drawn})
    ax.set_xlim(*((xs[0] / 1.04, xs[-1] * 1.12) if zoom else (xs[0] / 1.3, xs[-1] * 1.35)))
    ax.set_ylim(*ylim)
    ax.xaxis.set_major_locator(FixedLocator(xs) if zoom else LogLocator(base=10, subs=(1, 2, 3, 4, 5, 7)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0f}"))
    ax.xaxis.set_minor_locator(NullLocator() if zoom else LogLocator(base=10, subs=tuple(range(1, 10))))
    ax.xaxis.set_minor_formatter(NullFormatter())
    if zoom:  # under two decades: ticks at 1, 2 and 5, as plain numbers
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("routed expert bytes read per token, KiB (log scale)")
    ax.set_ylabel("mean KL divergence against F16, nats per token (log scale)")
    ax.grid(True, which="major", linewidth=0.4)
    ax.grid(True, which="minor", axis="y", linewidth=0.2)


def _legend(ax: Any, report: QualityReport) -> None:
    from matplotlib.lines import Line2D

    kinds = [("o", "routed experts in the variant's type", True)]
    kinds.append(("D", "the same, with a compensator", any(p.compensator for p in report.points)))
    kinds.append(("v", "mean KLD ≤ 0: at the axis floor", any(p.drawn == FLOOR for p in report.points)))
    handles = [Line2D([], [], marker=m, linestyle="", color="grey", label=t) for m, t, used in kinds if used]
    ax.legend(handles=handles, fontsize="small", loc="upper right")


def _zoom_box(ax: Any, xlim: tuple[float, float], ylim: tuple[float, float]) -> None:
    """The zoom panel's region, dashed, on the panel of every row."""
    from matplotlib.patches import Rectangle

    box = Rectangle((xlim[0], ylim[0]), xlim[1] - xlim[0], ylim[1] - ylim[0], fill=False, linestyle="--")
    ax.add_patch(box)
    ax.annotate(
        "the 2-bit types: right", (xlim[1], ylim[1]), xytext=(2, 2), textcoords="offset points", fontsize="small"
    )


def plot_quality(report: QualityReport, path: Path) -> None:
    """Draw ``report`` to ``path`` (its format by the suffix); every row not at its value is logged.

    One panel of every row; beside it, where the report has 2-bit rows (variants.TWO_BIT) and others,
    a second of the 2-bit rows alone, closer (their labels there, not on the first)."""
    if path.is_dir():  # the argument first, the machine after
        raise Int2Error(f"--out {path}: a directory, not a file")
    require_matplotlib("onebit-int2 plot")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for p in report.points:
        if p.why:
            (logger.warning if p.drawn == NOT_DRAWN else logger.info)("%s: %s", p.name, p.why)
    floor, top = _floor(report.points)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    colour = {v: colours[i % len(colours)] for i, v in enumerate(dict.fromkeys(p.variant for p in report.points))}
    drawn = [(p, p.expert_bytes_per_token / KIB, p.kld_mean if p.drawn == DRAWN else floor) for p in report.points]
    drawn = [d for d in drawn if d[0].drawn != NOT_DRAWN]
    two = [d for d in drawn if d[0].variant in TWO_BIT]
    zoom = bool(two) and len(two) < len(drawn)
    fig, axes = plt.subplots(1, 2 if zoom else 1, figsize=(17 if zoom else 11, 7.5), squeeze=False)
    panels = [(axes[0][0], [d for d in drawn if not zoom or d not in two], _draw(axes[0][0], drawn, colour))]
    _axes(axes[0][0], drawn, (floor, top), False)
    _legend(axes[0][0], report)
    if zoom:
        ys = [y - (p.kld_mean_pm or 0.0) for p, _, y in two] + [y + (p.kld_mean_pm or 0.0) for p, _, y in two]
        ylim = (max(min(ys), floor) / 1.3, min(max(ys) * 1.3, top))
        panels.append((axes[0][1], two, _draw(axes[0][1], two, colour)))
        _axes(axes[0][1], two, ylim, True)
        axes[0][1].set_title("the 2-bit types, closer", fontsize="medium")
        _zoom_box(axes[0][0], axes[0][1].get_xlim(), ylim)
    sha = f" (sha256 {report.model_sha256[:16]})" if report.model_sha256 else ""
    what = report.text + (f"; {report.windows}" if report.windows else "")
    title = f"{Path(report.model).name}{sha}: mean KL divergence against F16 over expert bytes per token"
    fig.suptitle(title + "\n" + textwrap.fill(what, 190 if zoom else 120), fontsize="medium")
    note = _footnote(report, any(p.compensator for p in report.points))
    fig.text(0.01, 0.01, note, fontsize="x-small", va="bottom", ha="left")
    fig.tight_layout(rect=(0, 0.02 + 0.022 * (note.count("\n") + 1), 1, 1))
    for ax, here, arrows in panels:
        labels = [(x, y, _label(p, report), colour[p.variant], bool(p.compensator)) for p, x, y in here]
        _place_labels(fig, ax, labels, arrows)
    _save(fig, path)
