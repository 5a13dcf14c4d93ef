"""Statistics of hand-made traces, every number worked out by hand in the comments."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from onebit_predict.constants import MODE_OFF
from onebit_predict.metrics.stats import LayerCounts, compare_routing, compute_stats
from onebit_predict.policy import n_read_rows
from onebit_predict.trace import Trace, TraceHeader


@pytest.fixture
def write(write_trace):
    """``write(path, header, rows)``: the trace of rows (conftest's write_trace), opened."""
    return lambda path, header, rows: Trace.open(write_trace(path, header, rows))


def r(step, seq, pos, layer, actual, weights=None, pred=None, logits=None, n_read=None, decode=True):
    return dict(
        step=step,
        seq_id=seq,
        pos=pos,
        layer=layer,
        actual=actual,
        weights=weights,
        pred=pred,
        logits=logits,
        n_read=n_read,
        decode=decode,
    )


# The main case: 4 layers, 8 experts, top-2, depth 4 (> n_used), margin 1.0, floor 1.
# Layers 1 and 2 are predicted, layer 3 is not (baseline only), layer 0 is never scored.
# Step 0: prefill of seq 0 (pos 0, 1) and seq 1's first token (pos 0: DECODE, but first);
#         the last layer (3) has records only for output rows (seq 0 pos 1, seq 1 pos 0).
# Step 1: decode rows seq 1 pos 1, then seq 0 pos 2 (row order != sequence order).
# Step 2: decode rows seq 0 pos 3, then seq 1 pos 2.
# n_read follows the gate: leading run with logits[0] - logits[i] <= 1.0, at least 1.
MAIN_HEADER = TraceHeader.build(
    n_layer=4,
    n_expert=8,
    n_expert_used=2,
    depth=4,
    margin=1.0,
    min_read=1,
    layers={1, 2},
    arch="qwen3moe",
    model="hand-made",
)
MAIN_ROWS = [
    # ---- step 0
    r(step=0, seq=0, pos=0, layer=0, actual=[0, 1]),
    r(step=0, seq=0, pos=1, layer=0, actual=[2, 3]),
    r(step=0, seq=1, pos=0, layer=0, actual=[4, 5]),
    # prefill rows carry (wrong) predictions: they must not be scored
    r(step=0, seq=0, pos=0, layer=1, actual=[0, 1], pred=[4, 5, 6, 7], logits=[0, -2, -3, -4], n_read=1, decode=False),
    r(step=0, seq=0, pos=1, layer=1, actual=[1, 2], pred=[4, 5, 6, 7], logits=[0, -2, -3, -4], n_read=1, decode=False),
    r(
        step=0, seq=1, pos=0, layer=1, actual=[4, 5], pred=[6, 7, 0, 1], logits=[0, -0.5, -3, -4], n_read=2
    ),  # first token
    r(step=0, seq=0, pos=0, layer=2, actual=[0, 1], pred=[7, 6, 5, 4], logits=[0, -2, -3, -4], n_read=1, decode=False),
    r(step=0, seq=0, pos=1, layer=2, actual=[0, 1], pred=[7, 6, 5, 4], logits=[0, -2, -3, -4], n_read=1, decode=False),
    r(step=0, seq=1, pos=0, layer=2, actual=[2, 3], pred=[7, 6, 5, 4], logits=[0, -2, -3, -4], n_read=1),  # first token
    r(step=0, seq=0, pos=1, layer=3, actual=[6, 7], decode=False),
    r(step=0, seq=1, pos=0, layer=3, actual=[0, 1]),
    # ---- step 1
    r(step=1, seq=1, pos=1, layer=0, actual=[1, 2]),
    r(step=1, seq=0, pos=2, layer=0, actual=[3, 4]),
    r(
        step=1,
        seq=1,
        pos=1,
        layer=1,
        actual=[5, 6],
        weights=[0.7, 0.3],
        pred=[5, 7, 6, 0],
        logits=[2.0, 1.5, 0.5, 0.0],
        n_read=2,
    ),
    r(
        step=1,
        seq=0,
        pos=2,
        layer=1,
        actual=[2, 3],
        weights=[0.6, 0.4],
        pred=[2, 3, 4, 5],
        logits=[1.0, 0.5, 0.25, 0.0],
        n_read=4,
    ),
    r(
        step=1,
        seq=1,
        pos=1,
        layer=2,
        actual=[1, 2],
        weights=[0.5, 0.5],
        pred=[3, 4, 1, 2],
        logits=[1.0, 0.9, 0.8, 0.7],
        n_read=4,
    ),
    r(
        step=1,
        seq=0,
        pos=2,
        layer=2,
        actual=[0, 1],
        weights=[0.5, 0.5],
        pred=[0, 1, 2, 3],
        logits=[2.0, 1.5, 0.0, -1.0],
        n_read=2,
    ),
    r(step=1, seq=1, pos=1, layer=3, actual=[0, 2]),
    r(step=1, seq=0, pos=2, layer=3, actual=[6, 7]),
    # ---- step 2
    r(step=2, seq=0, pos=3, layer=0, actual=[5, 6]),
    r(step=2, seq=1, pos=2, layer=0, actual=[7, 0]),
    r(
        step=2,
        seq=0,
        pos=3,
        layer=1,
        actual=[3, 7],
        weights=[0.5, 0.5],
        pred=[0, 1, 3, 7],
        logits=[5.0, 3.0, 2.5, 2.0],
        n_read=1,
    ),
    r(
        step=2,
        seq=1,
        pos=2,
        layer=1,
        actual=[6, 5],
        weights=[0.8, 0.2],
        pred=[6, 5, 1, 2],
        logits=[1.0, 1.0, 1.0, 1.0],
        n_read=4,
    ),
    r(
        step=2,
        seq=0,
        pos=3,
        layer=2,
        actual=[4, 0],
        weights=[0.9, 0.1],
        pred=[0, 5, 6, 4],
        logits=[3.0, 2.5, 2.0, 1.0],
        n_read=3,
    ),
    r(
        step=2,
        seq=1,
        pos=2,
        layer=2,
        actual=[1, 2],
        weights=[0.5, 0.5],
        pred=[1, 2, 3, 4],
        logits=[0.0, 0.0, -0.5, -2.0],
        n_read=3,
    ),
    r(step=2, seq=0, pos=3, layer=3, actual=[5, 4]),
    r(step=2, seq=1, pos=2, layer=3, actual=[2, 0]),
]


@pytest.fixture
def main_trace(tmp_path, write):
    return write(tmp_path / "main.trace", MAIN_HEADER, MAIN_ROWS)


def test_layer_1_by_hand(main_trace):
    # scored rows (decode, not first): s1p1, s0p2, s0p3, s1p2
    #   row    A      P[:2]  P       R (n_read)       |A∩P2| |A∩P| |A∩R| |R| exact mass(A∩R)  prev A  |A∩prev|
    #   s1p1  {5,6}   5,7    5,7,6,0 {5,7}     (2)    1      2     1     2   no    0.7        {4,5}   1
    #   s0p2  {2,3}   2,3    2,3,4,5 all       (4)    2      2     2     4   yes   1.0        {1,2}   1
    #   s0p3  {3,7}   0,1    0,1,3,7 {0}       (1)    0      2     0     1   no    0          {2,3}   1
    #   s1p2  {6,5}   6,5    6,5,1,2 all       (4)    2      2     2     4   yes   1.0        {5,6}   2
    m = compute_stats(main_trace).layers[1].metrics()
    assert m["tokens"] == 4
    assert m["slot_recall_used"] == 5 / 8  # (1+2+0+2) / (4 rows * 2)
    assert m["slot_recall_depth"] == 8 / 8
    assert m["read_recall"] == 5 / 8  # (1+2+0+2) / 8
    assert m["precision"] == 5 / 11  # 5 / (2+4+1+4)
    assert m["wasted_per_useful"] == 6 / 5  # (11-5) / 5
    assert m["exact_match"] == 2 / 4
    assert m["gate_mass_recall"] == pytest.approx(2.7 / 4.0, abs=1e-6)  # (0.7+1+0+1) / 4 rows of weight 1
    assert m["candidates_read"] == 11
    assert m["candidates_gated"] == 5  # (4-2)+(4-4)+(4-1)+(4-4)
    assert m["baseline_tokens"] == 4
    assert m["baseline_recall"] == 5 / 8  # (1+1+1+2) / 8


def test_layer_2_by_hand(main_trace):
    #   row    A      P[:2]  P       R (n_read)       |A∩P2| |A∩P| |A∩R| |R| exact mass(A∩R)  prev A  |A∩prev|
    #   s1p1  {1,2}   3,4    3,4,1,2 all       (4)    0      2     2     4   no    1.0        {2,3}   1
    #   s0p2  {0,1}   0,1    0,1,2,3 {0,1}     (2)    2      2     2     2   yes   1.0        {0,1}   2
    #   s0p3  {4,0}   0,5    0,5,6,4 {0,5,6}   (3)    1      2     1     3   no    0.1 (id 0) {0,1}   1
    #   s1p2  {1,2}   1,2    1,2,3,4 {1,2,3}   (3)    2      2     2     3   yes   1.0        {1,2}   2
    m = compute_stats(main_trace).layers[2].metrics()
    assert m["tokens"] == 4
    assert m["slot_recall_used"] == 5 / 8  # 0+2+1+2
    assert m["slot_recall_depth"] == 8 / 8  # depth 4 > n_used 2 finds what top-2 missed
    assert m["read_recall"] == 7 / 8  # 2+2+1+2
    assert m["precision"] == 7 / 12  # 4+2+3+3 read
    assert m["wasted_per_useful"] == 5 / 7
    assert m["exact_match"] == 2 / 4
    assert m["gate_mass_recall"] == pytest.approx(3.1 / 4.0, abs=1e-6)
    assert (m["candidates_read"], m["candidates_gated"]) == (12, 4)  # gated 0+2+1+1
    assert m["baseline_recall"] == 6 / 8  # 1+2+1+2


def test_unpredicted_layer_has_baseline_only(main_trace):
    # layer 3 (last layer, output rows only): prev of s0p2 is the prefill output row s0p1 {6,7}
    #   s1p1 {0,2} vs {0,1}: 1;  s0p2 {6,7} vs {6,7}: 2;  s0p3 {5,4} vs {6,7}: 0;  s1p2 {2,0} vs {0,2}: 2
    c = compute_stats(main_trace).layers[3]
    m = c.metrics()
    assert (m["baseline_tokens"], m["baseline_recall"]) == (4, 5 / 8)
    assert m["tokens"] == 0
    for name in (
        "slot_recall_used",
        "slot_recall_depth",
        "read_recall",
        "precision",
        "wasted_per_useful",
        "exact_match",
        "gate_mass_recall",
        "candidates_read",
        "candidates_gated",
    ):
        assert m[name] is None, name
    assert c.records == 6


def test_layer_0_has_a_baseline_and_no_prediction(main_trace):
    # layer 0 is never predicted, but its previous-token baseline is scored like any layer's:
    #   s0p1 {2,3} vs {0,1}: 0;  s1p1 {1,2} vs {4,5}: 0;  s0p2 {3,4} vs {2,3}: 1;
    #   s0p3 {5,6} vs {3,4}: 0;  s1p2 {7,0} vs {1,2}: 0
    c = compute_stats(main_trace).layers[0]
    m = c.metrics()
    assert c.records == 7 and c.tokens == 0 and m["read_recall"] is None
    assert (m["baseline_tokens"], m["baseline_recall"]) == (5, 1 / 10)


def test_the_total_compares_the_same_tokens(main_trace):
    """The total sums the predicted layers (the header's mask) for the baseline too: layer 0 and
    the unpredicted layer 3 show their baseline in their own rows only."""
    st = compute_stats(main_trace)
    mask = st.header.layer_mask
    assert 0 not in mask and 3 not in mask
    total = st.total
    assert total.base_tokens == sum(c.base_tokens for layer, c in st.layers.items() if layer in mask)
    assert total.base_tokens == total.tokens  # every scored row of a predicted layer is predicted here


def test_total_is_micro_averaged(main_trace):
    st = compute_stats(main_trace)
    m = st.total.metrics()
    assert list(st.layers) == [0, 1, 2, 3]
    assert st.total.records == len(MAIN_ROWS) == 27
    assert m["tokens"] == 8
    assert m["slot_recall_used"] == 10 / 16  # (5+5) / (8 rows * 2)
    assert m["read_recall"] == 12 / 16  # (5+7) / 16, not the mean of 5/8 and 7/8 per row or layer
    assert m["precision"] == 12 / 23  # 12 / (11+12)
    assert m["wasted_per_useful"] == 11 / 12
    assert m["exact_match"] == 4 / 8
    assert m["gate_mass_recall"] == pytest.approx(5.8 / 8, abs=1e-6)
    assert (m["candidates_read"], m["candidates_gated"]) == (23, 9)
    # the predicted layers 1 and 2: (5+6) / (8*2); layer 3's baseline (5/8) stays in its own row
    assert (m["baseline_tokens"], m["baseline_recall"]) == (8, 11 / 16)
    assert st.issues == ()


def test_select_restricts_layers_and_total(main_trace):
    st = compute_stats(main_trace).select([2, 3])
    assert list(st.layers) == [2, 3]
    assert st.total.metrics()["read_recall"] == 7 / 8  # layer 3 has no predictions
    assert st.total.metrics()["baseline_recall"] == 6 / 8  # layer 2 only: layer 3 is not predicted


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 7, 26])
def test_chunked_reading_gives_the_same_stats(main_trace, chunk):
    assert compute_stats(main_trace, chunk) == compute_stats(main_trace)


