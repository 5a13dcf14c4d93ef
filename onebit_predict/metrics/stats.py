"""Hit rates of a P/A trace, per layer and in total, and a consistency control of the trace.

With A the actual experts of a row, P its ranked prediction and R = P[:n_read] the
candidates read: slot recall@k = |A ∩ P[:k]| / |A| (k = n_expert_used, depth), read recall
= |A ∩ R| / |A|, precision = |A ∩ R| / |R|, wasted reads per useful one = (|R| - |A ∩ R|) /
|A ∩ R|, exact match = set(P[:n_expert_used]) == set(A), gate-mass recall = weight of A ∩ R
/ weight of A, previous-token baseline = |A ∩ A_prev| / |A| with A_prev the same layer's A
at pos - 1 of the same sequence.

- which rows are scored: DECODE rows (flag bit 1: the row's sequence had one token in the
  whole llama_decode batch) that are not the first token of their sequence. A row is the
  first token when the latest earlier record of the same (seq_id, layer) -- latest by (step,
  pos) -- is not at pos - 1, or does not exist. So pos 0 is always a first token, and so is a
  sequence restarted, shifted or restored under a reused seq_id. Those rows are scored for the
  previous-token baseline in every layer that has records, layer 0 included; the PREDICTED
  ones among them for the prediction metrics (layer 0 is never predicted). Prefill rows are
  never scored but do provide the previous token. The native table (ONEBIT_MOE_PREDICT_STATS)
  scores the same rows (tests/test_stats_native.py holds them to it).
- the total: the sum over the predicted layers (the header's layer mask), for the baseline as
  for the prediction metrics, so the total row compares the same tokens; the baseline of
  layer 0 and of unpredicted layers is in their own rows only.
- per distance: a PREDICTED record carries how many layers ahead it was predicted (its
  ``distance`` K, 1..3; 1 in trace versions 1 and 2). Every count is also kept per (layer,
  distance), the unpredicted records under distance 0: ``TraceStats.by_distance``. The
  baseline of a (layer, K) group is scored on the same rows as its prediction (the previous
  token's actual set of the same layer, whatever K), so each distance compares like with
  like; summed over the distances, the groups give the per-layer counts above unchanged.
  ``TraceStats.total_at(K)`` is the total of one distance over the predicted layers.
- every ratio is micro-averaged: a sum over rows divided by a sum over rows (total hits /
  total actual slots), never a mean of per-row ratios. Totals are the same sums over layers.
- a ratio whose denominator is zero is ``None`` (printed ``-``): nothing was scored.
  ``wasted_per_useful`` is also ``None`` when reads were made but none was useful.

Everything is computed chunk by chunk, in bounded memory: per-layer counters, plus the last
record of each (seq_id, layer) carried from one chunk to the next for the baseline. Two
engines compute the same numbers (the tests hold them to it): ``c`` (the default), a
compiled kernel (``stats_kernel.c``, built once through cffi) that scores each record in
one pass; and ``numpy``, whole-array numpy passes per chunk, the reference, several times
slower. There is no fallback from one to the other: ``engine`` chooses.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from itertools import count

import numpy as np

from ..constants import (
    MODE_OFF,
    STATS_ENGINE_C,
    STATS_ENGINE_NUMPY,
    STATS_ENGINES,
    TRACE_CHUNK_RECORDS,
    TRACE_FLAG_DECODE,
    TRACE_FLAG_PREDICTED,
)
from ..policy import n_read_rows
from ..trace import Trace, TraceHeader
from .stats_kernel import FLOAT_COUNTERS, INT_COUNTERS, ISSUE_COUNTERS, N_DISTANCES, StatsKernel


def _ratio(num: float, den: float) -> float | None:
    if den == 0:
        return None
    r = num / den
    return r if math.isfinite(r) else None


@dataclass(frozen=True)
class LayerCounts:
    """Sums over the scored rows of one layer (or of several, added together)."""

    records: int = 0  # records of the layer, any kind
    tokens: int = 0  # scored PREDICTED rows
    actual: int = 0  # sum of |A| over them
    hits_used: int = 0  # sum of |A ∩ P[:n_used]|
    hits_depth: int = 0  # sum of |A ∩ P[:depth]|
    hits_read: int = 0  # sum of |A ∩ R|
    read: int = 0  # sum of |R| (candidates read)
    gated: int = 0  # sum of depth - |R| (candidates the gate kept from being read)
    exact: int = 0  # rows with set(P[:n_used]) == set(A)
    mass_hit: float = 0.0  # sum of the actual weights of A ∩ R
    mass: float = 0.0  # sum of the actual weights of A
    base_tokens: int = 0  # scored rows, predicted or not
    base_actual: int = 0  # sum of |A| over them
    base_hits: int = 0  # sum of |A ∩ A_prev|

    def __add__(self, other: LayerCounts) -> LayerCounts:
        return LayerCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    def metrics(self) -> dict[str, int | float | None]:
        """The reported metrics (fractions in [0, 1]; None where nothing was scored)."""
        scored = self.tokens > 0
        return {
            "tokens": self.tokens,
            "slot_recall_used": _ratio(self.hits_used, self.actual),
            "slot_recall_depth": _ratio(self.hits_depth, self.actual),
            "read_recall": _ratio(self.hits_read, self.actual),
            "precision": _ratio(self.hits_read, self.read),
            "wasted_per_useful": _ratio(self.read - self.hits_read, self.hits_read),
            "exact_match": _ratio(self.exact, self.tokens),
            "gate_mass_recall": _ratio(self.mass_hit, self.mass),
            "candidates_read": self.read if scored else None,
            "candidates_gated": self.gated if scored else None,
            "baseline_tokens": self.base_tokens,
            "baseline_recall": _ratio(self.base_hits, self.base_actual),
        }


METRICS = tuple(LayerCounts().metrics())  # metric names, in report order


@dataclass(frozen=True)
class TraceStats:
    """The counts of every layer that has records or is predicted, and the control's issues.

    ``by_distance[K][layer]``: the counts of the layer's records predicted K layers ahead
    (K >= 1; the baseline on the same rows), and under K = 0 its unpredicted records (the
    baseline only); only groups with records are there. Summed over K they give ``layers``.
    """

    header: TraceHeader
    layers: dict[int, LayerCounts]  # ascending layer
    issues: tuple[str, ...]  # empty when the trace is consistent
    by_distance: dict[int, dict[int, LayerCounts]] = field(default_factory=dict)  # ascending K, then layer

    @property
    def distances(self) -> tuple[int, ...]:
        """The lookahead distances of the trace's PREDICTED records (of the selected layers), ascending."""
        return tuple(k for k in self.by_distance if k > 0)

    def layer_distances(self, layer: int) -> tuple[int, ...]:
        """The distances of the layer's PREDICTED records, ascending (empty: none predicted)."""
        return tuple(k for k, layers in self.by_distance.items() if k > 0 and layer in layers)

    def total_at(self, distance: int) -> LayerCounts:
        """The total of one distance: its counts summed over the predicted layers (the header's
        layer mask), prediction and baseline over the same rows (``records``: the distance's
        records in every layer)."""
        groups = self.by_distance.get(distance, {})
        mask = self.header.layer_mask
        total = sum((c for layer, c in groups.items() if layer in mask), LayerCounts())
        return replace(total, records=sum(c.records for c in groups.values()))

    @property
    def total(self) -> LayerCounts:
        """The sum over the predicted layers (the header's layer mask) among ``layers``: the
        baseline and the prediction metrics over the same tokens (``records`` counts every
        layer's records)."""
        mask = self.header.layer_mask
        total = sum((c for layer, c in self.layers.items() if layer in mask), LayerCounts())
        return replace(total, records=sum(c.records for c in self.layers.values()))  # records: every layer's

    def select(self, layers: Iterable[int]) -> TraceStats:
        """The same stats restricted to ``layers`` (the total follows; the issues stay)."""
        keep = set(layers)
        by_distance = {
            k: {layer: c for layer, c in groups.items() if layer in keep} for k, groups in self.by_distance.items()
        }
        return TraceStats(
            self.header,
            {layer: c for layer, c in self.layers.items() if layer in keep},
            self.issues,
            {k: groups for k, groups in by_distance.items() if groups},
        )


