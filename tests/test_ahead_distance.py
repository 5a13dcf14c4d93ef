"""Trace version 3: the lookahead distance at record offset 18, read, bounded and scored per distance.

A PREDICTED record of layer l was predicted K layers ahead, from layer l-K's graph
(ONEBIT_MOE_PREDICT_AHEAD=K, 1..3); versions 1 and 2 always predicted one layer ahead and left
the field zero. docs/trace-format.md, "Records" and "Bounds a reader enforces".
"""

from __future__ import annotations

import csv
import io
import json
import math
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import pytest

from onebit_predict.commands.stats import main
from onebit_predict.constants import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, TRACE_FLAG_DECODE, TRACE_FLAG_PREDICTED
from onebit_predict.metrics.stats import compute_stats
from onebit_predict.metrics.stats_kernel import StatsKernel
from onebit_predict.trace import Trace, TraceError, TraceHeader, record_dtype
from onebit_predict.trace_writer import TraceWriter

PRED_DECODE = TRACE_FLAG_PREDICTED | TRACE_FLAG_DECODE


def write_ahead(path: Path, header: TraceHeader, rows: Iterable[Mapping[str, object]]) -> Path:
    """A trace of ``rows`` (TraceWriter.add keywords, plus ``distance``: the raw u16 at offset 18,
    default 0), written by TraceWriter and then given each row's distance in place."""
    rows = [dict(row) for row in rows]
    distances = [int(row.pop("distance", 0)) for row in rows]
    with TraceWriter(path, header) as w:
        for row in rows:
            w.add(**row)
    if rows:
        rec = np.memmap(path, dtype=header.dtype, mode="r+", offset=512, shape=(len(rows),))
        rec["distance"] = distances
        rec.flush()
        del rec
    return path


def v3(**kw) -> TraceHeader:
    return TraceHeader.build(version=3, **kw)


# --- reading the field -------------------------------------------------------------------


def doc_record(layer: int, flags: int, distance: int, pred: list[int]) -> bytes:
    """One record (top-2, depth 3) packed from the table in docs/trace-format.md, not by the reader."""
    n_read = 3 if flags & TRACE_FLAG_PREDICTED else 0
    logits = [1.0, 0.5, 0.0] if flags & TRACE_FLAG_PREDICTED else [math.nan] * 3
    return struct.pack("<IiiHHHH", 7, 0, 12, layer, n_read, flags, distance) + struct.pack(
        "<2i2f3i3f", 1, 2, 0.5, 0.5, *pred, *logits
    )


def doc_trace(path: Path, version: int, records: list[bytes]) -> Path:
    h = TraceHeader.build(n_layer=4, n_expert=8, n_expert_used=2, depth=3, layers={1, 2, 3}, version=version)
    path.write_bytes(h.to_bytes() + b"".join(records))
    return path


def test_version_3_records_carry_their_distance(tmp_path):
    path = doc_trace(
        tmp_path / "t",
        3,
        [
            doc_record(layer=2, flags=PRED_DECODE, distance=2, pred=[1, 2, 3]),
            doc_record(layer=0, flags=TRACE_FLAG_DECODE, distance=0, pred=[-1, -1, -1]),
            doc_record(layer=3, flags=TRACE_FLAG_PREDICTED, distance=3, pred=[2, 1, 0]),
        ],
    )
    t = Trace.open(path)
    assert t.header.version == 3 and t.header.has_distance
    assert record_dtype(2, 3).fields["distance"][1] == 18  # offset 18, u16
    assert t.records["distance"].tolist() == [2, 0, 3]
    assert t.distance().tolist() == [2, 0, 3] and t.distance(1, 3).tolist() == [0, 3]
    assert np.concatenate(list(t.iter_chunks(2)))["distance"].tolist() == [2, 0, 3]


@pytest.mark.parametrize("version", [1, 2])
def test_versions_1_and_2_predict_one_layer_ahead(tmp_path, version):
    # offset 18 is reserved there: zero, and not read even when it is not
    path = doc_trace(
        tmp_path / "t",
        version,
        [
            doc_record(layer=1, flags=PRED_DECODE, distance=0, pred=[1, 2, 3]),
            doc_record(layer=0, flags=TRACE_FLAG_DECODE, distance=0, pred=[-1, -1, -1]),
            doc_record(layer=2, flags=TRACE_FLAG_PREDICTED, distance=9, pred=[2, 1, 0]),
        ],
    )
    t = Trace.open(path)
    assert not t.header.has_distance
    assert t.records["distance"].tolist() == [0, 0, 9]  # the file's bytes
    assert t.distance().tolist() == [1, 0, 1]  # what they mean
    assert np.concatenate(list(t.iter_chunks(1)))["distance"].tolist() == [1, 0, 1]
    st = compute_stats(t, engine="numpy")
    assert st.distances == (1,) and set(st.by_distance) == {0, 1}


