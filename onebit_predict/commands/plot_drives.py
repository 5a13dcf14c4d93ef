"""``onebit-stats plot-drives REPORT.json [...] [--png-dir DIR] [--json|--csv]``: the drive matrix side by side.

Reads one or more ``onebit-bench MODEL --memory-limit ... --drive ... --json`` reports and prints, per
drive (``native @128``, ``native @8192``, ``nvme``, ``sata``), a markdown table: a row per
configuration, a group of columns per cell (expert size x limit) with decode tok/s median (min-max),
the ratio to patched off in the same cell, the MiB read per token, that over the cell's floor and
where a gain comes from; then two rows per cell: the **floor** (the route-alone row's routed bytes
missing per token) and the **physical limit** (1 / max(compute, floor / bandwidth)), with the
figures it comes from below the table. costmodel/drive_cells.py computes all of it.

``--png-dir DIR`` draws one PNG per drive into DIR (``nvme.png``, ``native-128.png``): grouped bars
of the ratio to off per configuration, one bar per cell, lines at 1.0 and 0.98 (matplotlib, the
optional ``plot`` extra: exit 2 when it is missing). Where a drive's rows record where their tokens'
time went (reports since issue 30: each row's ``decode``), a second PNG (``nvme-time.png``) stacks
each row's compute under its waiting, ms per token, beside each cell's physical limit and its
retention-aware limit, and the table gets a block of them, with each row's decode tok/s as a share
of both limits (``% of physical``, ``% of retention``); older reports draw and print as before.
``--json`` and ``--csv`` write the flat rows (one per cell and configuration, the cell's fields
repeated, the row's ``decode_*``) instead of the table.

``--replay REPLAY.json`` (repeatable: the first with a result at a cell's capacity serves it), from
``onebit-stats replay TRACE --slots N[,N] --policy belady --json`` of a trace of the reports' tokens:
the retention-aware limit, 1 / max(compute, Belady's misses / bandwidth), where the Belady misses
are the bytes per token the offline optimum would read with the cell's limit as slots per layer (50 %
of 128 experts: 64); costmodel/drive_cells.py :func:`~onebit_predict.costmodel.drive_cells.with_belady`.

Exit codes: 0 ok, 2 usage or input error (a file that is not a memory report, or whose rows record
no drive; --png-dir without matplotlib). A subcommand of ``onebit-stats`` (commands/stats.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..costmodel.drive_cells import Cell, by_drive, configurations, drive_cells, flat_rows, load_replay, with_belady
from ..costmodel.measured import load_memory_reports
from .common import UsageError, fmt

if TYPE_CHECKING:
    from ..costmodel.plot import SplitCell

logger = logging.getLogger("onebit_predict")
DESCRIPTION = (
    "Per drive, each configuration side by side over the cells (expert size x memory limit), from "
    "onebit-bench --memory-limit --drive --json reports: ratio to off, MiB read, the floor and the physical limit."
)
EPILOG = "exit codes: 0 ok, 2 usage or input error (matplotlib missing for --png-dir)"
FIELDS = ("tok/s (min-max)", "x off", "MiB read/token", "read / floor", "gain from")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "reports", nargs="+", type=Path, metavar="REPORT.json", help="onebit-bench --memory-limit --drive --json"
    )
    p.add_argument("--png-dir", type=Path, metavar="DIR", help="one PNG per drive into DIR (needs matplotlib)")
    p.add_argument(
        "--replay",
        type=Path,
        action="append",
        default=[],
        metavar="REPLAY.json",
        help="onebit-stats replay --policy belady --json of the reports' tokens: the retention-aware limit",
    )


def _tok(tok: float, low: float | None, high: float | None) -> str:
    spread = "" if low is None or high is None else f" ({low:.2f}-{high:.2f})"
    return f"{tok:.2f}{spread}"


def _drive_line(label: str, cells: list[Cell]) -> str:
    c = cells[0]
    ra = "unknown" if c.read_ahead_kb is None else str(c.read_ahead_kb)
    what = f"emulated drive ({c.drive} profile)" if c.emulated else "the model's own drive"
    reports = ", ".join(dict.fromkeys(x.report.name for x in cells))
    return f"{label}: {what}, read_ahead_kb {ra}; from {reports}."


def _limit_note(c: Cell) -> str:
    """How the cell's physical limit comes about: its compute and its floor over the drive's bandwidth."""
    bw = "-" if c.bandwidth is None else f"{c.bandwidth / 1e6:.0f} MB/s"
    compute = "compute unknown (no resident patched off)"
    if c.compute_s is not None:
        other = "" if c.compute_read_ahead_kb == c.read_ahead_kb else f" at read_ahead_kb {c.compute_read_ahead_kb}"
        other += "" if c.compute_drive == c.drive else f" on {c.compute_drive}"
        compute = f"compute {1e3 * c.compute_s:.1f} ms (resident patched off {1 / c.compute_s:.2f} tok/s{other})"
    drive = "floor / bandwidth unknown"
    if c.drive_s is not None:
        drive = f"floor / bandwidth {1e3 * c.drive_s:.1f} ms ({fmt(c.floor_mib, '.1f')} MiB at {bw})"
    return f"- {c.label}: {compute}, {drive}: {fmt(c.physical_limit_tok_s, '.2f')} tok/s"


def markdown(cells: list[Cell]) -> str:
    """A block per drive: the configurations' table, the floor and physical-limit rows, their figures."""
    blocks = []
    for label, here in by_drive(cells).items():
        names = configurations(here)
        head = ["configuration"] + [f"{c.label}: {f}" for c in here for f in FIELDS]
        lines = [f"### {label}", "", _drive_line(label, here), ""]
        lines += ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
        for name in names:
            cols = [name]
            for c in here:
                r = c.row(name)
                if r is None:
                    cols += ["-"] * len(FIELDS)
                    continue
                cols += [
                    _tok(r.tok_s, r.min_tok_s, r.max_tok_s),
                    fmt(r.ratio_to_off, ".3f"),
                    fmt(r.read_mib_per_token, ".1f"),
                    fmt(r.read_over_floor, ".2f"),
                    r.gain_from,
                ]
            lines.append("| " + " | ".join(cols) + " |")
        floor = ["**floor**: route alone's routed MiB missing/token"]
        limit = ["**physical limit**: tok/s, x off"]
        for c in here:
            floor += ["", "", fmt(c.floor_mib, ".1f"), "", ""]
            limit += [*_limit_cols(c.physical_limit_tok_s, c), "", "", ""]
        lines += ["| " + " | ".join(floor) + " |", "| " + " | ".join(limit) + " |"]
        if any(c.belady_floor_bytes is not None for c in here):
            belady = ["**Belady floor**: MiB missing/token at the cell's capacity"]
            retention = ["**retention-aware limit**: tok/s, x off"]
            for c in here:
                mib = None if c.belady_floor_bytes is None else c.belady_floor_bytes / 2**20
                belady += ["", "", fmt(mib, ".1f"), "", ""]
                retention += [*_limit_cols(c.retention_limit_tok_s, c), "", "", ""]
            lines += ["| " + " | ".join(belady) + " |", "| " + " | ".join(retention) + " |"]
        lines += ["", "Physical limit = 1 / max(compute, floor / bandwidth):", ""]
        lines += [_limit_note(c) for c in here]
        if any(c.has_split for c in here):
            lines += ["", *_split_table(here, names)]
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def _limit_cols(tok_s: float | None, c: Cell) -> list[str]:
    """A limit's tok/s and its ratio to the cell's off."""
    return [fmt(tok_s, ".2f"), fmt(None if tok_s is None or not c.off_tok_s else tok_s / c.off_tok_s, ".3f")]


