"""A trace's decode routing as per-layer numpy arrays: what replay and simulate consume.

``load_routing(trace)`` reads the trace chunk by chunk (``Trace.iter_chunks``) keeping only
the fields it needs, then builds, for every layer that has decode rows:

- the tokens: every DECODE row (docs/trace-format.md, flag bit 1) is a token, keyed by
  (step, seq_id, pos); tokens are numbered in decode order: by step, then by their first
  appearance in the step. A step holding several decode rows (several sequences in one
  batch) is thus modelled as those rows decoded one after another. Prefill rows are not
  tokens: they are neither replayed nor timed, but they provide the previous token.
- ``actual``: the experts the layer used for each of its tokens (A);
- ``trace_pred``: the trace's read set R = pred_ids[:n_read] (the candidates llama.cpp
  would read), padded with -1; all -1 on rows that are not PREDICTED;
- ``prev``: A of the same layer at the previous token of the same sequence (the latest
  earlier record of the same (seq_id, layer), by (step, pos), when it is at pos - 1: the
  rule of onebit_predict.stats, prefill rows included), or all -1 when there is none.

A token lacks a layer only where llama.cpp did not compute the row there (the last layer
computes output rows only); such a layer is skipped for that token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..constants import MODE_OFF, TRACE_CHUNK_RECORDS, TRACE_FLAG_DECODE, TRACE_FLAG_PREDICTED
from ..trace import Trace, TraceError, TraceHeader

_FIELDS = ("step", "seq_id", "pos", "layer", "n_read", "flags", "actual_ids", "pred_ids")


@dataclass(frozen=True, eq=False)
class LayerRouting:
    """The decode tokens of one layer, in decode order."""

    layer: int
    token: np.ndarray  # (n,) int64: global token numbers, ascending
    actual: np.ndarray  # (n, n_expert_used) int32: A
    trace_pred: np.ndarray  # (n, depth) int32: the trace's read set R, -1 padded
    prev: np.ndarray  # (n, n_expert_used) int32: A at the previous token, -1 when none

    @property
    def n(self) -> int:
        return len(self.token)


@dataclass(frozen=True, eq=False)
class Routing:
    """Every layer's decode routing, and the layers the trace's predictor predicted."""

    header: TraceHeader
    n_tokens: int
    layers: dict[int, LayerRouting]  # ascending layer; only layers with decode rows
    predicted_layers: frozenset[int]  # layers (>= 1) the trace's predictor covers

    @property
    def has_predictor(self) -> bool:
        """The trace holds router or block predictions (its mode is not off)."""
        return self.header.mode != MODE_OFF

    def local_index(self, layer: int) -> np.ndarray:
        """``(n_tokens,)``: the row of each token in ``layers[layer]``, -1 where it has none."""
        out = np.full(self.n_tokens, -1, dtype=np.int64)
        lr = self.layers.get(layer)
        if lr is not None:
            out[lr.token] = np.arange(lr.n)
        return out


def _read_fields(trace: Trace, records_per_chunk: int) -> dict[str, np.ndarray]:
    parts: dict[str, list[np.ndarray]] = {f: [] for f in _FIELDS}
    for chunk in trace.iter_chunks(records_per_chunk):
        for f in _FIELDS:
            parts[f].append(np.ascontiguousarray(chunk[f]))
    h = trace.header
    if not parts["step"]:
        return {f: np.empty((0,) + h.dtype[f].shape, dtype=h.dtype[f].base) for f in _FIELDS}
    return {f: np.concatenate(v) for f, v in parts.items()}


def _validate(h: TraceHeader, rec: dict[str, np.ndarray]) -> None:
    """Refuse what replay cannot model (TraceError): ids out of range, duplicates, bad layers."""
    if (rec["layer"] >= h.n_layer).any():
        raise TraceError(f"records with layer >= n_layer ({h.n_layer}): run onebit-stats on the trace")
    a = rec["actual_ids"]
    if ((a < 0) | (a >= h.n_expert)).any():
        raise TraceError(f"actual ids outside [0, {h.n_expert}): run onebit-stats on the trace")
    s = np.sort(a, axis=1)
    if (s[:, 1:] == s[:, :-1]).any():
        raise TraceError("records with a duplicate actual id: run onebit-stats on the trace")
    predicted = (rec["flags"] & TRACE_FLAG_PREDICTED) != 0
    p = rec["pred_ids"][predicted]
    if ((p < 0) | (p >= h.n_expert)).any():
        raise TraceError(f"predicted ids outside [0, {h.n_expert}): run onebit-stats on the trace")


def load_routing(trace: Trace, records_per_chunk: int = TRACE_CHUNK_RECORDS) -> Routing:
    """Read ``trace`` into per-layer decode arrays (TraceError on records it cannot model)."""
    h = trace.header
    rec = _read_fields(trace, records_per_chunk)
    _validate(h, rec)
    n_rec = len(rec["step"])

    # previous token: sort the keys, a row's previous token is the row before it when that
    # row is the same (seq_id, layer) at pos - 1 (the rule of stats.py)
    order = np.lexsort((rec["pos"], rec["step"], rec["layer"], rec["seq_id"]))
    s_seq, s_layer, s_pos = rec["seq_id"][order], rec["layer"][order], rec["pos"][order]
    follows = (
        (s_seq[1:] == s_seq[:-1])
        & (s_layer[1:] == s_layer[:-1])
        & (s_pos[1:].astype(np.int64) == s_pos[:-1].astype(np.int64) + 1)
    )
    prev = np.full((n_rec, h.n_expert_used), -1, dtype=np.int32)
    at = np.flatnonzero(follows) + 1
    prev[order[at]] = rec["actual_ids"][order[at - 1]]

    decode = np.flatnonzero((rec["flags"] & TRACE_FLAG_DECODE) != 0)
    key = np.zeros(len(decode), dtype=[("step", "<u4"), ("seq_id", "<i4"), ("pos", "<i4")])
    for f in ("step", "seq_id", "pos"):
        key[f] = rec[f][decode]
    uniq, first, inverse = np.unique(key, return_index=True, return_inverse=True)
    # number the tokens by first appearance (file order is step ascending, rows in ubatch order)
    rank = np.empty(len(uniq), dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(len(uniq))
    token_of = rank[inverse.reshape(-1)]

    read = np.minimum(rec["n_read"][decode], h.depth).astype(np.int64)
    predicted = (rec["flags"][decode] & TRACE_FLAG_PREDICTED) != 0
    pred = rec["pred_ids"][decode].copy()
    pred[np.arange(h.depth)[None, :] >= read[:, None]] = -1
    pred[~predicted] = -1

    layers: dict[int, LayerRouting] = {}
    d_layer = rec["layer"][decode]
    for layer in np.unique(d_layer).tolist():
        sel = np.flatnonzero(d_layer == layer)
        sel = sel[np.argsort(token_of[sel], kind="stable")]
        tok = token_of[sel]
        if (tok[1:] == tok[:-1]).any():
            dup = int(tok[1:][tok[1:] == tok[:-1]][0])
            raise TraceError(f"layer {layer} has two records of the same token (step, seq_id, pos) #{dup}")
        rows = decode[sel]
        layers[int(layer)] = LayerRouting(
            int(layer), tok, rec["actual_ids"][rows].astype(np.int32), pred[sel].astype(np.int32), prev[rows]
        )
    if h.mode != MODE_OFF:
        predicted_layers = frozenset(layer for layer in h.layer_mask if 1 <= layer < h.n_layer)
    else:
        predicted_layers = frozenset(range(1, h.n_layer))
    return Routing(h, len(uniq), layers, predicted_layers)