def test_baseline_follows_the_sequence_not_the_row_order(tmp_path, write):
    # Two sequences interleaved: rows alternate seq 0 / seq 1, with seq 1 listed first in step 1.
    # Seq 0 always uses {0,1}, seq 1 always {6,7}: following the sequence, every decode row
    # hits 2/2; following the row order, it would hit 0.
    h = TraceHeader.build(n_layer=2, n_expert=8, n_expert_used=2, layers=set())
    rows = [
        r(step=0, seq=0, pos=0, layer=1, actual=[0, 1]),
        r(step=0, seq=1, pos=0, layer=1, actual=[6, 7]),
        r(step=1, seq=1, pos=1, layer=1, actual=[7, 6]),
        r(step=1, seq=0, pos=1, layer=1, actual=[1, 0]),
        r(step=2, seq=0, pos=2, layer=1, actual=[0, 1]),
        r(step=2, seq=1, pos=2, layer=1, actual=[6, 7]),
    ]
    m = compute_stats(write(tmp_path / "t", h, rows)).layers[1].metrics()
    assert (m["baseline_tokens"], m["baseline_recall"]) == (4, 1.0)


def test_restarted_sequence_and_gaps_are_first_tokens(tmp_path, write):
    # seq 0: pos 0, 1, then restarted at pos 0 (a reused seq id), then pos 5 (a gap), pos 6.
    # Only pos 1 (prev pos 0) and pos 6 (prev pos 5) are scored: baseline tokens 2.
    h = TraceHeader.build(n_layer=2, n_expert=8, n_expert_used=1, layers={1})
    rows = [
        r(step=s, seq=0, pos=p, layer=1, actual=[a], pred=[a])
        for s, (p, a) in enumerate([(0, 1), (1, 1), (0, 2), (5, 3), (6, 4)])
    ]
    m = compute_stats(write(tmp_path / "t", h, rows)).layers[1].metrics()
    # pos 1: A {1} vs prev {1} -> 1; pos 6: A {4} vs prev {3} -> 0
    assert (m["baseline_tokens"], m["baseline_recall"]) == (2, 1 / 2)
    assert (m["tokens"], m["read_recall"]) == (2, 1.0)


