"""tools/bench_stats.py: its synthetic trace is a valid, consistent trace; its report has both passes.

Only the shape of the report is asserted: timings, ratios and memory are measured by the
benchmark, never judged by a test.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from onebit_predict.constants import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, TRACE_FLAG_DECODE, TRACE_FLAG_PREDICTED
from onebit_predict.metrics.stats import compute_stats
from onebit_predict.trace import Trace

TOOL = Path(__file__).resolve().parent.parent / "tools" / "bench_stats.py"


@pytest.fixture(scope="module")
def bench_stats():
    spec = importlib.util.spec_from_file_location("bench_stats", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def check_layout(trace: Trace) -> None:
    """What docs/trace-format.md promises beyond what the stats' consistency control checks."""
    h, rec = trace.header, trace.records
    step, seq, pos, layer, flags = (
        np.asarray(rec[k]).astype(np.int64) for k in ("step", "seq_id", "pos", "layer", "flags")
    )
    assert (np.diff(step) >= 0).all() and step[0] == 0  # steps ascending
    assert ((np.diff(layer) >= 0) | (np.diff(step) > 0)).all()  # layer-major within a step
    assert (((flags & TRACE_FLAG_PREDICTED) != 0) == (layer >= 1)).all()  # predicted on layers >= 1
    assert (rec["distance"] == np.where((flags & TRACE_FLAG_PREDICTED) != 0, 1, 0)).all()  # L+1
    for s in np.unique(step):
        at = step == s
        rows = layer[at] == 0
        row_seq, row_pos = seq[at][rows], pos[at][rows]
        # every layer but the last has every row of the step, in the same ubatch order
        for il in range(h.n_layer - 1):
            assert (seq[at][layer[at] == il] == row_seq).all() and (pos[at][layer[at] == il] == row_pos).all()
        # the last layer: only output rows (one per sequence of the step, its last row)
        last = (seq[at][layer[at] == h.n_layer - 1], pos[at][layer[at] == h.n_layer - 1])
        assert sorted(zip(*last)) == sorted((q, row_pos[row_seq == q].max()) for q in np.unique(row_seq))
        # DECODE: the row's sequence has exactly one token in the ubatch
        counts = {q: int((row_seq == q).sum()) for q in np.unique(row_seq)}
        decode = (flags[at][rows] & TRACE_FLAG_DECODE) != 0
        assert (decode == np.array([counts[q] == 1 for q in row_seq])).all()
    # per sequence (layer 0 has every row): pos goes up by one, or restarts at 0 with a prompt
    for q in np.unique(seq):
        p = pos[(seq == q) & (layer == 0)]
        d = np.diff(p)
        assert ((d == 1) | (p[1:] == 0)).all()


def test_synthetic_trace_is_consistent(bench_stats, tmp_path):
    path = tmp_path / "small.trace"
    n_steps, n_records = bench_stats.write_trace(path, 4 << 20, seed=3)
    assert path.stat().st_size == bench_stats.expected_size(4 << 20, 3) <= 4 << 20
    trace = Trace.open(path)
    assert trace.n_records == n_records and trace.dropped_bytes == 0
    h = trace.header
    assert (h.n_layer, h.n_expert, h.n_expert_used, h.depth, h.mode_name) == (48, 128, 8, 16, "router")
    assert h.margin == float("inf") and h.layer_mask == frozenset(range(1, 48))
    st = compute_stats(trace)
    assert st.issues == ()
    total = st.total.metrics()
    assert total["tokens"] > 0 and total["read_recall"] is not None and total["baseline_recall"] is not None
    check_layout(trace)


def test_synthetic_trace_with_restarts(bench_stats, tmp_path, monkeypatch):
    # short sequences, so that slots restart (seq_id reused, pos back to 0) within a small trace
    monkeypatch.setattr(bench_stats, "GENERATE", (3, 12))
    monkeypatch.setattr(bench_stats, "PROMPT", (2, 9))
    path = tmp_path / "restarts.trace"
    bench_stats.write_trace(path, 1 << 20, seed=1)
    trace = Trace.open(path)
    assert compute_stats(trace).issues == ()
    check_layout(trace)
    pos0 = trace.records["pos"][trace.records["layer"] == 0] == 0
    assert pos0.sum() > bench_stats.N_SLOTS  # sequences did restart (first prompts: N_SLOTS)
    # the same seed and size give the same bytes
    again = tmp_path / "again.trace"
    bench_stats.write_trace(again, 1 << 20, seed=1)
    assert again.read_bytes() == path.read_bytes()