def test_version_2_trace_of_the_writer_reads_as_distance_1(tmp_path, write_trace):
    h = TraceHeader.build(n_layer=3, n_expert=4, n_expert_used=1, depth=2, version=2)
    rows = [
        dict(step=0, seq_id=0, pos=0, layer=1, actual=[0], pred=[0, 1]),
        dict(step=0, seq_id=0, pos=0, layer=0, actual=[1]),
    ]
    t = Trace.open(write_trace(tmp_path / "t", h, rows))
    assert t.header.version == 2 and t.distance().tolist() == [1, 0]


# --- bounds: a malformed distance is a bad trace (exit 2) ---------------------------------

BAD = [
    # (layer, flags, distance, message)
    (2, PRED_DECODE, 0, "distance 0 is not in 1..3"),
    (3, PRED_DECODE, 4, "distance 4 is not in 1..3"),
    (3, PRED_DECODE, 0xFFFF, "distance 65535 is not in 1..3"),
    (2, TRACE_FLAG_DECODE, 1, "distance 1 on a record without PREDICTED (must be 0)"),
    (1, PRED_DECODE, 2, "distance 2 exceeds the record's layer 1"),
    (0, TRACE_FLAG_PREDICTED, 1, "distance 1 exceeds the record's layer 0"),
]


def bad_trace(path: Path, layer: int, flags: int, distance: int) -> Path:
    """A valid version-3 trace of 3 records whose second is the bad one."""
    pred = [1, 2, 3] if flags & TRACE_FLAG_PREDICTED else [-1, -1, -1]
    return doc_trace(
        path,
        3,
        [
            doc_record(layer=2, flags=PRED_DECODE, distance=1, pred=[1, 2, 3]),
            doc_record(layer=layer, flags=flags, distance=distance, pred=pred),
            doc_record(layer=0, flags=TRACE_FLAG_DECODE, distance=0, pred=[-1, -1, -1]),
        ],
    )


@pytest.mark.parametrize("layer, flags, distance, message", BAD, ids=[m for *_, m in BAD])
def test_bad_distance_is_a_trace_error(tmp_path, layer, flags, distance, message):
    t = Trace.open(bad_trace(tmp_path / "t", layer, flags, distance))  # the header is fine
    with pytest.raises(TraceError, match="bad trace record 1 .*" + message.replace("(", r"\(").replace(")", r"\)")):
        t.distance()
    with pytest.raises(TraceError, match=f"{t.path}: bad trace record 1 "):
        list(t.iter_chunks())
    with pytest.raises(TraceError, match="bad trace record 1 "):
        t.distance(1, 2)
    assert t.distance(0, 1).tolist() == [1]


@pytest.mark.parametrize("args", [[], ["--engine", "numpy"], ["--json"], ["--csv"]])
@pytest.mark.parametrize("layer, flags, distance, message", BAD, ids=[m for *_, m in BAD])
def test_bad_distance_exits_2_without_a_traceback(tmp_path, run_cli, layer, flags, distance, message, args):
    path = bad_trace(tmp_path / "t", layer, flags, distance)
    rc, out, err = run_cli(main, path, *args)
    assert rc == EXIT_USAGE and out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"onebit-stats: ERROR: {path}: bad trace record 1 "), err
    assert message in lines[0]


@pytest.mark.parametrize(
    "sub", [["replay", "--slots", "2"], ["simulate", "--expert-bytes", "1m", "--bandwidth", "1GB/s", "--layer-ms", "1"]]
)
def test_bad_distance_exits_2_in_replay_and_simulate(tmp_path, run_cli, sub):
    path = bad_trace(tmp_path / "t", 2, PRED_DECODE, 0)
    rc, out, err = run_cli(main, sub[0], path, *sub[1:])
    assert rc == EXIT_USAGE and out == ""
    assert "bad trace record 1 " in err and "distance 0 is not in 1..3" in err


