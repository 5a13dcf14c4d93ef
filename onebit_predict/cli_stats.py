"""onebit-stats: the per-layer hit-rate table of one or more P/A traces.

``onebit-stats TRACE`` prints the header summary and a table per layer with a total line;
``onebit-stats A B ...`` puts the traces side by side (read recall and slot recall per
trace, the previous-token baseline once) after checking that their actual routing agrees.
``--json`` and ``--csv`` write the same numbers to stdout; logs go to stderr.

Exit codes: 0 ok; 1 the consistency control found issues, or the traces' actual routing
disagrees (without ``--force``); 2 usage or input error (missing file, bad header, bad
``--layers``).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import os
import math
import sys
from collections.abc import Sequence

from .constants import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE
from .stats import METRICS, LayerCounts, TraceStats, compare_routing, compute_stats
from .trace import Trace, TraceError, TraceHeader

logger = logging.getLogger("onebit_predict")


def parse_layers(text: str) -> frozenset[int]:
    """``1,3-5`` -> {1, 3, 4, 5}; argparse.ArgumentTypeError on anything else."""
    layers: set[int] = set()
    for item in text.split(","):
        lo, sep, hi = item.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise argparse.ArgumentTypeError(f"'{item.strip()}' is not N or A-B")
        first, last = int(lo), int(hi) if sep else int(lo)
        if first > last:
            raise argparse.ArgumentTypeError(f"'{item.strip()}' is a reversed range")
        layers.update(range(first, last + 1))
    return frozenset(layers)


def _fmt(value: int | float | None, kind: str) -> str:
    if value is None:
        return "-"
    return {"pct": f"{100 * value:.1f}", "ratio": f"{value:.2f}", "int": str(value)}[kind]


def _columns(h: TraceHeader) -> list[tuple[str, str, str]]:
    """(metric, title, kind) of the single-trace table."""
    return [
        ("tokens", "tokens", "int"),
        ("slot_recall_used", f"slot@{h.n_expert_used}%", "pct"),
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


def _table(titles: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [titles, *rows]) for i in range(len(titles))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [titles, *rows])


def _summary(trace: Trace) -> str:
    h = trace.header
    margin = "none" if math.isinf(h.margin) else f"{h.margin:g}"
    dropped = f", {trace.dropped_bytes} bytes of a partial record dropped" if trace.dropped_bytes else ""
    return (
        f"{trace.path}: {trace.n_records} records{dropped}\n"
        f"arch {h.arch or '?'} | model {h.model or '?'} | mode {h.mode_name}{' (no attn)' if h.no_attn else ''}"
        f" | depth {h.depth} | margin {margin} | min_read {h.min_read}"
        f" | n_expert {h.n_expert} | n_used {h.n_expert_used}"
    )


def _render_one(trace: Trace, st: TraceStats) -> str:
    cols = _columns(trace.header)
    rows = [[str(l)] + [_fmt(c.metrics()[m], k) for m, _, k in cols] for l, c in st.layers.items()]
    rows.append(["total"] + [_fmt(st.total.metrics()[m], k) for m, _, k in cols])
    return _summary(trace) + "\n\n" + _table(["layer"] + [t for _, t, _ in cols], rows)


def _render_side_by_side(traces: list[Trace], stats: list[TraceStats]) -> str:
    legend = "\n".join(f"[{i}] {_summary(t)}" for i, t in enumerate(traces, 1))
    titles = ["layer"]
    for i, t in enumerate(traces, 1):
        titles += [f"read%[{i}]", f"slot@{t.header.n_expert_used}%[{i}]"]
    titles.append("base%")

    def cells(counts: list[LayerCounts | None]) -> list[str]:
        out = []
        for c in counts:
            m = c.metrics() if c is not None else {}
            out += [_fmt(m.get("read_recall"), "pct"), _fmt(m.get("slot_recall_used"), "pct")]
        first = counts[0].metrics() if counts[0] is not None else {}
        return out + [_fmt(first.get("baseline_recall"), "pct")]

    layers = sorted(set().union(*(st.layers for st in stats)))
    rows = [[str(l)] + cells([st.layers.get(l) for st in stats]) for l in layers]
    rows.append(["total"] + cells([st.total for st in stats]))
    return legend + "\n\n" + _table(titles, rows)


def _header_dict(h: TraceHeader) -> dict:
    d = dataclasses.asdict(h)
    d.update(
        mode=h.mode_name,
        margin=None if math.isinf(h.margin) else h.margin,
        layer_mask=sorted(h.layer_mask),
        no_attn=h.no_attn,
        stats=h.stats,
    )
    return d


def _json(traces: list[Trace], stats: list[TraceStats], differences: list[str]) -> str:
    objs = [
        {
            "path": str(t.path),
            "records": t.n_records,
            "dropped_bytes": t.dropped_bytes,
            "header": _header_dict(t.header),
            "layers": [
                {"layer": l, "predicted": l in t.header.layer_mask, "records": c.records, **c.metrics()}
                for l, c in st.layers.items()
            ],
            "total": {"records": st.total.records, **st.total.metrics()},
            "issues": list(st.issues),
        }
        for t, st in zip(traces, stats)
    ]
    return json.dumps({"traces": objs, "routing_differences": differences}, indent=2, allow_nan=False)


def _csv(traces: list[Trace], stats: list[TraceStats]) -> None:
    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow(["trace", "layer", "predicted", "records", *METRICS])
    for t, st in zip(traces, stats):
        rows = [(l, int(l in t.header.layer_mask), c) for l, c in st.layers.items()]
        for layer, predicted, c in [*rows, ("total", "", st.total)]:
            w.writerow([t.path, layer, predicted, c.records, *("" if v is None else v for v in c.metrics().values())])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="onebit-stats",
        description="Per-layer hit rates of P/A traces (docs/trace-format.md), with a consistency control.",
        epilog="exit codes: 0 ok, 1 consistency check failed, 2 usage or input error",
    )
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace files written with ONEBIT_MOE_PREDICT_OUT")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="write JSON to stdout")
    out.add_argument("--csv", action="store_true", help="write CSV to stdout")
    p.add_argument("--layers", type=parse_layers, metavar="LIST", help="only these layers, e.g. 1,3-5")
    p.add_argument("--force", action="store_true", help="compare traces whose actual routing disagrees")
    return p


def _run(args: argparse.Namespace) -> int:
    try:
        traces = [Trace.open(path) for path in args.traces]
    except (OSError, TraceError) as e:
        logger.error("%s", e)
        return EXIT_USAGE
    if args.layers is not None:
        for t in traces:
            beyond = sorted(l for l in args.layers if l >= t.header.n_layer)
            if beyond:
                logger.error("--layers %s: %s has layers 0..%d", beyond, t.path, t.header.n_layer - 1)
                return EXIT_USAGE
    stats = [compute_stats(t) for t in traces]
    if args.layers is not None:
        stats = [st.select(args.layers) for st in stats]

    rc = EXIT_OK
    for t, st in zip(traces, stats):
        for issue in st.issues:
            logger.error("%s: consistency: %s", t.path, issue)
            rc = EXIT_CHECK_FAILED
    differences = [f"{t.path} vs {traces[0].path}: {d}" for t in traces[1:] for d in compare_routing(traces[0], t)]
    for d in differences:
        logger.error("actual routing differs: %s", d)
    if differences and not args.force:
        logger.error("the traces do not describe the same tokens' routing (--force accepts this)")
        rc = EXIT_CHECK_FAILED

    if args.json:
        print(_json(traces, stats, differences))
    elif args.csv:
        _csv(traces, stats)
    elif len(traces) == 1:
        print(_render_one(traces[0], stats[0]))
    else:
        print(_render_side_by_side(traces, stats))
    return rc


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-stats``; return the exit code."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("onebit-stats: %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    propagate, level = logger.propagate, logger.level
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        try:
            args = _parser().parse_args(argv)
        except SystemExit as e:  # argparse: --help (0) or a usage error (2)
            return EXIT_OK if e.code in (0, None) else EXIT_USAGE
        try:
            return _run(args)
        except BrokenPipeError:  # the reader (head, less) left: not an error of ours
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_OK
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        logger.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
