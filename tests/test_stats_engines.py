"""The compiled stats engine (stats_kernel.c) against the numpy engine, the reference.

The hand-made traces of test_stats.py pin the numbers; here both engines must give the same
counts (the two mass sums up to float rounding) and the same control findings on hand-made
and on randomized traces: several sequences interleaved, prefills whose rows are not in pos
order, restarts and gaps, duplicate and out-of-range ids, bad weights and logits, zero and
other margin gates, depth below, at and above n_used, layers beyond n_layer, records out of
order, experts beyond the kernel's lookup tables, and every chunk size.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

from onebit_predict import synth
from onebit_predict.constants import (
    MODE_BLOCK,
    MODE_OFF,
    MODE_ROUTER,
    TRACE_CHUNK_RECORDS,
    TRACE_FLAG_DECODE,
    TRACE_FLAG_PREDICTED,
)
from onebit_predict.metrics import stats_kernel
from onebit_predict.metrics.stats import LayerCounts, TraceStats, compute_stats
from onebit_predict.metrics.stats_kernel import StatsKernelError
from onebit_predict.policy import n_read_rows
from onebit_predict.trace import Trace, TraceHeader
from onebit_predict.trace_writer import TraceWriter
from tests.test_stats import MAIN_HEADER, MAIN_ROWS, r

CHUNKS = (1, 2, 5, 64, TRACE_CHUNK_RECORDS)

# the numpy engine multiplies NaN and infinite weights by 0 (the kernel gets the same NaN)
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered in multiply:RuntimeWarning")


def assert_same_counts(c: dict[int, LayerCounts], ref: dict[int, LayerCounts], where: str) -> None:
    assert list(c) == list(ref), where
    for layer, counts in c.items():
        for f in fields(LayerCounts):
            got, want = getattr(counts, f.name), getattr(ref[layer], f.name)
            if f.name.startswith("mass"):  # summed in another order
                assert got == pytest.approx(want, rel=1e-12, abs=1e-12, nan_ok=True), (where, layer, f.name)
            else:
                assert got == want, (where, layer, f.name)


def assert_same(c: TraceStats, ref: TraceStats) -> None:
    assert c.issues == ref.issues
    assert_same_counts(c.layers, ref.layers, "layers")
    assert list(c.by_distance) == list(ref.by_distance)  # and per lookahead distance
    for k, groups in c.by_distance.items():
        assert_same_counts(groups, ref.by_distance[k], f"distance {k}")


def both(trace: Trace, chunk: int = TRACE_CHUNK_RECORDS) -> TraceStats:
    c = compute_stats(trace, chunk, engine="c")
    assert_same(c, compute_stats(trace, chunk, engine="numpy"))
    return c


# --- hand-made traces ---------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 26, TRACE_CHUNK_RECORDS])
def test_main_trace(tmp_path, chunk, write_trace):
    both(Trace.open(write_trace(tmp_path / "t", MAIN_HEADER, MAIN_ROWS)), chunk)


HAND_MADE = {
    # seq 0 restarted at pos 0, then a gap
    "restarts": (
        TraceHeader.build(n_layer=2, n_expert=8, n_expert_used=1, layers={1}),
        [r(s, 0, p, 1, [a], pred=[a]) for s, (p, a) in enumerate([(0, 1), (1, 1), (0, 2), (5, 3), (6, 4)])],
    ),
    # a duplicate record out of step order: sorted, and never scored twice
    "out_of_order": (
        TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=1, layers=set()),
        [r(0, 0, 0, 1, [0], decode=False), r(1, 0, 1, 1, [0]), r(0, 0, 0, 1, [0], decode=False)],
    ),
    # duplicate actual and predicted ids: exact match is set equality
    "duplicates": (
        TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=2, depth=2),
        [r(0, 0, 0, 1, [0, 1], pred=[0, 1]), r(1, 0, 1, 1, [3, 3], pred=[3, 1]), r(2, 0, 2, 1, [2, 2], pred=[2, 2])],
    ),
    # margin 0: only the leader and its ties are read
    "zero_margin": (
        TraceHeader.build(n_layer=2, n_expert=8, n_expert_used=2, depth=4, margin=0.0, min_read=0),
        [
            r(0, 0, 0, 1, [0, 1], pred=[0, 1, 2, 3], logits=[1, 0, -1, -2], n_read=1),
            r(1, 0, 1, 1, [0, 1], [0.25, 0.75], pred=[2, 0, 1, 3], logits=[3, 2, 1, 0], n_read=1),
            r(2, 0, 2, 1, [4, 5], [0.5, 0.5], pred=[5, 6, 4, 0], logits=[2, 2, 1, 0], n_read=2),
        ],
    ),
    # every finding of the control, and out-of-range ids where the scores look them up
    "control": (
        TraceHeader.build(n_layer=3, n_expert=4, n_expert_used=2, depth=3, margin=1.0, min_read=1, layers={1}),
        [
            r(0, 0, p, 1, a, w, pred=pr, logits=lg, n_read=nr)
            for p, (a, w, pr, lg, nr) in enumerate(
                [
                    ([0, 1], None, [0, 1, 2], [1.0, 0.5, 0.0], 3),
                    ([0, 4], None, [0, 1, 2], [1.0, 0.5, 0.0], 3),
                    ([-1, 4], None, [4, -1, 2], [1.0, 0.5, 0.0], 3),
                    ([3, 3], None, [3, 1, 2], [1.0, 0.5, 0.0], 3),
                    ([0, 1], [float("nan"), 1.0], [0, 1, 2], [1.0, 0.5, 0.0], 3),
                    ([0, 1], [float("inf"), -1.0], [0, 4, 4], [1.0, 0.5, 0.0], 3),
                    ([0, 1], None, [0, 0, 1], [1.0, 0.5, 0.0], 3),
                    ([0, 1], None, [0, 1, 2], [1.0, 0.5, 0.0], 2),
                    ([0, 1], None, [0, 1, 2], [0.0, 0.5, 1.0], 3),
                    ([0, 1], None, [0, 1, 2], [float("nan"), 0.5, 0.0], 0),
                    ([0, 1], None, [0, 1, 2], [1.0, 0.5, 0.0], 4),
                ]
            )
        ]
        + [
            r(0, 0, 20, 2, [0, 1], pred=[0, 1, 2], logits=[1.0, 0.5, 0.0], n_read=3),
            r(0, 0, 21, 2, [0, 1], n_read=1),
            r(0, 0, 22, 3, [0, 1]),
            r(0, 0, 23, 7, [0, 1]),
        ],
    ),
    "mode_off": (
        TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=1, mode=MODE_OFF),
        [r(0, 0, 0, 1, [0], pred=[0]), r(0, 0, 1, 1, [0])],
    ),
    "empty": (TraceHeader.build(n_layer=3, n_expert=4, n_expert_used=1), []),
}


@pytest.mark.parametrize("name", HAND_MADE)
@pytest.mark.parametrize("chunk", [1, 2, 3, TRACE_CHUNK_RECORDS])
def test_hand_made(tmp_path, name, chunk, write_trace):
    header, rows = HAND_MADE[name]
    both(Trace.open(write_trace(tmp_path / "t", header, rows)), chunk)


# --- randomized traces --------------------------------------------------------------------


def random_trace(
    path: Path, seed: int, *, shuffle: bool = False, big_experts: bool = False, ahead: bool = False
) -> Trace:
    """A trace of ~1000-3000 records of several sequences, with every oddity at a low rate.

    ``ahead``: a version-3 trace whose PREDICTED records are 1..3 layers ahead at random (at
    most their layer: a prediction on layer 0 loses its flag and stays as junk ids)."""
    rng = np.random.default_rng(seed)
    n_layer = int(rng.integers(2, 6))
    n_expert = int(rng.integers(3, 13)) + (65536 + 64 if big_experts else 0)
    lo = n_expert - 40 if big_experts else 0  # ids mostly beyond the kernel's tables
    n_used = int(rng.integers(1, min(4, n_expert - lo) + 1))
    depth = int(rng.integers(1, min(12, n_expert - lo) + 1))
    margin = float(rng.choice([math.inf, 0.0, 0.5, 2.0]))
    min_read = int(rng.integers(0, depth + 1))
    mode = int(rng.choice([MODE_ROUTER, MODE_BLOCK, MODE_OFF], p=[0.6, 0.3, 0.1]))
    layers = {int(layer) for layer in range(n_layer + 2) if rng.random() < 0.7}
    h = TraceHeader.build(
        n_layer=n_layer,
        n_expert=n_expert,
        n_expert_used=n_used,
        depth=depth,
        mode=mode,
        margin=margin,
        min_read=min_read,
        layers=layers,
        version=3 if ahead else 2,
    )
    seqs = [int(s) for s in rng.choice(np.arange(-2, 6), size=int(rng.integers(1, 5)), replace=False)]
    pos = {s: 0 for s in seqs}
    meta = []  # (step, seq, pos, layer, decode)
    for step in range(int(rng.integers(40, 120))):
        rows = []
        for s in seqs:
            if rng.random() < 0.2:
                continue  # idle this step
            u = rng.random()
            if u < 0.05:
                pos[s] = 0  # restarted under the same seq id
            elif u < 0.08:
                pos[s] += int(rng.integers(2, 5))  # a gap
            m = int(rng.integers(2, 6)) if rng.random() < 0.15 else 1  # a prefill or a decode row
            ps = list(range(pos[s], pos[s] + m))
            if m > 1 and rng.random() < 0.3:
                rng.shuffle(ps)  # prefill rows not in pos order
            rows += [(s, p, m == 1) for p in ps]
            pos[s] += m
        for layer in range(n_layer + (1 if rng.random() < 0.05 else 0)):  # sometimes a layer >= n_layer
            for s, p, dec in rows:
                if layer == n_layer - 1 and rng.random() < 0.3:
                    continue  # the last layer: output rows only
                meta.append((step, s, p, layer, dec != (rng.random() < 0.03)))
    if rng.random() < 0.3:  # duplicate some records, anywhere
        for _ in range(int(rng.integers(1, 6))):
            meta.insert(int(rng.integers(0, len(meta) + 1)), meta[int(rng.integers(0, len(meta)))])
    if shuffle:
        meta = [meta[i] for i in rng.permutation(len(meta))]

    n = len(meta)
    rec = np.zeros(n, dtype=h.dtype)
    for i, name in enumerate(("step", "seq_id", "pos", "layer")):
        rec[name] = [m[i] for m in meta]
    decode = np.array([m[4] for m in meta])
    ids = lambda k: np.stack([lo + rng.permutation(n_expert - lo)[:k] for _ in range(n)])  # noqa: E731
    actual = ids(n_used)
    bad = rng.random(n) < 0.05
    actual[bad] = rng.integers(lo - 2, n_expert + 2, size=(int(bad.sum()), n_used))  # dups, out of range
    rec["actual_ids"] = actual
    w = rng.random((n, n_used)).astype(np.float32)
    bad = rng.random(n) < 0.03
    w[bad, 0] = rng.choice(np.array([np.nan, np.inf, -0.5], dtype=np.float32), size=int(bad.sum()))
    rec["actual_w"] = w
    # predictions: often around the actual ids (hits), ranked logits with ties
    pred_flag = (rng.random(n) < 0.85) & (rec["layer"] >= 1) | (rng.random(n) < 0.02)
    p = ids(depth)
    take = rng.random((n, min(depth, n_used))) < 0.6
    p[:, : take.shape[1]] = np.where(
        take, np.roll(actual, int(rng.integers(0, n_used)), axis=1)[:, : take.shape[1]], p[:, : take.shape[1]]
    )  # may duplicate: the control counts it
    bad = rng.random(n) < 0.04
    p[bad] = rng.integers(lo - 2, n_expert + 2, size=(int(bad.sum()), depth))
    logits = -np.sort(-np.round(rng.normal(0, 1.5, size=(n, depth)) * 2) / 2, axis=1).astype(np.float32)
    bad = rng.random(n) < 0.03
    logits[bad] = rng.permutation(logits[bad].T).T  # unranked
    logits[rng.random(n) < 0.01, 0] = np.nan
    n_read = n_read_rows(logits, margin, min_read)
    bad = rng.random(n) < 0.04
    n_read[bad] = rng.integers(0, depth + 3, size=int(bad.sum()))  # disagrees with the gate, or > depth
    rec["pred_ids"] = np.where(pred_flag[:, None], p, -1)
    rec["pred_logits"] = np.where(pred_flag[:, None], logits, np.float32(np.nan))
    rec["n_read"] = np.where(pred_flag, n_read, 0)
    junk = ~pred_flag & (rng.random(n) < 0.02)  # unpredicted rows with ids or n_read
    rec["n_read"][junk] = 1
    if ahead:
        pred_flag &= rec["layer"] >= 1
        far = np.minimum(rng.integers(1, 4, size=n), np.maximum(rec["layer"], 1))
        rec["distance"] = np.where(pred_flag, far, 0)
    rec["flags"] = np.where(decode, TRACE_FLAG_DECODE, 0) | np.where(pred_flag, TRACE_FLAG_PREDICTED, 0)
    with TraceWriter(path, h) as wr:
        wr.write(rec)
    return Trace.open(path)


@pytest.mark.parametrize("seed", range(16))
def test_random_traces(tmp_path, seed):
    trace = random_trace(tmp_path / "t", seed)
    for chunk in CHUNKS[1:] if trace.n_records > 2000 else CHUNKS:
        st = both(trace, chunk)
    assert sum(c.base_tokens for c in st.layers.values()) > 0  # something was scored


@pytest.mark.parametrize("seed", range(8))
def test_random_traces_at_several_distances(tmp_path, seed):
    # version 3, predictions 1..3 layers ahead mixed in one trace: the same counts per (layer, distance)
    trace = random_trace(tmp_path / "t", 300 + seed, ahead=True, shuffle=seed % 2 == 1)
    for chunk in (3, 64, TRACE_CHUNK_RECORDS):
        st = both(trace, chunk)
    assert len(st.distances) > 1 or trace.header.n_layer <= 2  # a layer >= 2 has had two distances


@pytest.mark.parametrize("seed", range(6))
def test_random_traces_out_of_order(tmp_path, seed):
    # records in random order: each chunk is sorted (the chunked semantics, same in both engines)
    trace = random_trace(tmp_path / "t", 100 + seed, shuffle=True)
    for chunk in (3, 64, TRACE_CHUNK_RECORDS):
        both(trace, chunk)


@pytest.mark.parametrize("seed", range(3))
def test_random_traces_beyond_the_lookup_tables(tmp_path, seed):
    # n_expert > 65536: most ids have no table entry in the kernel and are compared one by one
    trace = random_trace(tmp_path / "t", 200 + seed, big_experts=True)
    for chunk in (7, TRACE_CHUNK_RECORDS):
        both(trace, chunk)


def test_benchmark_trace(tmp_path):
    # the shape of a real run (onebit_predict/synth.py): 4 slots, restarts, the last layer's output rows
    synth.write_trace(tmp_path / "t", 4 << 20, seed=5, schedule=synth.Schedule(generate=(3, 40)))
    trace = Trace.open(tmp_path / "t")
    for chunk in (1000, TRACE_CHUNK_RECORDS):
        st = both(trace, chunk)
    assert st.issues == () and st.total.tokens > 0


# --- choosing the engine --------------------------------------------------------------------


def test_unknown_engine(tmp_path, write_trace):
    with pytest.raises(ValueError, match="engine must be one of c, numpy"):
        compute_stats(Trace.open(write_trace(tmp_path / "t", MAIN_HEADER, MAIN_ROWS)), engine="fortran")


def test_no_compiler_is_a_clear_error(tmp_path, monkeypatch, write_trace):
    # no silent fallback to numpy: a kernel that cannot be built is an error that says so
    monkeypatch.setenv("ONEBIT_CACHE", str(tmp_path / "cache"))  # nothing built there yet
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    trace = Trace.open(write_trace(tmp_path / "t", MAIN_HEADER, MAIN_ROWS))
    stats_kernel.load_kernel.cache_clear()
    try:
        with pytest.raises(StatsKernelError, match="needs a C compiler"):
            compute_stats(trace)
    finally:
        stats_kernel.load_kernel.cache_clear()
    assert compute_stats(trace, engine="numpy").total.tokens == 8