def test_the_kernel_refuses_a_bad_distance_it_is_fed(tmp_path):
    # onebit-stats never feeds it one (iter_chunks refuses first): its own guard, not a crash
    t = Trace.open(bad_trace(tmp_path / "t", 3, PRED_DECODE, 4))
    predictable = np.zeros(1 << 16, dtype=bool)
    kernel = StatsKernel(t.header, predictable)
    with pytest.raises(TraceError, match="distance is out of its bounds"):
        kernel.feed(np.ascontiguousarray(t.records))


# --- scored per distance --------------------------------------------------------------------

# One sequence, four decode steps (pos 0..3), 4 layers, 4 experts, top-1, depth 2, no gate, and
# the predictor two layers ahead (K=2): layers 2 and 3 predicted (from 0 and 1), 0 and 1 never.
ACTUAL = {0: [[0], [1], [2], [3]], 1: [[0], [1], [1], [2]], 2: [[3], [3], [3], [0]], 3: [[1], [2], [2], [2]]}
PRED_K2 = {2: [[3, 0], [3, 0], [0, 3], [1, 2]], 3: [[1, 0], [2, 1], [2, 0], [2, 3]]}
# layer 2, pos 1..3: A {3} P 3,0 top-1 | A {3} P 0,3 depth | A {0} P 1,2 miss
#   slot@1 33.3 slot@2 66.7 read 66.7 prec 2/6 33.3 waste 2.00 exact 33.3 mass 66.7 read 6 gated 0
#   baseline {3}v{3} {3}v{3} {0}v{3}: 2/3 66.7
# layer 3, pos 1..3: every top-1 right: 100, prec 3/6 50.0, waste 1.00; baseline {2}v{1} {2}v{2} {2}v{2}: 66.7
# layer 0 baseline 0/3 0.0; layer 1 baseline {1}v{0} {1}v{1} {2}v{1}: 1/3 33.3 (not predicted)
# total (layers 2, 3): 6 tokens, slot@1 4/6 66.7, slot@2 5/6 83.3, read 83.3, prec 5/12 41.7,
#   waste 7/5 1.40, exact 66.7, mass 83.3, read 12, gated 0, baseline 4/6 66.7
PRED_K1 = {1: [[0, 1], [1, 0], [0, 1], [3, 0]], **PRED_K2}  # the same, one layer ahead, and layer 1 too


def ahead_rows(seq: int, k: int, pred: dict[int, list[list[int]]]) -> list[dict]:
    return [
        dict(
            step=pos,
            seq_id=seq,
            pos=pos,
            layer=layer,
            actual=ACTUAL[layer][pos],
            pred=pred[layer][pos] if layer in pred else None,
            distance=k if layer in pred else 0,
        )
        for pos in range(4)
        for layer in range(4)
    ]


def header(layers: set[int], version: int = 3) -> TraceHeader:
    return TraceHeader.build(
        n_layer=4, n_expert=4, n_expert_used=1, depth=2, layers=layers, arch="qwen3moe", model="tiny", version=version
    )


@pytest.fixture
def k2(tmp_path) -> Path:
    return write_ahead(tmp_path / "k2.trace", header({2, 3}), ahead_rows(0, 2, PRED_K2))


def table_rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}


@pytest.mark.parametrize("engine", ["c", "numpy"])
def test_stats_of_a_k2_trace(k2, engine):
    st = compute_stats(Trace.open(k2), engine=engine)
    assert st.issues == () and st.distances == (2,)
    assert sorted(st.by_distance) == [0, 2]
    assert sorted(st.by_distance[0]) == [0, 1] and sorted(st.by_distance[2]) == [2, 3]
    assert st.layer_distances(1) == () and st.layer_distances(2) == (2,)
    l2 = st.by_distance[2][2]
    assert (l2.tokens, l2.hits_used, l2.hits_depth, l2.read, l2.base_tokens, l2.base_hits) == (3, 1, 2, 6, 3, 2)
    assert st.by_distance[2][2] == st.layers[2] and st.by_distance[0][1] == st.layers[1]
    t2 = st.total_at(2)
    assert (t2.tokens, t2.hits_used, t2.hits_read, t2.base_tokens, t2.base_hits) == (6, 4, 5, 6, 4)
    assert t2.records == 8 and st.total.records == 16
    assert st.total_at(1) == st.total_at(3) == type(t2)()  # nothing that far ahead