def test_bench_reports_both_passes(bench_stats, tmp_path, capsys):
    path = tmp_path / "bench.trace"
    rc = bench_stats.main(["--size-mib", "8", "--rounds", "1", "--trace", str(path), "--json"])
    assert rc in (EXIT_OK, EXIT_CHECK_FAILED)  # whether the goals hold is the benchmark's business
    report = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in report["rows"]] == ["(a) onebit-stats --json", "(b) numpy memmap pass"]
    for r in report["rows"]:
        assert len(r["wall_s"]) == 1 and r["median_wall_s"] > 0
        assert r["peak_rss_mib"] > 0 and r["median_cpu_s"] >= 0
    assert report["ratio"] > 0 and report["trace"]["records"] > 0 and not report["trace"]["reused"]
    assert set(report["goals"]) >= {"ratio_ok", "rss_ok", "ok"}
    assert not path.exists()  # deleted without --keep


def test_bench_with_the_numpy_engine(bench_stats, tmp_path, capsys):
    rc = bench_stats.main(
        ["--size-mib", "4", "--rounds", "1", "--trace", str(tmp_path / "t.trace"), "--json", "--with-numpy-engine"]
    )
    assert rc in (EXIT_OK, EXIT_CHECK_FAILED)
    report = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in report["rows"]] == [
        "(a) onebit-stats --json",
        "(b) numpy memmap pass",
        "(c) numpy engine",
    ]
    assert report["rows"][2]["median_wall_s"] > 0 and report["kernel_build_s"] >= 0
    assert report["ratio"] == pytest.approx(
        report["rows"][0]["median_wall_s"] / report["rows"][1]["median_wall_s"], rel=1e-2
    )


def test_bench_keep_reuses_the_trace(bench_stats, tmp_path, capsys):
    path = tmp_path / "kept.trace"
    argv = ["--size-mib", "4", "--rounds", "1", "--trace", str(path), "--keep", "--json"]
    assert bench_stats.main(argv) in (EXIT_OK, EXIT_CHECK_FAILED)
    first = json.loads(capsys.readouterr().out)
    assert path.exists() and not first["trace"]["reused"]
    assert bench_stats.main(argv) in (EXIT_OK, EXIT_CHECK_FAILED)
    assert json.loads(capsys.readouterr().out)["trace"]["reused"]
    # another size: the file is ours, so it is rewritten
    assert bench_stats.main([*argv[:1], "5", *argv[2:]]) in (EXIT_OK, EXIT_CHECK_FAILED)
    assert not json.loads(capsys.readouterr().out)["trace"]["reused"]


def test_bench_usage(bench_stats, tmp_path, capsys):
    assert bench_stats.main(["--rounds", "0"]) == EXIT_USAGE
    assert bench_stats.main(["--size-mib", "0"]) == EXIT_USAGE
    assert bench_stats.main(["--size-mib", "nan"]) == EXIT_USAGE
    assert bench_stats.main(["--size-mib", "1"]) == EXIT_USAGE  # not even the first ubatch
    assert bench_stats.main(["--bogus"]) == EXIT_USAGE
    assert bench_stats.main(["--trace", str(tmp_path / "no" / "dir.trace")]) == EXIT_USAGE
    other = tmp_path / "other.trace"
    other.write_bytes(b"not a trace")
    assert bench_stats.main(["--trace", str(other), "--size-mib", "4"]) == EXIT_USAGE  # exists, no --keep
    assert bench_stats.main(["--trace", str(other), "--size-mib", "4", "--keep"]) == EXIT_USAGE  # not ours
    assert other.read_bytes() == b"not a trace"
    capsys.readouterr()
