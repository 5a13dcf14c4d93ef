"""docs/results.md shows what docs/measured/*.json holds, and the links into it resolve.

Every table of measured runs (one with a "decode tok/s (median)" column, or a "prompt tok/s (median)"
one, whose rows are the report's prefill_rows) names its report with
a link, ``[...](measured/NAME.json)``, in the text between the previous table or heading and
itself, and every cell of such a table is the report's figure at the precision the table
prints. A figure edited in the docs and not in the report (or the other way round) fails here;
so does a measured table with no report, unless it sits in a section listed in UNREPORTED (a
run from before the reports were kept), and a column this test cannot map to a report's field.
A table whose report is an ``onebit-stats plot-drives --json`` (the limits' fractions) is checked
the same way, its rows keyed by drive, expert size, limit and configuration (LIMITS_COLUMNS); one whose
report is a ``tools/server_turns.py --json`` (a server's turns) is the table that tool prints from it.
Every ``results.md#anchor`` of README.md and docs/*.md, and every ``#anchor`` of results.md
itself, names one of its headings.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results.md"
MEASURED = REPO / "docs" / "measured"
MIB = 2**20

MEASURED_COLUMN = "decode tok/s (median)"  # a table with it is a measured run's
# headings whose measured tables have no report (run before onebit-bench wrote --json reports);
# tests/test_simulate_pages.py reads that table from here
UNREPORTED = {"The first memory-limit measurement (16 tokens)"}
LINK = re.compile(r"\]\(measured/([\w.+-]+\.json)\)")
NUMBER = re.compile(r"-?\d+(?:\.(\d+))?")


@dataclass
class Table:
    line: int  # 1-based line of its header row
    heading: str  # the nearest heading above it
    reports: list[str]  # the measured/*.json links between the previous table or heading and it
    columns: list[str]
    rows: list[list[str]]


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[Table]:
    """Every pipe table of a markdown text, with its heading and the reports linked before it."""
    lines = text.splitlines()
    out: list[Table] = []
    heading, preamble, fenced, i = "", [], False, 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            heading, preamble = line.lstrip("#").strip(), []
        elif not fenced and line.startswith("|") and i + 1 < len(lines) and re.match(r"^\|[-:| ]+\|$", lines[i + 1]):
            start, i = i, i + 2
            rows = []
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(cells(lines[i]))
                i += 1
            reports = sorted(set(LINK.findall("\n".join(preamble))))
            out.append(Table(start + 1, heading, reports, cells(lines[start]), rows))
            preamble = []
            continue
        else:
            preamble.append(line)
        i += 1
    return out


# --- the report's figure each column shows -------------------------------------------------


def fraction(field: str) -> Callable[[dict], float | None]:
    return lambda r: None if r.get(field) is None else 100 * r[field]


def mib(field: str) -> Callable[[dict], float]:
    return lambda r: r[field] / MIB


# column header -> (the row's figure, the unit printed after it)
COLUMNS: dict[str, tuple[Callable[[dict], float | int | None], str]] = {
    "decode tok/s (median)": (lambda r: r["median_tok_s"], ""),
    "min": (lambda r: r["min_tok_s"], ""),
    "max": (lambda r: r["max_tok_s"], ""),
    "vs patched off": (lambda r: r["ratio_to_off"], ""),
    "vs patched off (cold)": (lambda r: r["ratio_to_off"], ""),
    "vs consumer off": (lambda r: r["ratio_to_consumer_off"], ""),
    "compute buffer MiB": (lambda r: r["compute_mib"], ""),
    "layers predicted": (lambda r: r["layers_predicted"] or None, ""),
    "extra MiB per predicted layer": (lambda r: r["extra_mib_per_layer"], ""),
    "time cost per predicted layer": (lambda r: r["cost_pct_per_layer"], "%"),
    "MiB read/token": (lambda r: r["read_mib_per_token"], ""),
    "major faults/token": (lambda r: r["major_faults_per_token"], ""),
    "drive busy": (fraction("drive_utilisation"), "%"),
    "read recall": (fraction("read_recall"), "%"),
    "read recall %": (fraction("read_recall"), ""),
    "experts prefetched": (lambda r: r["prefetched_experts"], ""),
    "MiB prefetched": (mib("prefetched_bytes"), ""),
    "of it resident": (mib("already_resident_bytes"), ""),
    "of it resident already": (mib("already_resident_bytes"), ""),
    "failed": (lambda r: r["failed_ranges"], ""),
    # where a decoded token's time went (a row's decode split, checks/rounds.py decode_split)
    "compute ms": (lambda r: r["decode"]["compute_ms"], ""),
    "wait ms": (lambda r: r["decode"]["wait_ms"], ""),
    "run queue ms": (lambda r: r["decode"].get("run_queue_ms"), ""),
    "workers CPU ms": (lambda r: r["decode"].get("others_cpu_ms"), ""),
    "requests/token": (lambda r: r["decode"]["requests"], ""),
    "mean KiB": (lambda r: r["decode"]["request_kib_mean"] or 0, ""),
    "room MiB": (lambda r: r["decode"]["room_mib"], ""),
    "route wait ms": (lambda r: r["decode"]["route_wait_ms"], ""),
    "in flight": (lambda r: r["decode"]["in_flight"], ""),
    "busy %": (lambda r: None if r["decode"]["busy"] is None else 100 * r["decode"]["busy"], ""),
    "emulator CPU s": (lambda r: r["drive_decode_cpu_s"], ""),
    "request ms": (lambda r: r["decode"]["request_ms_mean"], ""),
    "expert hit %": (lambda r: None if r["decode"]["expert_hit"] is None else 100 * r["decode"]["expert_hit"], ""),
    "guesses unused/token": (lambda r: r["decode"]["guesses_unused"], ""),
    "guesses skipped/token": (lambda r: r["decode"]["guesses_skipped"], ""),
    "MiB missing/token": (
        lambda r: None if r.get("route_missing_per_token") is None else r["route_missing_per_token"] / MIB,
        "",
    ),
}
KEYS = ("limit MiB", "configuration")
PREFILL_COLUMN = "prompt tok/s (median)"  # a table with it shows a report's prefill_rows


def row_field(field: str) -> Callable[[dict], float]:
    return lambda r: r[field]


def split(field: str, scale: float = 1.0) -> Callable[[dict], float | None]:
    """A prefill row's figure of where the prompt's time went (its "prefill" split)."""
    return lambda r: None if r["prefill"] is None or r["prefill"][field] is None else scale * r["prefill"][field]


# a prefill table's columns (checks/bench_prefill.py PrefillRow): a decode table's, where the row's field is
# the same, else its own
PREFILL_COLUMNS: dict[str, tuple[Callable[[dict], float | int | None], str]] = {
    **{c: COLUMNS[c] for c in ("vs patched off", "MiB read/token", "major faults/token")},
    **{c: (row_field(f), "") for c, f in [(PREFILL_COLUMN, "median_prompt_tok_s"),
       ("min", "min_prompt_tok_s"), ("max", "max_prompt_tok_s"), ("floor MiB/token", "expert_bytes_per_ubatch_mib")]},
    **{c: (split(f), "") for c, f in [("compute ms", "compute_ms"), ("wait ms", "wait_ms"),
       ("requests/token", "requests"), ("mean KiB", "request_kib_mean"), ("ahead MiB/token", "layers_mib")]},
    "expert hit %": (split("expert_hit", 100.0), ""),
}  # fmt: skip


# a table of the limits' fractions shows an ``onebit-stats plot-drives --json`` (its rows: one per cell and
# configuration, costmodel/drive_cells.py flat_rows), keyed by its cell and configuration
LIMITS_KEYS = {"drive": "drive", "expert size": "expert_size", "limit": "limit", "configuration": "configuration"}
LIMITS_COLUMNS: dict[str, tuple[Callable[[dict], float | int | None], str]] = {
    "tok/s": (row_field("median_tok_s"), ""),
    "floor MiB/token": (row_field("floor_mib_per_token"), ""),
    "Belady floor MiB/token": (row_field("belady_floor_mib_per_token"), ""),
    "physical limit tok/s": (row_field("physical_limit_tok_s"), ""),
    "drive MB/s": (lambda r: None if r["bandwidth_bytes_s"] is None else r["bandwidth_bytes_s"] / 1e6, ""),
    "% of physical": (fraction("of_physical_limit"), ""),
    "retention-aware limit tok/s": (row_field("retention_limit_tok_s"), ""),
    "% of retention": (fraction("of_retention_limit"), ""),
}


def is_limits(report: dict) -> bool:
    """A plot-drives --json (the limits' fractions), not a bench report."""
    return "reports" in report and all("of_physical_limit" in r for r in report["rows"])


def limits_mismatches(table: Table, report: dict) -> list[str]:
    """Each cell of a limits table that is not the plot-drives row's figure."""
    unknown = [c for c in table.columns if c not in LIMITS_COLUMNS and c not in LIMITS_KEYS]
    if unknown or not set(LIMITS_KEYS) <= set(table.columns):
        return [f"line {table.line}: columns {unknown} map to no plot-drives field (or a key column is missing)"]
    index = {tuple(r[f] for f in LIMITS_KEYS.values()): r for r in report["rows"]}
    out = [] if table.rows else [f"line {table.line}: a limits table without rows"]
    for n, row in enumerate(table.rows):
        line = table.line + 2 + n
        cell = dict(zip(table.columns, row))
        key = tuple(cell[c] for c in LIMITS_KEYS)
        if len(row) != len(table.columns) or key not in index:
            out.append(f"line {line}: {key} is no row of the plot-drives report")
            continue
        for column, shown in cell.items():
            if column in LIMITS_KEYS:
                continue
            figure, unit = LIMITS_COLUMNS[column]
            want = expected(figure(index[key]), shown, unit)
            if shown != want:
                out.append(f"line {line}: {key}, {column}: docs {shown}, report {want}")
    return out


def is_turns(report: dict) -> bool:
    """A tools/server_turns.py --json (its rounds of servers, its rows' names), not a bench report."""
    return isinstance(report.get("rounds"), list) and all(isinstance(r, str) for r in report.get("rows", [None]))


def turns_mismatches(table: Table, report: dict) -> list[str]:
    """Each cell of a server turns table that is not what tools/server_turns.py prints from the report."""
    from tools.server_turns import summary

    printed = [cells(line) for line in summary(report["rounds"], report["rows"])]
    if table.columns != printed[0]:
        return [f"line {table.line}: not the columns tools/server_turns.py prints"]
    by_name = {row[0]: row for row in printed[2:]}
    out = [] if table.rows else [f"line {table.line}: a server turns table without rows"]
    for n, row in enumerate(table.rows):
        line = table.line + 2 + n
        if row[0] not in by_name or len(row) != len(table.columns):
            out.append(f"line {line}: {row[0]} is no row of the report (or not its cells)")
            continue
        for column, shown, want in zip(table.columns[1:], row[1:], by_name[row[0]][1:]):
            if shown != want:
                out.append(f"line {line}: {row[0]}, {column}: docs {shown}, report {want}")
    return out


def limit_label(limit_bytes: int) -> str:
    """As onebit-bench --memory-limit prints it (checks/bench_memory.py): 0 is resident."""
    return "resident" if limit_bytes == 0 else f"{limit_bytes / MIB:.0f}"


def prefill_limit_label(row: dict) -> str:
    """As the prefill table prints it (checks/bench_prefill.py): the limit, + the MiB its cgroup held beyond it."""
    extra = row.get("limit_extra_mib", 0.0)
    return limit_label(row["limit_bytes"]) + (f" + {extra:.0f}" if row["limit_bytes"] and extra >= 0.5 else "")


def expected(value: float | int | None, shown: str, unit: str) -> str:
    """The report's value printed as the docs' cell prints its own: as many decimals, the same unit."""
    if value is None:
        return "-"
    m = NUMBER.fullmatch(shown.removesuffix(unit)) if shown.endswith(unit) else None
    decimals = len(m.group(1) or "") if m else 2
    return f"{value:.{decimals}f}{unit}"


def mismatches(table: Table, report: dict) -> list[str]:
    """Each cell of table that is not the report's figure, as 'line N: configuration, column: docs X, report Y'."""
    prefill = PREFILL_COLUMN in table.columns
    columns = PREFILL_COLUMNS if prefill else COLUMNS
    unknown = [c for c in table.columns if c not in columns and c not in KEYS]
    if unknown or "configuration" not in table.columns:
        return [f"line {table.line}: columns {unknown} map to no report field (or no configuration column)"]
    by_limit = "limit MiB" in table.columns
    index: dict[tuple[str | None, str], dict] = {}
    label = prefill_limit_label if prefill else (lambda r: limit_label(r.get("limit_bytes", -1)))
    for r in report["prefill_rows"] if prefill else report["rows"]:
        key = (label(r) if by_limit else None, r["name"])
        if key in index:
            return [f"line {table.line}: {key} is more than one row of the report (give the limit column)"]
        index[key] = r
    out = []
    for n, row in enumerate(table.rows):
        line = table.line + 2 + n
        if len(row) != len(table.columns):
            out.append(f"line {line}: {len(row)} cells for {len(table.columns)} columns")
            continue
        cell = dict(zip(table.columns, row))
        key = (cell["limit MiB"] if by_limit else None, cell["configuration"])
        if key not in index:
            out.append(f"line {line}: {key} is no row of the report")
            continue
        for column, shown in cell.items():
            if column in KEYS:
                continue
            figure, unit = columns[column]
            try:
                want = expected(figure(index[key]), shown, unit)
            except KeyError as e:
                out.append(f"line {line}: {column}: the report's rows have no {e}")
                continue
            if shown != want:
                out.append(f"line {line}: {key[1]}, {column}: docs {shown}, report {want}")
    return out


def measured_tables(text: str) -> list[Table]:
    return [t for t in tables(text) if t.reports or MEASURED_COLUMN in t.columns or PREFILL_COLUMN in t.columns]


def check(text: str) -> list[str]:
    """Every problem of a results.md text against the reports it links."""
    problems = []
    for t in measured_tables(text):
        if not t.reports:
            if t.heading not in UNREPORTED:
                problems.append(f"line {t.line}: a measured table ({t.heading!r}) links no measured/*.json")
            continue
        if len(t.reports) > 1:
            problems.append(f"line {t.line}: links {t.reports} before it; give each table its own")
            continue
        path = MEASURED / t.reports[0]
        if not path.is_file():
            problems.append(f"line {t.line}: {path.relative_to(REPO)} does not exist")
            continue
        report = json.loads(path.read_text())
        if is_limits(report):
            problems += limits_mismatches(t, report)
        else:
            problems += turns_mismatches(t, report) if is_turns(report) else mismatches(t, report)
    return problems


# --- the checks -------------------------------------------------------------------------------


def test_every_measured_table_is_its_report() -> None:
    assert check(RESULTS.read_text()) == []


def test_every_report_is_shown() -> None:
    """Every report of docs/measured/ is linked from results.md, but the table of the ahead
    distances, which docs/ahead.md shows."""
    linked = set(LINK.findall(RESULTS.read_text()))
    kept = {p.name for p in MEASURED.glob("*.json")} - {"ahead-table.json"}
    assert kept - linked == set()


def test_the_checked_tables_are_there() -> None:
    """The check has work to do: the cost, cold and memory-limit tables are checked against their
    reports, and the one unreported table is the one tests/test_simulate_pages.py reads."""
    found = measured_tables(RESULTS.read_text())
    checked = {r for t in found for r in t.reports}
    assert {"bench-qwen3moe-tiny.json", "cold-qwen3moe-tiny.json", "memory-room-w21504-q4_k_m.json"} <= checked
    limits = [t for t in found if t.reports == ["read-path-limits.json"]]  # the plot-drives one
    assert len(limits) == 1 and len(limits[0].rows) >= 30
    assert sum(len(t.rows) for t in found if t.reports) >= 100
    assert [t.heading for t in found if not t.reports] == sorted(UNREPORTED)


def first_figure(text: str, report: str) -> tuple[str, str]:
    """(the first row of the first table linking report, its tok/s cell), for the controls."""
    t = next(t for t in tables(text) if report in t.reports)
    row = text.splitlines()[t.line + 1]
    column = PREFILL_COLUMN if PREFILL_COLUMN in t.columns else MEASURED_COLUMN
    return row, cells(row)[t.columns.index(column)]


@pytest.mark.parametrize(
    "report", ["bench-qwen4exp-tiny.json", "memory-room-w63488-q4_k_m.json", "prefill-w63488.json"]
)
def test_an_edited_figure_fails(report: str) -> None:
    """Negative control: one figure changed in the docs is found, and only that one."""
    text = RESULTS.read_text()
    row, figure = first_figure(text, report)
    bumped = f"{float(figure) + 0.1:.{len(figure.split('.')[1])}f}"
    edited = text.replace(row, row.replace(f"| {figure} |", f"| {bumped} |", 1), 1)
    assert edited != text
    problems = check(edited)
    assert len(problems) == 1 and f"docs {bumped}" in problems[0], problems


def test_an_edited_turns_figure_fails() -> None:
    """Negative control for a server turns table: one figure changed in the docs is found, and only it."""
    text = RESULTS.read_text()
    table = next(t for t in tables(text) if t.reports == ["server-turns-w21504.json"])
    assert turns_mismatches(table, json.loads((MEASURED / table.reports[0]).read_text())) == []
    row = text.splitlines()[table.line + 1]
    figure = cells(row)[2]
    edited = text.replace(row, row.replace(f"| {figure} |", f"| {float(figure) + 0.01:.2f} |", 1), 1)
    problems = check(edited)
    assert len(problems) == 1 and "decode tok/s: docs" in problems[0], problems


def test_an_edited_report_fails() -> None:
    """Negative control: one figure changed in (a copy of) a report is found, and only that one."""
    text = RESULTS.read_text()
    table = next(t for t in tables(text) if t.reports == ["memory-room-w21504-q4_k_m.json"])
    report = json.loads((MEASURED / table.reports[0]).read_text())
    assert mismatches(table, report) == []
    report["rows"][5]["read_mib_per_token"] += 0.01
    problems = mismatches(table, report)
    assert len(problems) == 1 and "MiB read/token" in problems[0], problems


def test_a_table_without_its_report_fails() -> None:
    text = RESULTS.read_text().replace("](measured/cold-qwen4exp-tiny.json)", "](measured/elsewhere.txt)")
    assert any("links no measured/*.json" in p for p in check(text))


def test_check_reads_the_docs_precision() -> None:
    """The docs print a report's figure at their own precision, the unit after it; '-' is none."""
    assert expected(2546.226645224083, "2546.2", "") == "2546.2"
    assert expected(0.98626, "0.986", "") == "0.986"
    assert expected(12.61, "12.6%", "%") == "12.6%"
    assert expected(None, "-", "") == "-"
    assert expected(0, "0", "") == "0"


# --- the links into results.md ---------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    fenced, out = False, []
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("#"):
            out.append(slug(line.lstrip("#")))
    assert len(out) == len(set(out)), "two headings of results.md share an anchor"
    return set(out)


def test_slug_is_githubs() -> None:
    assert slug("The consumer's op on the compute path") == "the-consumers-op-on-the-compute-path"
    assert slug("How good are the predictions (hit rates) on trained models?") == (
        "how-good-are-the-predictions-hit-rates-on-trained-models"
    )
    assert slug("At read_ahead_kb 128: the drive's readahead decides the result") == (
        "at-read_ahead_kb-128-the-drives-readahead-decides-the-result"
    )


def test_links_into_results_md_resolve() -> None:
    known = anchors(RESULTS.read_text())
    links = [("docs/results.md", a) for a in re.findall(r"\]\(#([\w-]+)\)", RESULTS.read_text())]
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        links += [(doc.name, a) for a in re.findall(r"results\.md#([\w-]+)", doc.read_text())]
    assert len(links) > 20
    assert [(doc, a) for doc, a in links if a not in known] == []