def test_table_of_a_k2_trace(k2, run_cli):
    rc, out, err = run_cli(main, k2)
    assert rc == EXIT_OK and err == ""
    assert "| n_expert 4 | n_used 1 | ahead L+2\n" in out
    rows = table_rows(out)
    assert rows["layer"][:2] == ["tokens", "slot@1%"]  # one distance: no ahead column
    assert rows["0"] == ["0"] + ["-"] * 9 + ["3", "0.0"]
    assert rows["1"] == ["0"] + ["-"] * 9 + ["3", "33.3"]  # never predicted two layers ahead
    assert rows["2"] == ["3", "33.3", "66.7", "66.7", "33.3", "2.00", "33.3", "66.7", "6", "0", "3", "66.7"]
    assert rows["3"] == ["3", "100.0", "100.0", "100.0", "50.0", "1.00", "100.0", "100.0", "6", "0", "3", "66.7"]
    assert rows["total"] == ["6", "66.7", "83.3", "83.3", "41.7", "1.40", "66.7", "83.3", "12", "0", "6", "66.7"]


def test_layers_option_keeps_the_distance_in_the_summary(k2, run_cli):
    rc, out, _ = run_cli(main, k2, "--layers", "0-1")
    assert rc == EXIT_OK and "| ahead L+2\n" in out
    assert table_rows(out)["total"] == ["0"] + ["-"] * 9 + ["0", "-"]  # no predicted layer selected


def test_json_and_csv_of_a_k2_trace(k2, run_cli):
    rc, out, _ = run_cli(main, k2, "--json")
    assert rc == EXIT_OK
    (t,) = json.loads(out)["traces"]
    assert t["header"]["version"] == 3 and t["distances"] == [2]
    assert [(x["layer"], x["distance"], x["predicted"]) for x in t["layers"]] == [
        (0, None, False),
        (1, None, False),
        (2, 2, True),
        (3, 2, True),
    ]
    assert t["total"]["distance"] == 2 and t["total"]["slot_recall_used"] == pytest.approx(4 / 6)
    (total,) = t["totals"]
    assert total["distance"] == 2 and total["tokens"] == 6 and total["baseline_recall"] == pytest.approx(4 / 6)
    rc, out, _ = run_cli(main, k2, "--csv")
    assert rc == EXIT_OK
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [(r["layer"], r["distance"]) for r in rows] == [("0", ""), ("1", ""), ("2", "2"), ("3", "2"), ("total", "2")]
    assert float(rows[4]["read_recall"]) == pytest.approx(5 / 6)


def test_a_k2_trace_whose_mask_has_layer_1_is_inconsistent(tmp_path, run_cli):
    path = write_ahead(tmp_path / "t", header({1, 2, 3}), ahead_rows(0, 2, PRED_K2))
    rc, out, err = run_cli(main, path)
    assert rc == EXIT_CHECK_FAILED
    assert "the header's layer mask includes layers [1], which have no layer 2 before them" in err
    assert "total" in out


# Two sequences in one trace (a concatenation): seq 0 predicted two layers ahead (layers 2, 3),
# seq 1 one layer ahead (layers 1..3), the same routing and predictions. Per (layer, distance):
#   layer 1: L+1 (seq 1) as layer 1 of test_cli_stats: slot@1 1/3, read 2/3, baseline 1/3;
#            unpredicted (seq 0): baseline 1/3
#   layers 2, 3: L+1 (seq 1) and L+2 (seq 0) each as layer 2, 3 above
#   total L+1: 9 tokens, slot@1 (1+1+3)/9 55.6, baseline (1+2+2)/9 55.6
#   total L+2: as the K=2 trace's; total all (mask 1..3): 15 tokens, baseline 10/18 55.6
@pytest.fixture
def mixed(tmp_path) -> Path:
    rows = sorted(
        ahead_rows(0, 2, PRED_K2) + ahead_rows(1, 1, PRED_K1), key=lambda r: (r["step"], r["layer"], r["seq_id"])
    )
    return write_ahead(tmp_path / "mixed.trace", header({1, 2, 3}), rows)