def _rank(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``out[i, j]``: the first ``c`` with ``b[i, c] == a[i, j]``, or ``b.shape[1]`` if none.

    One ``(n, |a|)`` comparison per column of ``b``: an ``(n, |a|, |b|)`` broadcast reduced
    over its short last axis costs several times more.
    """
    width = b.shape[1]
    out = np.full(a.shape, width, dtype=np.int16 if width < 2**15 else np.int32)
    for c in range(width - 1, -1, -1):
        np.copyto(out, c, where=a == b[:, c : c + 1])
    return out


def _member(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``out[i, j]``: ``a[i, j]`` is among the entries of ``b[i]``."""
    out = a == b[:, :1]
    for c in range(1, b.shape[1]):
        out |= a == b[:, c : c + 1]
    return out


def _has_dup(ids: np.ndarray) -> np.ndarray:
    s = np.sort(ids, axis=1)
    return (s[:, 1:] == s[:, :-1]).any(axis=1)


_FIELDS = (
    "step",
    "seq_id",
    "pos",
    "layer",
    "n_read",
    "flags",
    "distance",
    "actual_ids",
    "actual_w",
    "pred_ids",
    "pred_logits",
)
_KEYS = ("seq_id", "layer", "step", "pos")  # what is carried from chunk to chunk, with actual_ids


_ISSUES = {  # control counters -> what they count, in report order
    "layer_range": "records with layer >= n_layer ({h.n_layer})",
    "actual_range": "records with actual ids outside [0, {h.n_expert})",
    "actual_dup": "records with a duplicate actual id",
    "actual_w": "records with a NaN, infinite or negative actual weight",
    "n_read_depth": "records with n_read > depth ({h.depth})",
    "unpredicted": "unpredicted records with predicted ids other than -1 or n_read != 0",
    "pred_mode_off": "PREDICTED records in a trace whose mode is off",
    "pred_mask": "PREDICTED records on a layer outside the header's layer mask",
    "pred_range": "PREDICTED records with predicted ids outside [0, {h.n_expert})",
    "pred_dup": "PREDICTED records with a duplicate predicted id",
    "pred_unranked": "PREDICTED records whose logits are not in descending order (or NaN)",
    "pred_n_read": "PREDICTED records whose n_read is not the margin gate and floor recomputed from their logits",
}


def _header_issues(h: TraceHeader, distances: tuple[int, ...]) -> list[str]:
    """The header's own inconsistencies; ``distances``: those of the trace's PREDICTED records."""
    issues = []
    if 0 in h.layer_mask:
        issues.append("the header's layer mask includes layer 0, which has no layer before it")
    if distances:  # layer l is predicted from layer l - K: none below K (layer 0 is reported above)
        k = min(distances)
        early = sorted(layer for layer in h.layer_mask if 0 < layer < k)
        if early:
            issues.append(
                f"the header's layer mask includes layers {early}, which have no layer {k} before them"
                f" (the trace predicts {k} layers ahead)"
            )
    beyond = sorted(layer for layer in h.layer_mask if layer >= h.n_layer)
    if beyond:
        issues.append(f"the header's layer mask includes layers {beyond} >= n_layer ({h.n_layer})")
    expected = min(h.depth_requested, h.n_expert) if h.depth_requested > 0 else h.n_expert_used
    if h.depth != expected:
        issues.append(
            f"header depth {h.depth} does not follow depth_requested {h.depth_requested} (expected {expected})"
        )
    return issues


def _check(h: TraceHeader, rec: dict[str, np.ndarray], found: Counter[str], predictable: np.ndarray) -> None:
    """Count the control's findings in one chunk (its fields as contiguous arrays)."""
    predicted = (rec["flags"] & TRACE_FLAG_PREDICTED) != 0
    a, p, n_read = rec["actual_ids"], rec["pred_ids"], rec["n_read"]
    pr, pl = p[predicted], rec["pred_logits"][predicted]
    found["layer_range"] += int((rec["layer"] >= h.n_layer).sum())
    found["actual_range"] += int(((a < 0) | (a >= h.n_expert)).any(axis=1).sum())
    found["actual_dup"] += int(_has_dup(a).sum())
    found["actual_w"] += int((~(rec["actual_w"] >= 0) | np.isinf(rec["actual_w"])).any(axis=1).sum())
    found["n_read_depth"] += int((n_read > h.depth).sum())
    found["unpredicted"] += int((~predicted & ((p != -1).any(axis=1) | (n_read != 0))).sum())
    found["pred_mode_off"] += int(predicted.sum()) if h.mode == MODE_OFF else 0
    found["pred_mask"] += int((predicted & ~predictable[rec["layer"]]).sum())
    found["pred_range"] += int(((pr < 0) | (pr >= h.n_expert)).any(axis=1).sum())
    found["pred_dup"] += int(_has_dup(pr).sum())
    found["pred_unranked"] += int((~(pl[:, 1:] <= pl[:, :-1]).all(axis=1) | np.isnan(pl[:, 0])).sum())
    found["pred_n_read"] += int((n_read[predicted] != n_read_rows(pl, h.margin, h.min_read)).sum())


def _score(
    h: TraceHeader, rec: dict[str, np.ndarray], last: dict[str, np.ndarray], sums: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """Add one chunk's scored rows to ``sums``; return the new last record of each (seq, layer).

    ``last`` holds the keys and actual ids of the previous chunks' last record of each
    (seq_id, layer); the keys are sorted together with the chunk's so that a row's previous
    token is simply the row before it. Only keys are sorted and only the fields a metric
    needs are gathered, never whole records.
    """

    n_bins = N_DISTANCES * h.n_layer

    def add(name: str, group: np.ndarray, values: np.ndarray | None = None) -> None:
        sums[name] += np.bincount(group, weights=values, minlength=n_bins).reshape(N_DISTANCES, h.n_layer)

    # a record's group: distance * n_layer + layer (distance 0: unpredicted; iter_chunks bounds it)
    groups = rec["distance"].astype(np.intp) * h.n_layer + rec["layer"]
    add("records", groups)
    n_last = len(last["layer"])
    key = {k: np.concatenate([last[k], rec[k]]) for k in _KEYS}
    actual = np.concatenate([last["actual_ids"], rec["actual_ids"]])
    order = np.lexsort((key["pos"], key["step"], key["layer"], key["seq_id"]))
    s_seq, s_layer, s_pos = key["seq_id"][order], key["layer"][order], key["pos"][order]
    same = (s_seq[1:] == s_seq[:-1]) & (s_layer[1:] == s_layer[:-1])
    follows = same & (s_pos[1:].astype(np.int64) == s_pos[:-1].astype(np.int64) + 1)
    at = np.flatnonzero(follows) + 1  # sorted positions whose previous token is the row before
    row = order[at] - n_last  # their index in the chunk; < 0: a carried record, scored already
    ok = row >= 0
    at, row = at[ok], row[ok]
    ok = (rec["flags"][row] & TRACE_FLAG_DECODE) != 0
    at, row = at[ok], row[ok]
    group, a, flags = groups[row], rec["actual_ids"][row], rec["flags"][row]

    add("base_tokens", group)
    add("base_actual", group, np.full(len(row), h.n_expert_used))
    add("base_hits", group, _member(a, actual[order[at - 1]]).sum(axis=1))

    pred = (flags & TRACE_FLAG_PREDICTED) != 0
    row, group, a = row[pred], group[pred], a[pred]
    p = rec["pred_ids"][row]
    w = rec["actual_w"][row].astype(np.float64)
    n_read = np.minimum(rec["n_read"][row], h.depth)
    k = min(h.n_expert_used, h.depth)
    rank = _rank(a, p)  # where each actual id is in P; depth when it is not
    in_top_k = rank < k
    in_read = rank < n_read[:, None]
    add("tokens", group)
    add("actual", group, np.full(len(row), h.n_expert_used))
    add("hits_used", group, in_top_k.sum(axis=1))
    add("hits_depth", group, (rank < h.depth).sum(axis=1))
    add("hits_read", group, in_read.sum(axis=1))
    add("read", group, n_read)
    add("gated", group, h.depth - n_read)
    add("exact", group, in_top_k.all(axis=1) & _member(p[:, :k], a).all(axis=1))
    add("mass_hit", group, (w * in_read).sum(axis=1))
    add("mass", group, w.sum(axis=1))
    is_last = np.ones(len(order), dtype=bool)
    is_last[:-1] = ~same
    keep = order[is_last]
    return {**{k: key[k][keep] for k in _KEYS}, "actual_ids": actual[keep]}


def _sums_numpy(
    trace: Trace, records_per_chunk: int, predictable: np.ndarray, found: Counter[str]
) -> dict[str, np.ndarray]:
    """The numpy engine: the sums of every LayerCounts field by (distance, layer); the control into ``found``."""
    h = trace.header
    sums = {f.name: np.zeros((N_DISTANCES, h.n_layer)) for f in fields(LayerCounts)}
    last = {k: np.empty(0, dtype=h.dtype[k]) for k in _KEYS}
    last["actual_ids"] = np.empty((0, h.n_expert_used), dtype=np.int32)
    for chunk in trace.iter_chunks(records_per_chunk):
        rec = {name: np.ascontiguousarray(chunk[name]) for name in _FIELDS}  # one copy, then fast passes
        _check(h, rec, found, predictable)
        inside = rec["layer"] < h.n_layer
        if not inside.all():
            rec = {name: v[inside] for name, v in rec.items()}
        last = _score(h, rec, last, sums)
    return sums


def _sums_c(
    trace: Trace, records_per_chunk: int, predictable: np.ndarray, found: Counter[str]
) -> dict[str, np.ndarray]:
    """The compiled engine: the same sums, each chunk scored by the kernel straight from its bytes
    (iter_chunks has given each record its distance and bounded it)."""
    kernel = StatsKernel(trace.header, predictable)
    for chunk in trace.iter_chunks(records_per_chunk):
        kernel.feed(chunk)
    found.update({name: int(n) for name, n in zip(ISSUE_COUNTERS, kernel.issues)})
    return {**dict(zip(INT_COUNTERS, kernel.ints)), **dict(zip(FLOAT_COUNTERS, kernel.floats))}


def compute_stats(
    trace: Trace, records_per_chunk: int = TRACE_CHUNK_RECORDS, engine: str = STATS_ENGINE_C
) -> TraceStats:
    """Score every layer of ``trace`` and run the control, reading ``records_per_chunk`` at a time.

    ``engine``: ``"c"`` (the compiled kernel; StatsKernelError if it cannot be built) or
    ``"numpy"``; both give the same counts (the mass sums up to float rounding).
    """
    if engine not in STATS_ENGINES:
        raise ValueError(f"engine must be one of {', '.join(STATS_ENGINES)}, not {engine!r}")
    h = trace.header
    names = [f.name for f in fields(LayerCounts)]
    found: Counter[str] = Counter()
    predictable = np.zeros(1 << 16, dtype=bool)  # by layer (u16): in the header's layer mask
    predictable[sorted(h.layer_mask)] = True
    by_k = (_sums_numpy if engine == STATS_ENGINE_NUMPY else _sums_c)(trace, records_per_chunk, predictable, found)

    def counts(sums: dict[str, np.ndarray], layer: int) -> LayerCounts:
        return LayerCounts(
            **{n: float(sums[n][layer]) if n.startswith("mass") else int(round(sums[n][layer])) for n in names}
        )

    sums = {n: v.sum(axis=0) for n, v in by_k.items()}  # per layer, every distance
    shown = sorted(
        {int(layer) for layer in np.flatnonzero(sums["records"])}
        | {layer for layer in h.layer_mask if layer < h.n_layer}
    )
    layers = {layer: counts(sums, layer) for layer in shown}
    by_distance = {
        k: {int(layer): counts({n: v[k] for n, v in by_k.items()}, int(layer)) for layer in present}
        for k in range(N_DISTANCES)
        if len(present := np.flatnonzero(by_k["records"][k]))
    }
    distances = tuple(k for k in by_distance if k > 0)
    issues = _header_issues(h, distances)
    issues += [f"{found[k]} " + text.format(h=h) for k, text in _ISSUES.items() if found[k]]
    return TraceStats(h, layers, tuple(issues), by_distance)


def compare_routing(
    a: Trace, b: Trace, records_per_chunk: int = TRACE_CHUNK_RECORDS, max_examples: int = 5
) -> list[str]:
    """What differs between the actual routing of two traces of the same tokens (empty: they agree).

    Records are compared in file order: (seq_id, pos, layer) and the set of actual ids.
    """
    shape = [(f, getattr(a.header, f), getattr(b.header, f)) for f in ("n_layer", "n_expert", "n_expert_used")]
    if any(x != y for _, x, y in shape):
        return ["different models: " + ", ".join(f"{f} {x} vs {y}" for f, x, y in shape if x != y)]
    diffs, examples, n_differ = [], [], 0
    if a.n_records != b.n_records:
        diffs.append(f"{a.n_records} vs {b.n_records} records")

    def show(r: np.void) -> str:
        return f"seq {r['seq_id']} pos {r['pos']} layer {r['layer']} actual {sorted(r['actual_ids'].tolist())}"

    chunks = zip(a.iter_chunks(records_per_chunk), b.iter_chunks(records_per_chunk))
    for start, (ca, cb) in zip(count(0, records_per_chunk), chunks):
        m = min(len(ca), len(cb))
        ca, cb = ca[:m], cb[:m]
        differ = (
            (ca["seq_id"] != cb["seq_id"])
            | (ca["pos"] != cb["pos"])
            | (ca["layer"] != cb["layer"])
            | (np.sort(ca["actual_ids"], axis=1) != np.sort(cb["actual_ids"], axis=1)).any(axis=1)
        )
        n_differ += int(differ.sum())
        for i in np.flatnonzero(differ)[: max_examples - len(examples)]:
            examples.append(f"record {start + i}: {show(ca[i])} vs {show(cb[i])}")
    if n_differ:
        diffs.append(f"{n_differ} records differ in (seq_id, pos, layer) or actual ids")
    return diffs + examples