def test_out_of_order_records_across_chunks_are_scored_once(tmp_path, write):
    # pos 0, pos 1, then pos 0 again (a duplicate, out of step order). Read in chunks of 2, the
    # second chunk's pos 0 sorts before the carried pos 1 record, which must not be re-scored.
    h = TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=1, layers=set())
    t = write(
        tmp_path / "t",
        h,
        [
            r(step=0, seq=0, pos=0, layer=1, actual=[0], decode=False),
            r(step=1, seq=0, pos=1, layer=1, actual=[0]),
            r(step=0, seq=0, pos=0, layer=1, actual=[0], decode=False),
        ],
    )
    assert compute_stats(t, 2) == compute_stats(t)
    assert compute_stats(t, 2).layers[1].base_tokens == 1


def test_exact_match_is_set_equality(tmp_path, write):
    # A [3,3] (a duplicate, which the control reports) vs P[:2] [3,1]: A ⊆ P[:2] but {3} != {1,3}
    # A [2,2] vs P[:2] [2,2]: {2} == {2}.  exact = 1 / 2
    h = TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=2, depth=2)
    rows = [
        r(step=0, seq=0, pos=0, layer=1, actual=[0, 1], pred=[0, 1]),
        r(step=1, seq=0, pos=1, layer=1, actual=[3, 3], pred=[3, 1]),
        r(step=2, seq=0, pos=2, layer=1, actual=[2, 2], pred=[2, 2]),
    ]
    st = compute_stats(write(tmp_path / "t", h, rows))
    assert st.layers[1].metrics()["exact_match"] == 1 / 2
    assert st.issues == ("2 records with a duplicate actual id", "1 PREDICTED records with a duplicate predicted id")


