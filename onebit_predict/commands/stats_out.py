"""How ``onebit-stats rates`` prints (commands/stats.py): the summary, the per-layer table side by
side, ``--json`` and ``--csv``. Printing only: the numbers come from metrics/stats.py."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import sys

from ..metrics.stats import METRICS, LayerCounts, TraceStats
from ..trace import Trace, TraceHeader
from .common import table


def fmt_value(value: int | float | None, kind: str) -> str:
    if value is None:
        return "-"
    return {"pct": f"{100 * value:.1f}", "ratio": f"{value:.2f}", "int": str(value)}[kind]


def columns(h: TraceHeader) -> list[tuple[str, str, str]]:
    """(metric, title, kind) of the single-trace table."""
    return [
        ("tokens", "tokens", "int"),
        ("slot_recall_used", f"slot@{min(h.n_expert_used, h.depth)}%", "pct"),  # recall at min(n_used, depth)
        ("slot_recall_depth", f"slot@{h.depth}%", "pct"),
        ("read_recall", "read%", "pct"),
        ("precision", "prec%", "pct"),
        ("wasted_per_useful", "waste/hit", "ratio"),
        ("exact_match", "exact%", "pct"),
        ("gate_mass_recall", "mass%", "pct"),
        ("candidates_read", "cand_read", "int"),
        ("candidates_gated", "cand_gated", "int"),
        ("baseline_tokens", "base_tok", "int"),
        ("baseline_recall", "base%", "pct"),
    ]


def ahead_label(distance: int | None) -> str:
    return "-" if distance is None else f"L+{distance}"


def summary(trace: Trace, distances: tuple[int, ...]) -> str:
    """The trace's lines above its table; ``distances``: those of its predictions (all layers)."""
    h = trace.header
    margin = "none" if math.isinf(h.margin) else f"{h.margin:g}"
    dropped = f", {trace.dropped_bytes} bytes of a partial record dropped" if trace.dropped_bytes else ""
    state = ", NOT CLOSED CLEANLY" if h.open else ""
    state += ", INCOMPLETE (record writes failed)" if h.incomplete else ""
    return (
        f"{trace.path}: {trace.n_records} records{dropped}{state}\n"
        f"arch {h.arch or '?'} | model {h.model or '?'} | mode {h.mode_name}{' (no attn)' if h.no_attn else ''}"
        f" | depth {h.depth} | margin {margin} | min_read {h.min_read}"
        f" | n_expert {h.n_expert} | n_used {h.n_expert_used}"
        f" | ahead {','.join(ahead_label(k) for k in distances) or '-'}"
        f"{prefetch_summary(h)}"
    )


def consumer_reads(h: TraceHeader) -> str:
    """What the consumer read and how ("reads predicted + at route time, each layer waiting for its
    reads, readahead off"); "" for a trace written before the header said (the predicted experts,
    then the only reads)."""
    reads = " + ".join(what for what, on in (("predicted", h.speculative), ("at route time", h.route)) if on)
    parts = [f"reads {reads}"] if reads else []
    parts += ["each layer waiting for its reads"] if h.wait else []  # the route-time op (ONEBIT_MOE_PREFETCH_WAIT)
    parts += ["readahead off"] if h.random else []
    return f" ({', '.join(parts)})" if parts else ""


WORKER_CALLS = ("read", "populate", "pread")  # the calls whose workers read the bytes (touched_bytes)


def prefetch_summary(h: TraceHeader) -> str:
    """The prefetch consumer's line, or nothing when it was off."""
    if h.prefetch_mode == 0:
        return ""
    cap = f"{h.prefetch_max_bytes} bytes/token" if h.prefetch_max_bytes else "none"
    line = f"\nprefetch {h.prefetch_name}{consumer_reads(h)} | cap {cap}"
    if h.prefetch_name in WORKER_CALLS:
        line += f" | {h.prefetch_threads} workers"
    t = h.prefetch_totals
    if t is None:
        return line + " | totals unknown (the context was not freed cleanly)"
    line += (
        f" | {t.experts} experts, {t.ranges} ranges, {t.bytes} bytes issued{' ahead' if h.route else ''}"
        f" | {t.resident_bytes} bytes already resident | {t.dropped_bytes} bytes dropped by the cap"
    )
    if h.prefetch_name in WORKER_CALLS:
        line += f" | {t.touched_bytes} bytes touched | {t.queue_full} ranges not queued"
    errors = ", ".join(f"errno {e} x{n}" for e, n in t.errors)
    return line + (f" | {t.failed} ranges FAILED ({errors})" if t.failed else " | no failures")


Row = tuple[int | str, int | None, LayerCounts]  # (layer or "total", distance or None, counts)


