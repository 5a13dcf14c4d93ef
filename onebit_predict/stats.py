"""Hit rates of a P/A trace, per layer and in total, and a consistency control of the trace.

With A the actual experts of a row, P its ranked prediction and R = P[:n_read] the
candidates read: slot recall@k = |A ∩ P[:k]| / |A| (k = n_expert_used, depth), read recall
= |A ∩ R| / |A|, precision = |A ∩ R| / |R|, wasted reads per useful one = (|R| - |A ∩ R|) /
|A ∩ R|, exact match = set(P[:n_expert_used]) == set(A), gate-mass recall = weight of A ∩ R
/ weight of A, previous-token baseline = |A ∩ A_prev| / |A| with A_prev the same layer's A
at pos - 1 of the same sequence.

- which rows are scored: DECODE rows (flag bit 1) of layers 1..n_layer-1 (layer 0 has no
  predictor and is never scored) that are not the first token of their sequence. A row is the first token when the latest earlier record
  of the same (seq_id, layer) -- latest by (step, pos) -- is not at pos - 1, or does not
  exist. So pos 0 is always a first token, and so is a sequence restarted or shifted
  under a reused seq_id. The same rows are scored for the previous-token baseline (every
  layer that has records, predicted or not) and, when PREDICTED, for the prediction metrics, so both compare the same
  tokens. Prefill rows are never scored but do provide the previous token.
- every ratio is micro-averaged: a sum over rows divided by a sum over rows (total hits /
  total actual slots), never a mean of per-row ratios. Totals are the same sums over layers.
- a ratio whose denominator is zero is ``None`` (printed ``-``): nothing was scored.
  ``wasted_per_useful`` is also ``None`` when reads were made but none was useful.

Everything is computed with numpy chunk by chunk: per-layer counters, plus the last record
of each (seq_id, layer) carried from one chunk to the next for the baseline.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, fields
from itertools import count

import numpy as np

from .constants import MODE_OFF, TRACE_CHUNK_RECORDS, TRACE_FLAG_DECODE, TRACE_FLAG_PREDICTED
from .policy import n_read_rows
from .trace import Trace, TraceHeader


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
    """The counts of every layer that has records or is predicted, and the control's issues."""

    header: TraceHeader
    layers: dict[int, LayerCounts]  # ascending layer
    issues: tuple[str, ...]  # empty when the trace is consistent

    @property
    def total(self) -> LayerCounts:
        return sum(self.layers.values(), LayerCounts())

    def select(self, layers: Iterable[int]) -> TraceStats:
        """The same stats restricted to ``layers`` (the total follows; the issues stay)."""
        keep = set(layers)
        return TraceStats(self.header, {l: c for l, c in self.layers.items() if l in keep}, self.issues)


def _member(a: np.ndarray, b: np.ndarray, b_valid: np.ndarray | None = None) -> np.ndarray:
    """``out[i, j]``: ``a[i, j]`` is among the (valid) entries of ``b[i]``."""
    eq = a[:, :, None] == b[:, None, :]
    if b_valid is not None:
        eq &= b_valid[:, None, :]
    return eq.any(axis=2)


def _has_dup(ids: np.ndarray) -> np.ndarray:
    s = np.sort(ids, axis=1)
    return (s[:, 1:] == s[:, :-1]).any(axis=1)


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


def _header_issues(h: TraceHeader) -> list[str]:
    issues = []
    if 0 in h.layer_mask:
        issues.append("the header's layer mask includes layer 0, which has no layer before it")
    beyond = sorted(l for l in h.layer_mask if l >= h.n_layer)
    if beyond:
        issues.append(f"the header's layer mask includes layers {beyond} >= n_layer ({h.n_layer})")
    expected = min(h.depth_requested, h.n_expert) if h.depth_requested > 0 else h.n_expert_used
    if h.depth != expected:
        issues.append(f"header depth {h.depth} does not follow depth_requested {h.depth_requested} (expected {expected})")
    return issues


def _check(h: TraceHeader, rec: np.ndarray, found: Counter[str]) -> None:
    """Count the control's findings in one chunk of records."""
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
    found["pred_mask"] += int((predicted & ~np.isin(rec["layer"], list(h.layer_mask))).sum())
    found["pred_range"] += int(((pr < 0) | (pr >= h.n_expert)).any(axis=1).sum())
    found["pred_dup"] += int(_has_dup(pr).sum())
    found["pred_unranked"] += int((~(pl[:, 1:] <= pl[:, :-1]).all(axis=1) | np.isnan(pl[:, 0])).sum())
    found["pred_n_read"] += int((n_read[predicted] != n_read_rows(pl, h.margin, h.min_read)).sum())