def test_zero_margin_gate_reads_only_the_leader_and_ties(tmp_path, write):
    # margin 0, floor 0: read only candidates whose logit equals the best one.
    h = TraceHeader.build(n_layer=2, n_expert=8, n_expert_used=2, depth=4, margin=0.0, min_read=0)
    rows = [
        r(step=0, seq=0, pos=0, layer=1, actual=[0, 1], pred=[0, 1, 2, 3], logits=[1, 0, -1, -2], n_read=1),
        # A {0,1}; R = {2} (n_read 1): 0 hits, 1 read
        r(
            step=1,
            seq=0,
            pos=1,
            layer=1,
            actual=[0, 1],
            weights=[0.25, 0.75],
            pred=[2, 0, 1, 3],
            logits=[3, 2, 1, 0],
            n_read=1,
        ),
        # A {4,5}; logits tie for the first two: R = {5, 6} (n_read 2): 1 hit (5, weight 0.5), 2 read
        r(
            step=2,
            seq=0,
            pos=2,
            layer=1,
            actual=[4, 5],
            weights=[0.5, 0.5],
            pred=[5, 6, 4, 0],
            logits=[2, 2, 1, 0],
            n_read=2,
        ),
    ]
    st = compute_stats(write(tmp_path / "t", h, rows))
    m = st.layers[1].metrics()
    assert st.issues == ()  # n_read matches the gate recomputed from the logits
    assert m["tokens"] == 2
    assert m["read_recall"] == 1 / 4  # (0 + 1) / (2 rows * 2)
    assert m["slot_recall_used"] == 2 / 4  # A∩P[:2]: {0,1}∩{2,0} -> 1, {4,5}∩{5,6} -> 1
    assert m["slot_recall_depth"] == 4 / 4  # {2,0,1,3} has 0 and 1; {5,6,4,0} has 4 and 5
    assert m["precision"] == 1 / 3  # 1 / (1 + 2)
    assert m["wasted_per_useful"] == 2.0  # (3 - 1) / 1
    assert m["gate_mass_recall"] == 0.5 / 2.0  # 0 + 0.5 over 1.0 + 1.0
    assert (m["candidates_read"], m["candidates_gated"]) == (3, 5)  # (4-1) + (4-2)