def _split_table(cells: list[Cell], names: list[str]) -> list[str]:
    """Where each row's tokens' time went: compute and waiting ms per token per cell, the requests and the
    expert-level hit rate; a limit as ms per token under them."""
    split_fields = ("compute ms", "wait ms", "requests/token", "expert hit %", "% of physical", "% of retention")
    head = ["configuration"] + [f"{c.label}: {f}" for c in cells for f in split_fields]
    lines = ["Per decoded token (compute: the decoding thread's CPU; wait: off CPU):", ""]
    lines += ["| " + " | ".join(head) + " |", "|---" + "|---:" * (len(head) - 1) + "|"]
    for name in names:
        cols = [name]
        for c in cells:
            r = c.row(name)
            d = None if r is None else r.decode
            if d is None:
                cols += ["-"] * len(split_fields)
                continue
            hit = None if d.expert_hit is None else 100 * d.expert_hit
            cols += [fmt(d.compute_ms, ".1f"), fmt(d.wait_ms, ".1f"), fmt(d.requests, ".1f"), fmt(hit, ".1f")]
            cols += [_percent(c.of_physical(r)), _percent(c.of_retention(r))]
        lines.append("| " + " | ".join(cols) + " |")
    for what, attr in (("physical limit", "physical_limit_tok_s"), ("retention-aware limit", "retention_limit_tok_s")):
        ms = [_ms(getattr(c, attr)) for c in cells]
        if any(m is not None for m in ms):
            cols = [f"**{what}**: ms/token"]
            for m in ms:
                cols += [fmt(m, ".1f")] + [""] * (len(split_fields) - 1)
            lines.append("| " + " | ".join(cols) + " |")
    return lines