def _score(h: TraceHeader, rec: np.ndarray, last: np.ndarray, sums: dict[str, np.ndarray]) -> np.ndarray:
    """Add one chunk's scored rows to ``sums``; return the new last record of each (seq, layer).

    ``last`` holds the previous chunks' last record of each (seq_id, layer); it is sorted in
    with the chunk so that a row's previous token is simply the row before it.
    """

    def add(name: str, layer: np.ndarray, values: np.ndarray | None = None) -> None:
        sums[name] += np.bincount(layer, weights=values, minlength=h.n_layer)

    add("records", rec["layer"])
    both = np.concatenate([last, rec])
    order = np.lexsort((both["pos"], both["step"], both["layer"], both["seq_id"]))
    s = both[order]
    is_new = order >= len(last)
    same = (s["seq_id"][1:] == s["seq_id"][:-1]) & (s["layer"][1:] == s["layer"][:-1])
    follows = same & (s["pos"][1:].astype(np.int64) == s["pos"][:-1].astype(np.int64) + 1)
    scored = np.zeros(len(s), dtype=bool)
    scored[1:] = follows
    scored &= is_new & ((s["flags"] & TRACE_FLAG_DECODE) != 0) & (s["layer"] != 0)
    rows, prev = s[scored], s["actual_ids"][np.flatnonzero(scored) - 1]

    add("base_tokens", rows["layer"])
    add("base_actual", rows["layer"], np.full(len(rows), h.n_expert_used))
    add("base_hits", rows["layer"], _member(rows["actual_ids"], prev).sum(axis=1))

    pr = rows[(rows["flags"] & TRACE_FLAG_PREDICTED) != 0]
    layer, a, p = pr["layer"], pr["actual_ids"], pr["pred_ids"]
    w = pr["actual_w"].astype(np.float64)
    n_read = np.minimum(pr["n_read"], h.depth)
    k = min(h.n_expert_used, h.depth)
    in_top_k = _member(a, p[:, :k])
    in_read = _member(a, p, np.arange(h.depth) < n_read[:, None])
    add("tokens", layer)
    add("actual", layer, np.full(len(pr), h.n_expert_used))
    add("hits_used", layer, in_top_k.sum(axis=1))
    add("hits_depth", layer, _member(a, p).sum(axis=1))
    add("hits_read", layer, in_read.sum(axis=1))
    add("read", layer, n_read)
    add("gated", layer, h.depth - n_read)
    add("exact", layer, in_top_k.all(axis=1) & _member(p[:, :k], a).all(axis=1))
    add("mass_hit", layer, (w * in_read).sum(axis=1))
    add("mass", layer, w.sum(axis=1))
    is_last = np.ones(len(s), dtype=bool)
    is_last[:-1] = ~same
    return s[is_last]


def compute_stats(trace: Trace, records_per_chunk: int = TRACE_CHUNK_RECORDS) -> TraceStats:
    """Score every layer of ``trace`` and run the control, reading ``records_per_chunk`` at a time."""
    h = trace.header
    names = [f.name for f in fields(LayerCounts)]
    sums = {name: np.zeros(h.n_layer) for name in names}
    found: Counter[str] = Counter()
    last = np.empty(0, dtype=h.dtype)
    for chunk in trace.iter_chunks(records_per_chunk):
        _check(h, chunk, found)
        last = _score(h, chunk[chunk["layer"] < h.n_layer], last, sums)
    shown = sorted({int(l) for l in np.flatnonzero(sums["records"])} | {l for l in h.layer_mask if l < h.n_layer})
    layers = {
        l: LayerCounts(**{n: float(sums[n][l]) if n.startswith("mass") else int(round(sums[n][l])) for n in names})
        for l in shown
    }
    issues = _header_issues(h) + [f"{found[k]} " + text.format(h=h) for k, text in _ISSUES.items() if found[k]]
    return TraceStats(h, layers, tuple(issues))


def compare_routing(a: Trace, b: Trace, records_per_chunk: int = TRACE_CHUNK_RECORDS,
                    max_examples: int = 5) -> list[str]:
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
            (ca["seq_id"] != cb["seq_id"]) | (ca["pos"] != cb["pos"]) | (ca["layer"] != cb["layer"])
            | (np.sort(ca["actual_ids"], axis=1) != np.sort(cb["actual_ids"], axis=1)).any(axis=1)
        )
        n_differ += int(differ.sum())
        for i in np.flatnonzero(differ)[: max_examples - len(examples)]:
            examples.append(f"record {start + i}: {show(ca[i])} vs {show(cb[i])}")
    if n_differ:
        diffs.append(f"{n_differ} records differ in (seq_id, pos, layer) or actual ids")
    return diffs + examples