def test_prefill_rows_are_not_scored(tmp_path, write):
    h = TraceHeader.build(n_layer=2, n_expert=8, n_expert_used=1)
    rows = [r(step=0, seq=0, pos=p, layer=1, actual=[p], pred=[p], decode=False) for p in range(4)]
    st = compute_stats(write(tmp_path / "t", h, rows))
    m = st.layers[1].metrics()
    assert st.layers[1].records == 4
    assert (m["tokens"], m["baseline_tokens"], m["read_recall"], m["baseline_recall"]) == (0, 0, None, None)


def test_empty_trace_has_predicted_layers_unscored(tmp_path, write):
    h = TraceHeader.build(n_layer=3, n_expert=4, n_expert_used=1)
    st = compute_stats(write(tmp_path / "t", h, []))
    assert list(st.layers) == [1, 2] and st.issues == ()
    assert st.total == LayerCounts() and st.total.metrics()["read_recall"] is None


def test_read_counts_uses_binary32():
    # 1.0f - 0.9f = 0.10000002 > 0.1f, while in double 1.0 - 0.9 < 0.1: binary32 reads 1, not 2
    assert n_read_rows(np.array([[1.0, 0.9]], dtype=np.float32), 0.1, 0).tolist() == [1]
    logits = np.array([[3, 2, 1, 0], [3, 3, 3, 3]], dtype=np.float32)
    assert n_read_rows(logits, float("inf"), 0).tolist() == [4, 4]  # no gate: the whole depth
    assert n_read_rows(logits, 1.0, 0).tolist() == [2, 4]
    assert n_read_rows(logits, 1.0, 3).tolist() == [3, 4]  # raised to the floor