def table_rows(st: TraceStats) -> list[Row]:
    """The rows of a trace's table, --json and --csv, in order.

    At most one distance: a row per layer (the distance of its predicted records, None where
    it has none) and the total. Several: a row per (layer, distance) group (a layer's
    unpredicted records under None), a total per distance, then the total of all (None).
    """
    ks = st.distances
    if len(ks) <= 1:
        k = ks[0] if ks else None
        rows: list[Row] = [(layer, k if st.layer_distances(layer) else None, c) for layer, c in st.layers.items()]
        return [*rows, ("total", k, st.total)]
    rows = []
    for layer, c in st.layers.items():
        groups = [(k or None, g[layer]) for k, g in st.by_distance.items() if layer in g]
        rows += [(layer, k, counts) for k, counts in groups] if groups else [(layer, None, c)]  # no records
    return [*rows, *(("total", k, st.total_at(k)) for k in ks), ("total", None, st.total)]


def render_one(trace: Trace, st: TraceStats, distances: tuple[int, ...]) -> str:
    cols = columns(trace.header)
    several = len(st.distances) > 1  # then an ahead column; one distance is in the summary

    def ahead_cell(layer: int | str, k: int | None) -> list[str]:
        return [("all" if layer == "total" and k is None else ahead_label(k))] if several else []

    rows = [
        [str(layer), *ahead_cell(layer, k)] + [fmt_value(c.metrics()[m], kind) for m, _, kind in cols]
        for layer, k, c in table_rows(st)
    ]
    titles = ["layer", *(["ahead"] if several else [])] + [t for _, t, _ in cols]
    return summary(trace, distances) + "\n\n" + table(titles, rows)


def render_side_by_side(traces: list[Trace], stats: list[TraceStats], distances: list[tuple[int, ...]]) -> str:
    legend = "\n".join(f"[{i}] {summary(t, ks)}" for i, (t, ks) in enumerate(zip(traces, distances), 1))
    # traces predicting at other distances total other layers: each its own baseline then
    own_base = len({st.distances for st in stats}) > 1
    titles = ["layer"]
    for i, t in enumerate(traces, 1):
        titles += [f"read%[{i}]", f"slot@{min(t.header.n_expert_used, t.header.depth)}%[{i}]"]
        titles += [f"base%[{i}]"] if own_base else []
    titles += [] if own_base else ["base%"]

    def cells(counts: list[LayerCounts | None]) -> list[str]:
        out = []
        for c in counts:
            m = c.metrics() if c is not None else {}
            out += [fmt_value(m.get("read_recall"), "pct"), fmt_value(m.get("slot_recall_used"), "pct")]
            out += [fmt_value(m.get("baseline_recall"), "pct")] if own_base else []
        first = counts[0].metrics() if counts[0] is not None else {}
        return out + ([] if own_base else [fmt_value(first.get("baseline_recall"), "pct")])

    layers = sorted(set().union(*(st.layers for st in stats)))
    rows = [[str(layer)] + cells([st.layers.get(layer) for st in stats]) for layer in layers]
    rows.append(["total"] + cells([st.total for st in stats]))
    return legend + "\n\n" + table(titles, rows)


def header_dict(h: TraceHeader) -> dict:
    d = dataclasses.asdict(h)
    d.update(
        mode=h.mode_name,
        margin=None if math.isinf(h.margin) else h.margin,
        layer_mask=sorted(h.layer_mask),
        no_attn=h.no_attn,
        stats=h.stats,
        open=h.open,
        incomplete=h.incomplete,
        prefetch_mode=h.prefetch_name,
        prefetch_speculative=h.speculative,
        prefetch_route=h.route,
        prefetch_random=h.random,
        prefetch_wait=h.wait,
        prefetch_totals=None if h.prefetch_totals is None else h.prefetch_totals._asdict(),
    )
    return d


def json_trace(t: Trace, st: TraceStats) -> dict:
    """One trace's object: "layers" are table_rows' rows but the totals, "total" the last total, "totals"
    the total of each distance."""
    rows = table_rows(st)
    mask = t.header.layer_mask
    return {
        "path": str(t.path),
        "records": t.n_records,
        "dropped_bytes": t.dropped_bytes,
        "header": header_dict(t.header),
        "distances": list(st.distances),
        "layers": [
            {"layer": layer, "distance": k, "predicted": layer in mask, "records": c.records, **c.metrics()}
            for layer, k, c in rows
            if layer != "total"
        ],
        "total": {"distance": rows[-1][1], "records": st.total.records, **st.total.metrics()},
        "totals": [
            {"distance": k, "records": total.records, **total.metrics()}
            for k, total in ((k, st.total_at(k)) for k in st.distances)
        ],
        "issues": list(st.issues),
    }


def to_json(traces: list[Trace], stats: list[TraceStats], differences: list[str]) -> str:
    objs = [json_trace(t, st) for t, st in zip(traces, stats)]
    return json.dumps({"traces": objs, "routing_differences": differences}, indent=2, allow_nan=False)


def write_csv(traces: list[Trace], stats: list[TraceStats]) -> None:
    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow(["trace", "layer", "distance", "predicted", "records", *METRICS])
    for t, st in zip(traces, stats):
        for layer, k, c in table_rows(st):
            predicted = "" if layer == "total" else int(layer in t.header.layer_mask)
            metrics = ("" if v is None else v for v in c.metrics().values())
            w.writerow([t.path, layer, "" if k is None else k, predicted, c.records, *metrics])