@pytest.mark.parametrize("engine", ["c", "numpy"])
def test_stats_per_distance_of_a_mixed_trace(mixed, engine):
    st = compute_stats(Trace.open(mixed), engine=engine)
    assert st.issues == () and st.distances == (1, 2)
    assert {k: sorted(g) for k, g in st.by_distance.items()} == {0: [0, 1], 1: [1, 2, 3], 2: [2, 3]}
    assert st.layer_distances(2) == (1, 2) and st.layer_distances(1) == (1,)
    for layer, c in st.layers.items():  # the groups add up to the layer
        assert sum((g[layer] for g in st.by_distance.values() if layer in g), type(c)()) == c
    assert st.by_distance[1][2] == st.by_distance[2][2]  # same routing and predictions, other distance
    t1, t2 = st.total_at(1), st.total_at(2)
    assert (t1.tokens, t1.hits_used, t1.base_tokens, t1.base_hits) == (9, 5, 9, 5)
    assert (t2.tokens, t2.hits_used, t2.base_tokens, t2.base_hits) == (6, 4, 6, 4)
    assert (st.total.tokens, st.total.base_tokens, st.total.base_hits) == (15, 18, 10)
    picked = st.select([2])
    assert picked.distances == (1, 2) and list(picked.by_distance) == [1, 2]
    assert compute_stats(Trace.open(mixed), 5, engine=engine) == st  # chunked: the same


def test_table_of_a_mixed_trace_has_an_ahead_column(mixed, run_cli):
    rc, out, err = run_cli(main, mixed)
    assert rc == EXIT_OK and err == ""
    assert "| ahead L+1,L+2\n" in out
    lines = [line.split() for line in out.splitlines()[3:] if line.strip()]
    assert lines[0][:4] == ["layer", "ahead", "tokens", "slot@1%"]
    got = [(row[0], row[1], row[2], row[3], row[-1]) for row in lines[1:]]  # layer, ahead, tokens, slot@1, base%
    assert got == [
        ("0", "-", "0", "-", "0.0"),
        ("1", "-", "0", "-", "33.3"),
        ("1", "L+1", "3", "33.3", "33.3"),
        ("2", "L+1", "3", "33.3", "66.7"),
        ("2", "L+2", "3", "33.3", "66.7"),
        ("3", "L+1", "3", "100.0", "66.7"),
        ("3", "L+2", "3", "100.0", "66.7"),
        ("total", "L+1", "9", "55.6", "55.6"),
        ("total", "L+2", "6", "66.7", "66.7"),
        ("total", "all", "15", "60.0", "55.6"),
    ]


def test_json_and_csv_of_a_mixed_trace(mixed, run_cli):
    rc, out, _ = run_cli(main, mixed, "--json")
    assert rc == EXIT_OK
    (t,) = json.loads(out)["traces"]
    assert t["distances"] == [1, 2]
    pairs = [(x["layer"], x["distance"]) for x in t["layers"]]
    assert pairs == [(0, None), (1, None), (1, 1), (2, 1), (2, 2), (3, 1), (3, 2)]
    assert [(x["distance"], x["tokens"]) for x in t["totals"]] == [(1, 9), (2, 6)]
    assert t["total"]["distance"] is None and t["total"]["tokens"] == 15
    rc, out, _ = run_cli(main, mixed, "--csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [(r["layer"], r["distance"]) for r in rows][-3:] == [("total", "1"), ("total", "2"), ("total", "")]


def test_side_by_side_at_two_distances_shows_each_baseline(tmp_path, k2, run_cli):
    # the same tokens predicted one layer ahead (a version-2 trace): its total covers layer 1 too
    k1 = write_ahead(tmp_path / "k1.trace", header({1, 2, 3}, version=2), ahead_rows(0, 0, PRED_K1))
    rc, out, err = run_cli(main, k1, k2)
    assert rc == EXIT_OK and err == ""
    assert f"[1] {k1}" in out and f"[2] {k2}" in out and "ahead L+1\n" in out and "ahead L+2\n" in out
    rows = table_rows(out)
    assert rows["layer"] == ["read%[1]", "slot@1%[1]", "base%[1]", "read%[2]", "slot@1%[2]", "base%[2]"]
    assert rows["1"] == ["66.7", "33.3", "33.3", "-", "-", "33.3"]
    assert rows["2"] == ["66.7", "33.3", "66.7", "66.7", "33.3", "66.7"]
    assert rows["total"] == ["77.8", "55.6", "55.6", "83.3", "66.7", "66.7"]