# --- the consistency control -------------------------------------------------------------


def test_control_reports_each_problem_with_its_count(tmp_path, write):
    h = TraceHeader.build(n_layer=3, n_expert=4, n_expert_used=2, depth=3, margin=1.0, min_read=1, layers={1})
    good = dict(pred=[0, 1, 2], logits=[1.0, 0.5, 0.0], n_read=3)
    rows = [
        r(step=0, seq=0, pos=0, layer=1, actual=[0, 1], **good),  # clean
        r(step=0, seq=0, pos=1, layer=1, actual=[0, 4], **good),  # actual id 4 out of [0, 4)
        r(step=0, seq=0, pos=2, layer=1, actual=[-1, 2], **good),  # actual id -1 out of range
        r(step=0, seq=0, pos=3, layer=1, actual=[3, 3], **good),  # duplicate actual
        r(step=0, seq=0, pos=4, layer=1, actual=[0, 1], weights=[float("nan"), 1.0], **good),  # NaN weight
        r(
            step=0, seq=0, pos=5, layer=1, actual=[0, 1], pred=[0, 4, 1], logits=[1.0, 0.5, 0.0], n_read=3
        ),  # pred id out of range
        r(
            step=0, seq=0, pos=6, layer=1, actual=[0, 1], pred=[0, 0, 1], logits=[1.0, 0.5, 0.0], n_read=3
        ),  # duplicate pred
        r(
            step=0, seq=0, pos=7, layer=1, actual=[0, 1], pred=[0, 1, 2], logits=[1.0, 0.5, 0.0], n_read=2
        ),  # gate says 3
        r(step=0, seq=0, pos=8, layer=1, actual=[0, 1], pred=[0, 1, 2], logits=[0.0, 0.5, 1.0], n_read=3),  # not ranked
        r(
            step=0, seq=0, pos=9, layer=1, actual=[0, 1], pred=[0, 1, 2], logits=[1.0, 0.5, 0.0], n_read=4
        ),  # n_read > depth
        r(step=0, seq=0, pos=10, layer=2, actual=[0, 1], **good),  # predicted, layer 2 not in the mask
        r(step=0, seq=0, pos=11, layer=2, actual=[0, 1], n_read=1),  # unpredicted with n_read != 0
        r(step=0, seq=0, pos=12, layer=3, actual=[0, 1]),  # layer 3 >= n_layer
        r(step=0, seq=0, pos=13, layer=7, actual=[0, 1]),  # layer 7 >= n_layer
    ]
    st = compute_stats(write(tmp_path / "t", h, rows))
    assert list(st.issues) == [
        "2 records with layer >= n_layer (3)",
        "2 records with actual ids outside [0, 4)",
        "1 records with a duplicate actual id",
        "1 records with a NaN, infinite or negative actual weight",
        "1 records with n_read > depth (3)",
        "1 unpredicted records with predicted ids other than -1 or n_read != 0",
        "1 PREDICTED records on a layer outside the header's layer mask",
        "1 PREDICTED records with predicted ids outside [0, 4)",
        "1 PREDICTED records with a duplicate predicted id",
        "1 PREDICTED records whose logits are not in descending order (or NaN)",
        # pos 7 (n_read 2) and pos 9 (n_read 4) where the gate reads 3; pos 8 is unranked but
        # logits[0] - logits[i] = 0, -0.5, -1 are all <= 1, so the gate reads 3 as written
        "2 PREDICTED records whose n_read is not the margin gate and floor recomputed from their logits",
    ]
    assert 3 not in st.layers and 7 not in st.layers  # out-of-range layers are not scored


