"""onebit_predict/synth.py: the synthetic llama-server-like trace is a valid, consistent trace,
laid out as docs/trace-format.md promises, the same bytes for the same seed, size and schedule."""

from __future__ import annotations

import numpy as np
import pytest

from onebit_predict import synth
from onebit_predict.constants import TRACE_FLAG_DECODE, TRACE_FLAG_PREDICTED
from onebit_predict.metrics.stats import compute_stats
from onebit_predict.trace import Trace


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


def test_synthetic_trace_is_consistent(tmp_path):
    path = tmp_path / "small.trace"
    n_steps, n_records = synth.write_trace(path, 4 << 20, seed=3)
    assert path.stat().st_size == synth.expected_size(4 << 20, 3) <= 4 << 20
    assert (n_steps, n_records) == synth.plan(4 << 20, 3)
    trace = Trace.open(path)
    assert trace.n_records == n_records and trace.dropped_bytes == 0
    h = trace.header
    assert h == synth.synth_header(3)
    assert (h.n_layer, h.n_expert, h.n_expert_used, h.depth, h.mode_name) == (48, 128, 8, 16, "router")
    assert h.margin == float("inf") and h.layer_mask == frozenset(range(1, 48))
    st = compute_stats(trace)
    assert st.issues == ()
    total = st.total.metrics()
    assert total["tokens"] > 0 and total["read_recall"] is not None and total["baseline_recall"] is not None
    check_layout(trace)


def test_synthetic_trace_with_restarts(tmp_path):
    # short sequences, so that slots restart (seq_id reused, pos back to 0) within a small trace
    schedule = synth.Schedule(prompt=(2, 9), generate=(3, 12))
    path = tmp_path / "restarts.trace"
    synth.write_trace(path, 1 << 20, seed=1, schedule=schedule)
    trace = Trace.open(path)
    assert compute_stats(trace).issues == ()
    check_layout(trace)
    pos0 = trace.records["pos"][trace.records["layer"] == 0] == 0
    assert pos0.sum() > schedule.n_slots  # sequences did restart (first prompts: n_slots)
    # the same seed, size and schedule give the same bytes; another schedule other bytes
    again = tmp_path / "again.trace"
    synth.write_trace(again, 1 << 20, seed=1, schedule=schedule)
    assert again.read_bytes() == path.read_bytes()
    synth.write_trace(again, 1 << 20, seed=1)
    assert again.read_bytes() != path.read_bytes()


def test_one_slot_and_many(tmp_path):
    for n_slots in (1, 7):
        schedule = synth.Schedule(n_slots=n_slots, prompt=(2, 6), generate=(1, 5))
        path = tmp_path / f"slots{n_slots}.trace"
        synth.write_trace(path, 2 << 20, seed=2, schedule=schedule)
        trace = Trace.open(path)
        assert set(np.unique(trace.records["seq_id"]).tolist()) == set(range(n_slots))
        assert compute_stats(trace).issues == ()
        check_layout(trace)


def test_chunks_do_not_change_the_bytes(tmp_path, monkeypatch):
    # generated and written WRITE_CHUNK records at a time: a tiny chunk gives the same file
    whole = tmp_path / "whole.trace"
    synth.write_trace(whole, 2 << 20, seed=4)
    monkeypatch.setattr(synth, "WRITE_CHUNK", 1000)
    chunked = tmp_path / "chunked.trace"
    synth.write_trace(chunked, 2 << 20, seed=4)
    assert chunked.read_bytes() == whole.read_bytes()


def test_too_small_is_a_header_only_trace(tmp_path):
    # not even the first ubatch fits: no steps, the header alone (the harness refuses such a size)
    path = tmp_path / "empty.trace"
    assert synth.write_trace(path, 64 << 10, seed=0) == (0, 0)
    assert Trace.open(path).n_records == 0


@pytest.mark.parametrize(
    "kwargs",
    [{"n_slots": 0}, {"prompt": (1, 9)}, {"prompt": (9, 9)}, {"generate": (0, 5)}, {"generate": (5, 5)}],
)
def test_schedule_bounds(kwargs):
    with pytest.raises(ValueError):
        synth.Schedule(**kwargs)


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "t.trace"
    path.write_bytes(b"before")

    def boom(self, meta):
        raise OSError("no space left on device")

    monkeypatch.setattr(synth._Content, "records", boom)
    with pytest.raises(OSError, match="no space"):
        synth.write_trace(path, 4 << 20, seed=0)
    assert path.read_bytes() == b"before" and [p.name for p in tmp_path.iterdir()] == ["t.trace"]
