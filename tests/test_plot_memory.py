"""onebit-stats plot-memory: the table of expert size x memory limit x configuration from
onebit-bench --memory-limit reports, its --json/--csv, the PNG, and exit 2 without matplotlib
or on a report that is not a memory one.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from onebit_predict.commands.stats import main as stats_main
from onebit_predict.constants import EXIT_OK, EXIT_USAGE

MIB = 2**20


def report(path: Path, expert_mib: int, rows: list[tuple[int, str, float]], model: str = "m.gguf") -> Path:
    """A memory report: rows of (limit MiB, 0 for resident; configuration; tok/s)."""
    data = {
        "model": model,
        "rounds": 1,
        "prompt": 16,
        "generate": 16,
        "threads": 2,
        "expert_bytes": expert_mib * MIB,
        "drive": {"bandwidth_mb_s": 1000.0, "page_read_us": 50.0},
        "memory_limits": sorted({lim * MIB for lim, _, _ in rows}),
        "rows": [
            {
                "limit_bytes": lim * MIB,
                "name": name,
                "median_tok_s": tok,
                "min_tok_s": tok * 0.9,
                "max_tok_s": tok * 1.1,
                "read_mib_per_token": 10.0,
                "major_faults_per_token": 2.0,
            }
            for lim, name, tok in rows
        ],
    }
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def reports(tmp_path):
    small = report(
        tmp_path / "small.json",
        347,
        [(174, "patched off", 2.0), (174, "block + advise", 3.0)]
        + [(87, "patched off", 1.5), (87, "block + advise", 1.2)],
        "small.gguf",
    )
    big = report(
        tmp_path / "big.json",
        694,
        [(0, "patched off", 20.0), (347, "patched off", 1.0), (347, "block + advise", 2.0)],
        "big.gguf",
    )
    return big, small  # given out of order: the table sorts by expert size


def run(capsys, *args):
    rc = stats_main(["plot-memory", *(str(a) for a in args)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def test_table_rows(capsys, reports):
    rc, out, _ = run(capsys, *reports)
    assert rc == EXIT_OK
    lines = out.splitlines()
    assert lines[0].startswith("| expert size | limit MiB | limit % of experts | configuration")
    body = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    # expert size ascending; within one, resident first, then the limits descending; the report's order
    assert [(r[0], r[1], r[2], r[3], r[4], r[7]) for r in body] == [
        ("347 MiB of experts", "174", "50", "patched off", "2.00", "1.000"),
        ("347 MiB of experts", "174", "50", "block + advise", "3.00", "1.500"),
        ("347 MiB of experts", "87", "25", "patched off", "1.50", "1.000"),
        ("347 MiB of experts", "87", "25", "block + advise", "1.20", "0.800"),
        ("694 MiB of experts", "resident", "-", "patched off", "20.00", "1.000"),
        ("694 MiB of experts", "347", "50", "patched off", "1.00", "1.000"),
        ("694 MiB of experts", "347", "50", "block + advise", "2.00", "2.000"),
    ]


def test_json_and_csv(capsys, reports):
    rc, out, _ = run(capsys, *reports, "--json")
    assert rc == EXIT_OK
    rows = json.loads(out)["rows"]
    assert len(rows) == 7 and rows[0]["expert_bytes_total"] == 347 * MIB and rows[4]["limit"] == "resident"
    assert rows[1]["ratio_to_off"] == pytest.approx(1.5)
    assert rows[3]["limit_pct_of_experts"] == pytest.approx(100 * 87 / 347)
    rc, out, _ = run(capsys, *reports, "--csv")
    table = list(csv.DictReader(io.StringIO(out)))
    assert [r["configuration"] for r in table][:2] == ["patched off", "block + advise"]
    assert table[4]["limit_pct_of_experts"] == ""


def test_png(capsys, reports, tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "memory.png"
    rc, out, err = run(capsys, *reports, "--png", png)
    assert rc == EXIT_OK and f"wrote {png}" in err and out.startswith("| expert size")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_matplotlib_exits_2(capsys, reports, tmp_path, no_matplotlib):
    rc, out, err = run(capsys, *reports, "--png", tmp_path / "x.png")
    assert rc == EXIT_USAGE and out == ""
    assert "--png needs matplotlib" in err and "onebit-predict[plot]" in err
    assert not (tmp_path / "x.png").exists()


def test_not_a_memory_report_exits_2(capsys, reports, tmp_path):
    cold = tmp_path / "cold.json"
    cold.write_text(json.dumps({"cold": True, "rows": [{"name": "patched off", "median_tok_s": 30.0}]}))
    rc, out, err = run(capsys, reports[0], cold)
    assert rc == EXIT_USAGE and out == "" and "not onebit-bench --memory-limit reports" in err
    rc, _, err = run(capsys, tmp_path / "missing.json")
    assert rc == EXIT_USAGE