def test_control_checks_the_header(tmp_path, write):
    h = TraceHeader.build(n_layer=3, n_expert=4, n_expert_used=2, depth=3, depth_requested=0, layers={0, 1, 5})
    st = compute_stats(write(tmp_path / "t", h, []))
    assert st.issues == (
        "the header's layer mask includes layer 0, which has no layer before it",
        "the header's layer mask includes layers [5] >= n_layer (3)",
        "header depth 3 does not follow depth_requested 0 (expected 2)",
    )


def test_control_flags_predictions_in_mode_off(tmp_path, write):
    h = TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=1, mode=MODE_OFF)
    st = compute_stats(
        write(
            tmp_path / "t",
            h,
            [r(step=0, seq=0, pos=0, layer=1, actual=[0], pred=[0]), r(step=0, seq=0, pos=1, layer=1, actual=[0])],
        )
    )
    assert st.issues == ("1 PREDICTED records in a trace whose mode is off",)


# --- comparing the actual routing of two traces ---------------------------------------------


def test_compare_routing(tmp_path, write):
    block = dataclasses.replace(MAIN_HEADER, mode=2)
    a = write(tmp_path / "a", MAIN_HEADER, MAIN_ROWS)
    # same tokens, other predictions, actual ids listed in another order: they agree
    same = [dict(row, pred=None, logits=None, n_read=None, actual=row["actual"][::-1]) for row in MAIN_ROWS]
    assert compare_routing(a, write(tmp_path / "b", block, same), records_per_chunk=4) == []

    changed = [dict(row) for row in MAIN_ROWS]
    changed[19] = dict(changed[19], actual=[5, 1])  # s0p3 layer 0: {5,6} -> {5,1}
    diffs = compare_routing(a, write(tmp_path / "c", block, changed), records_per_chunk=4)
    assert diffs == [
        "1 records differ in (seq_id, pos, layer) or actual ids",
        "record 19: seq 0 pos 3 layer 0 actual [5, 6] vs seq 0 pos 3 layer 0 actual [1, 5]",
    ]

    shorter = compare_routing(a, write(tmp_path / "d", block, MAIN_ROWS[:-1]))
    assert shorter == ["27 vs 26 records"]

    other = TraceHeader.build(n_layer=4, n_expert=16, n_expert_used=2)
    assert compare_routing(a, write(tmp_path / "e", other, [])) == ["different models: n_expert 8 vs 16"]
