"""tools/bench_stats.py, run as the script it is: its report has both passes, --keep reuses the
trace, bad arguments exit 2. The synthetic trace it measures is onebit_predict/synth.py's
(tests/test_synth.py).

Only the shape of the report is asserted: timings, ratios and memory are measured by the
benchmark, never judged by a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onebit_predict.constants import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, TRACE_HEADER_SIZE
from onebit_predict.synth import synth_header

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "bench_stats.py"


def run_tool(*args: object) -> subprocess.CompletedProcess:
    """``python tools/bench_stats.py ARGS``, with this checkout's package first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(
        [sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, env=env, timeout=600
    )


def bench(*args: object) -> tuple[int, dict]:
    """(exit code, the --json report) of one run of the benchmark."""
    p = run_tool(*args)
    assert p.returncode in (EXIT_OK, EXIT_CHECK_FAILED) and "Traceback" not in p.stderr, p.stderr
    return p.returncode, json.loads(p.stdout)


def test_bench_reports_both_passes(tmp_path):
    path = tmp_path / "bench.trace"
    rc, report = bench("--size-mib", "8", "--rounds", "1", "--trace", path, "--json")
    assert rc in (EXIT_OK, EXIT_CHECK_FAILED)  # whether the goals hold is the benchmark's business
    assert [r["name"] for r in report["rows"]] == ["(a) onebit-stats --json", "(b) numpy memmap pass"]
    for r in report["rows"]:
        assert len(r["wall_s"]) == 1 and r["median_wall_s"] > 0
        assert r["peak_rss_mib"] > 0 and r["median_cpu_s"] >= 0
    assert report["ratio"] > 0 and report["trace"]["records"] > 0 and not report["trace"]["reused"]
    assert set(report["goals"]) >= {"ratio_ok", "rss_ok", "ok"}
    assert not path.exists()  # deleted without --keep


def test_bench_with_the_numpy_engine(tmp_path):
    rc, report = bench(
        "--size-mib", "4", "--rounds", "1", "--trace", tmp_path / "t.trace", "--json", "--with-numpy-engine"
    )
    assert rc in (EXIT_OK, EXIT_CHECK_FAILED)
    assert [r["name"] for r in report["rows"]] == [
        "(a) onebit-stats --json",
        "(b) numpy memmap pass",
        "(c) numpy engine",
    ]
    assert report["rows"][2]["median_wall_s"] > 0 and report["kernel_build_s"] >= 0
    assert report["ratio"] == pytest.approx(
        report["rows"][0]["median_wall_s"] / report["rows"][1]["median_wall_s"], rel=1e-2
    )


def test_bench_keep_reuses_the_trace(tmp_path):
    path = tmp_path / "kept.trace"
    argv = ["--size-mib", "4", "--rounds", "1", "--trace", path, "--keep", "--json"]
    rc, first = bench(*argv)
    assert rc in (EXIT_OK, EXIT_CHECK_FAILED)
    assert path.exists() and not first["trace"]["reused"]
    assert path.read_bytes()[:TRACE_HEADER_SIZE] == synth_header(0).to_bytes()  # the package's synthetic trace
    rc, again = bench(*argv)
    assert rc in (EXIT_OK, EXIT_CHECK_FAILED) and again["trace"]["reused"]
    # another size: the file is ours, so it is rewritten
    rc, other = bench(*argv[:1], "5", *argv[2:])
    assert rc in (EXIT_OK, EXIT_CHECK_FAILED) and not other["trace"]["reused"]


@pytest.mark.parametrize(
    "args, said",
    [
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--size-mib", "0"], "--size-mib must be a positive number"),
        (["--size-mib", "nan"], "--size-mib must be a positive number"),
        (["--size-mib", "1"], "whole ubatches"),  # not even the first ubatch
        (["--bogus"], "unrecognized arguments"),
        (["--trace", "{tmp}/no/dir.trace"], "is not a directory"),
        (["--trace", "{other}", "--size-mib", "4"], "pass --keep"),  # exists, no --keep
        (["--trace", "{other}", "--size-mib", "4", "--keep"], "not a synthetic trace"),  # not ours
    ],
)
def test_bench_usage(tmp_path, args, said):
    other = tmp_path / "other.trace"
    other.write_bytes(b"not a trace")
    p = run_tool(*(a.format(tmp=tmp_path, other=other) for a in args))
    assert p.returncode == EXIT_USAGE and said in p.stderr and p.stdout == "", p.stderr
    assert other.read_bytes() == b"not a trace"
