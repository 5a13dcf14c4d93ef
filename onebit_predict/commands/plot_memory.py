"""``onebit-stats plot-memory REPORT.json [...] [--png OUT.png] [--json|--csv]``: the memory-limit runs side by side.

Reads one or more ``onebit-bench MODEL --memory-limit ... --json`` reports (several expert sizes,
several limits) and prints a markdown table: expert size x memory limit x configuration, with
decode tok/s (median, min, max), the ratio to "patched off" at the same limit, the MiB read and
the major faults per token. ``--png`` draws decode tok/s against the memory limit, a colour per
configuration and a line style per expert size (matplotlib, the optional ``plot`` extra: exit 2
when it is missing). ``--json`` and ``--csv`` write the table's rows instead.

Exit codes: 0 ok, 2 usage or input error (a file that is not a memory report, --png without
matplotlib). A subcommand of ``onebit-stats`` (commands/stats.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from ..costmodel.measured import Measured, MeasuredRow, load_memory_reports
from ..costmodel.row_config import RowConfig
from .common import fmt

logger = logging.getLogger("onebit_predict")
DESCRIPTION = "Decode tok/s against the memory limit, from onebit-bench --memory-limit --json reports: a table, a PNG."
EPILOG = "exit codes: 0 ok, 2 usage or input error (matplotlib missing for --png)"
MIB = 2**20


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("reports", nargs="+", type=Path, metavar="REPORT.json", help="onebit-bench --memory-limit --json")
    p.add_argument("--png", type=Path, metavar="OUT.png", help="draw tok/s against the limit (needs matplotlib)")
    p.add_argument("--title", help="the plot's title (default: the reports' models)")


@dataclass(frozen=True)
class Size:
    """One report's expert size: all its routed experts' bytes, and one expert's where known."""

    total_bytes: int | None
    per_expert_bytes: float | None
    model: str

    @property
    def label(self) -> str:
        if self.per_expert_bytes:
            return f"{self.per_expert_bytes / MIB:.2f} MiB experts"
        if self.total_bytes:
            return f"{self.total_bytes / MIB:.0f} MiB of experts"
        return Path(self.model).name


def _size(report: Measured) -> Size:
    """The mean bytes of one expert from the report's model when it is readable here, else None."""
    from ..costmodel.expert_bytes import mean_expert_bytes

    per = mean_expert_bytes(report.model)
    return Size(report.expert_bytes, per, report.model)


@dataclass(frozen=True)
class TableRow:
    size: Size
    row: MeasuredRow
    off_tok_s: float | None

    @property
    def resident(self) -> bool:
        return self.row.resident

    @property
    def limit_text(self) -> str:
        return "resident" if self.resident else f"{self.row.limit_bytes / MIB:.0f}"

    @property
    def limit_pct(self) -> float | None:
        if self.resident or not self.size.total_bytes:
            return None
        return 100.0 * self.row.limit_bytes / self.size.total_bytes

    @property
    def ratio(self) -> float | None:
        if self.row.ratio_to_off is not None:
            return self.row.ratio_to_off
        return self.row.tok_s / self.off_tok_s if self.off_tok_s else None

    def values(self) -> dict[str, object]:
        r = self.row
        return {
            "model": self.size.model,
            "expert_size": self.size.label,
            "expert_bytes_total": self.size.total_bytes,
            "expert_bytes_each": self.size.per_expert_bytes,
            "limit_bytes": r.limit_bytes,
            "limit": self.limit_text,
            "limit_pct_of_experts": self.limit_pct,
            "configuration": r.name,
            "median_tok_s": r.tok_s,
            "min_tok_s": r.min_tok_s,
            "max_tok_s": r.max_tok_s,
            "ratio_to_off": self.ratio,
            "read_mib_per_token": r.read_mib_per_token,
            "major_faults_per_token": r.major_faults_per_token,
        }


def table_rows(reports: list[Measured]) -> list[TableRow]:
    """Expert size (ascending) x limit (resident, then descending) x configuration (the report's order)."""
    out = []
    for rep in sorted(reports, key=lambda m: (m.expert_bytes or 0, str(m.path))):
        size = _size(rep)
        limits = sorted({r.limit_bytes or 0 for r in rep.rows}, key=lambda x: (x != 0, -x))
        for limit in limits:
            here = [r for r in rep.rows if (r.limit_bytes or 0) == limit]
            off = next((r.tok_s for r in here if r.config == RowConfig()), None)  # patched off
            out += [TableRow(size, r, off) for r in here]
    return out


def markdown(rows: list[TableRow]) -> str:
    lines = [
        "| expert size | limit MiB | limit % of experts | configuration | decode tok/s (median) | min | max "
        "| vs patched off | MiB read/token | major faults/token |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for t in rows:
        r = t.row
        lines.append(
            f"| {t.size.label} | {t.limit_text} | {fmt(t.limit_pct, '.0f')} | {r.name} | {r.tok_s:.2f} | "
            f"{fmt(r.min_tok_s, '.2f')} | {fmt(r.max_tok_s, '.2f')} | {fmt(t.ratio, '.3f')} | "
            f"{fmt(r.read_mib_per_token, '.1f')} | {fmt(r.major_faults_per_token, '.1f')} |"
        )
    return "\n".join(lines)


def _series(rows: list[TableRow]) -> tuple[list, dict[str, float]]:
    series: dict[tuple[str, str], list] = {}
    resident_at: dict[str, float] = {}
    for t in rows:
        x = t.row.limit_bytes / MIB if not t.resident else (t.size.total_bytes or 0) / MIB * 1.1
        if t.resident:
            resident_at[t.size.label] = x
        series.setdefault((t.size.label, t.row.name), []).append((x, t.row.tok_s, t.row.min_tok_s, t.row.max_tok_s))
    return [(s, c, pts) for (s, c), pts in series.items()], resident_at


def run(args: argparse.Namespace) -> int:
    if args.png is not None:
        from ..costmodel.plot import require_matplotlib

        require_matplotlib("--png")
    reports = load_memory_reports(args.reports)
    rows = table_rows(reports)
    if args.json:
        print(json.dumps({"reports": [str(p) for p in args.reports], "rows": [t.values() for t in rows]}, indent=2))
    elif args.csv:
        w = csv.writer(sys.stdout, lineterminator="\n")
        names = list(rows[0].values())
        w.writerow(names)
        for t in rows:
            w.writerow(["" if v is None else v for v in t.values().values()])
    else:
        print(markdown(rows))
    if args.png is not None:
        from ..costmodel.plot import plot_memory

        series, resident_at = _series(rows)
        title = args.title or "decode tok/s under a memory limit: " + ", ".join(
            dict.fromkeys(Path(m.model).name for m in reports)
        )
        plot_memory(series, args.png, title, resident_at)
        logger.info("wrote %s", args.png)
    return 0