def _percent(share: float | None) -> str:
    return fmt(None if share is None else 100 * share, ".0f")


def _ms(tok_s: float | None) -> float | None:
    return None if not tok_s else 1e3 / tok_s


def png_name(label: str) -> str:
    """A drive label as a file name: ``native @128`` -> ``native-128.png``."""
    return re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-") + ".png"


def write_pngs(cells: list[Cell], out: Path, models: str) -> list[Path]:
    from ..costmodel.plot import plot_drive_ratios, plot_drive_split

    out.mkdir(parents=True, exist_ok=True)
    written = []
    for label, here in by_drive(cells).items():
        names = configurations(here)
        series = []
        for c in here:
            rows = [c.row(n) for n in names]
            series.append(
                (
                    c.label,
                    [(None, None, None) if r is None else (r.ratio_to_off, r.ratio_min, r.ratio_max) for r in rows],
                )
            )
        path = out / png_name(label)
        plot_drive_ratios(names, series, path, f"{label}: decode tok/s over patched off, per cell ({models})")
        written.append(path)
        if any(c.has_split for c in here):
            path = out / png_name(f"{label} time")
            title = f"{label}: where each token's time went ({models})"
            plot_drive_split(names, split_series(here, names), path, title)
            written.append(path)
    return written


def split_series(cells: list[Cell], names: list[str]) -> list[SplitCell]:
    """Per cell: its label, each configuration's (compute, waiting) ms per token (None: not recorded, or not
    separable with several threads), its physical and retention-aware limits as ms per token."""
    out = []
    for c in cells:
        points = []
        for name in names:
            r = c.row(name)
            d = None if r is None else r.decode
            points.append(None if d is None or d.wait_ms is None else (d.compute_ms, d.wait_ms))
        out.append((c.label, points, _ms(c.physical_limit_tok_s), _ms(c.retention_limit_tok_s)))
    return out


def run(args: argparse.Namespace) -> int:
    if args.png_dir is not None:
        from ..costmodel.plot import require_matplotlib

        if args.png_dir.exists() and not args.png_dir.is_dir():  # the argument first, the machine after
            raise UsageError(f"--png-dir {args.png_dir}: not a directory")
        require_matplotlib("--png-dir")
    replays = [load_replay(p) for p in args.replay]
    reports = load_memory_reports(args.reports)
    cells = with_belady(drive_cells(reports), replays)
    rows = flat_rows(cells)
    if args.json:
        print(json.dumps({"reports": [str(p) for p in args.reports], "rows": rows}, indent=2))
    elif args.csv:
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(list(rows[0]))
        for r in rows:
            w.writerow(["" if v is None else v for v in r.values()])
    else:
        print(markdown(cells))
    if args.png_dir is not None:
        models = ", ".join(dict.fromkeys(Path(m.model).name for m in reports))
        for path in write_pngs(cells, args.png_dir, models):
            logger.info("wrote %s", path)
    return 0
