"""onebit-stats: the hit rates of P/A traces, and the cache model on them, as one command family.

``onebit-stats [rates] TRACE [TRACE ...]`` (the default subcommand, ``rates`` may be left
out) prints the header summary and a table per layer with a total line; several traces go
side by side (read recall and slot recall per trace, the previous-token baseline once, or
per trace when their lookahead distances differ) after checking that their actual routing
agrees. ``--json`` and ``--csv`` write the same numbers to stdout; logs go to stderr.

Lookahead distance: the summary says how many layers ahead the trace's predictions were made
(``ahead L+1``: layer l predicted from layer l-1's graph). A trace with predictions at several
distances is scored per distance: its table gains an ``ahead`` column, a row per (layer,
distance) and a total per distance (then ``all``); --json and --csv carry the distance of
every row either way.

``onebit-stats replay TRACE --slots N ...`` (commands/replay.py) and ``onebit-stats simulate
TRACE ...`` (commands/simulate.py) are the expert-cache replay and the decode-time model.

Which subcommand runs: a first argument ``rates``, ``replay`` or ``simulate`` names it,
except when a file of that name exists in the current directory and the command line lacks
the subcommand's required option (``--slots`` for replay, ``--bandwidth`` for simulate;
rates has none): the first argument is then that trace file, so ``onebit-stats replay``
reads a trace named ``replay`` and ``onebit-stats replay replay --slots 2`` replays it.
Any other first argument is a trace (or an option) of ``rates``.

Exit codes (commands/common.py): 0 ok; 1 the consistency control found issues, or the
traces' actual routing disagrees (without ``--force``); 2 usage or input error (missing
file, bad header, bad ``--layers``, a stats kernel that cannot be built).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from ..constants import EXIT_CHECK_FAILED, EXIT_OK, STATS_ENGINE_C, STATS_ENGINES
from ..metrics.stats import METRICS, LayerCounts, TraceStats, compare_routing, compute_stats
from ..metrics.stats_kernel import StatsKernelError
from ..trace import Trace, TraceHeader
from . import plot_memory, replay, simulate
from .common import check_layers, layers_parent, output_parent, run_command, table, trace_parent

logger = logging.getLogger("onebit_predict")
PROG = "onebit-stats"
DEFAULT = "rates"
# subcommand -> the option it cannot run without (None: none), for the rule in the docstring
SUBCOMMANDS: dict[str, str | None] = {
    DEFAULT: None,
    "replay": "--slots",
    "simulate": "--bandwidth",
    "plot-memory": None,
}


def _fmt(value: int | float | None, kind: str) -> str:
    if value is None:
        return "-"
    return {"pct": f"{100 * value:.1f}", "ratio": f"{value:.2f}", "int": str(value)}[kind]


def _columns(h: TraceHeader) -> list[tuple[str, str, str]]:
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


def _ahead(distance: int | None) -> str:
    return "-" if distance is None else f"L+{distance}"


def _summary(trace: Trace, distances: tuple[int, ...]) -> str:
    """The trace's lines above its table; ``distances``: those of its predictions (all layers)."""
    h = trace.header
    margin = "none" if math.isinf(h.margin) else f"{h.margin:g}"
    dropped = f", {trace.dropped_bytes} bytes of a partial record dropped" if trace.dropped_bytes else ""
    return (
        f"{trace.path}: {trace.n_records} records{dropped}\n"
        f"arch {h.arch or '?'} | model {h.model or '?'} | mode {h.mode_name}{' (no attn)' if h.no_attn else ''}"
        f" | depth {h.depth} | margin {margin} | min_read {h.min_read}"
        f" | n_expert {h.n_expert} | n_used {h.n_expert_used}"
        f" | ahead {','.join(_ahead(k) for k in distances) or '-'}"
        f"{_prefetch_summary(h)}"
    )


def _prefetch_summary(h: TraceHeader) -> str:
    """The prefetch consumer's line, or nothing when it was off."""
    if h.prefetch_mode == 0:
        return ""
    cap = f"{h.prefetch_max_bytes} bytes/token" if h.prefetch_max_bytes else "none"
    line = f"\nprefetch {h.prefetch_name} | cap {cap}"
    if h.prefetch_name == "read":
        line += f" | {h.prefetch_threads} workers"
    t = h.prefetch_totals
    if t is None:
        return line + " | totals unknown (the context was not freed cleanly)"
    line += (
        f" | {t.experts} experts, {t.ranges} ranges, {t.bytes} bytes issued"
        f" | {t.resident_bytes} bytes already resident | {t.dropped_bytes} bytes dropped by the cap"
    )
    if h.prefetch_name == "read":
        line += f" | {t.touched_bytes} bytes touched | {t.queue_full} ranges not queued"
    errors = ", ".join(f"errno {e} x{n}" for e, n in t.errors)
    return line + (f" | {t.failed} ranges FAILED ({errors})" if t.failed else " | no failures")


Row = tuple[int | str, int | None, LayerCounts]  # (layer or "total", distance or None, counts)


def _rows(st: TraceStats) -> list[Row]:
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


def _render_one(trace: Trace, st: TraceStats, distances: tuple[int, ...]) -> str:
    cols = _columns(trace.header)
    several = len(st.distances) > 1  # then an ahead column; one distance is in the summary

    def ahead(layer: int | str, k: int | None) -> list[str]:
        return [("all" if layer == "total" and k is None else _ahead(k))] if several else []

    rows = [
        [str(layer), *ahead(layer, k)] + [_fmt(c.metrics()[m], kind) for m, _, kind in cols]
        for layer, k, c in _rows(st)
    ]
    titles = ["layer", *(["ahead"] if several else [])] + [t for _, t, _ in cols]
    return _summary(trace, distances) + "\n\n" + table(titles, rows)


def _render_side_by_side(traces: list[Trace], stats: list[TraceStats], distances: list[tuple[int, ...]]) -> str:
    legend = "\n".join(f"[{i}] {_summary(t, ks)}" for i, (t, ks) in enumerate(zip(traces, distances), 1))
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
            out += [_fmt(m.get("read_recall"), "pct"), _fmt(m.get("slot_recall_used"), "pct")]
            out += [_fmt(m.get("baseline_recall"), "pct")] if own_base else []
        first = counts[0].metrics() if counts[0] is not None else {}
        return out + ([] if own_base else [_fmt(first.get("baseline_recall"), "pct")])

    layers = sorted(set().union(*(st.layers for st in stats)))
    rows = [[str(layer)] + cells([st.layers.get(layer) for st in stats]) for layer in layers]
    rows.append(["total"] + cells([st.total for st in stats]))
    return legend + "\n\n" + table(titles, rows)


def _header_dict(h: TraceHeader) -> dict:
    d = dataclasses.asdict(h)
    d.update(
        mode=h.mode_name,
        margin=None if math.isinf(h.margin) else h.margin,
        layer_mask=sorted(h.layer_mask),
        no_attn=h.no_attn,
        stats=h.stats,
        prefetch_mode=h.prefetch_name,
        prefetch_totals=None if h.prefetch_totals is None else h.prefetch_totals._asdict(),
    )
    return d


def _json_trace(t: Trace, st: TraceStats) -> dict:
    """One trace's object: "layers" are _rows' rows but the totals, "total" the last total, "totals"
    the total of each distance."""
    rows = _rows(st)
    mask = t.header.layer_mask
    return {
        "path": str(t.path),
        "records": t.n_records,
        "dropped_bytes": t.dropped_bytes,
        "header": _header_dict(t.header),
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


def _json(traces: list[Trace], stats: list[TraceStats], differences: list[str]) -> str:
    objs = [_json_trace(t, st) for t, st in zip(traces, stats)]
    return json.dumps({"traces": objs, "routing_differences": differences}, indent=2, allow_nan=False)


def _csv(traces: list[Trace], stats: list[TraceStats]) -> None:
    w = csv.writer(sys.stdout, lineterminator="\n")
    w.writerow(["trace", "layer", "distance", "predicted", "records", *METRICS])
    for t, st in zip(traces, stats):
        for layer, k, c in _rows(st):
            predicted = "" if layer == "total" else int(layer in t.header.layer_mask)
            metrics = ("" if v is None else v for v in c.metrics().values())
            w.writerow([t.path, layer, "" if k is None else k, predicted, c.records, *metrics])


def _rates_options(p: argparse.ArgumentParser) -> None:
    """The options of ``onebit-stats rates`` (TRACE..., --layers, --json/--csv come from the parents)."""
    p.add_argument("--force", action="store_true", help="compare traces whose actual routing disagrees")
    p.add_argument(
        "--engine",
        choices=STATS_ENGINES,
        default=STATS_ENGINE_C,
        help="c: the compiled kernel (default, built once with cffi); numpy: the slower reference",
    )


def rates(args: argparse.Namespace) -> int:
    """``onebit-stats [rates]``: the per-layer hit-rate table of one or more traces."""
    traces = [Trace.open(path) for path in args.traces]
    for t in traces:
        check_layers(args.layers, t.header.n_layer, t.path)
    try:
        stats = [compute_stats(t, engine=args.engine) for t in traces]
    except StatsKernelError as e:
        raise StatsKernelError(f"{e} (--engine numpy needs no compiler)") from e
    distances = [st.distances for st in stats]
    if args.layers is not None:
        stats = [st.select(args.layers) for st in stats]  # the summary still gives every distance

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
        print(_render_one(traces[0], stats[0], distances[0]))
    else:
        print(_render_side_by_side(traces, stats, distances))
    return rc


def build_parser() -> argparse.ArgumentParser:
    """``onebit-stats {rates,replay,simulate}``: one parser, a function per subcommand (``func``)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Per-layer hit rates of P/A traces (docs/trace-format.md), with a consistency control, and the "
        "expert-cache model on them (docs/cost-model.md). 'onebit-stats TRACE ...' is 'onebit-stats "
        "rates TRACE ...'; a trace file named like a subcommand is read as a trace unless the "
        "subcommand's required option is given.",
        epilog="exit codes: 0 ok, 1 consistency check failed, 2 usage or input error",
    )
    sub = p.add_subparsers(dest="command", metavar="{rates,replay,simulate,plot-memory}", required=True)
    sp = sub.add_parser(
        DEFAULT,
        prog=PROG,
        parents=[trace_parent(many=True), output_parent(), layers_parent()],
        help="per-layer hit rates of one or more traces (the default)",
        description="Per-layer hit rates of P/A traces (docs/trace-format.md), with a consistency control.",
        epilog="exit codes: 0 ok, 1 consistency check failed, 2 usage or input error",
    )
    _rates_options(sp)
    sp.set_defaults(func=rates)
    sp = sub.add_parser(
        "replay",
        parents=[trace_parent(), output_parent(), layers_parent()],
        help="expert-cache hit rates with N slots per layer",
        description=replay.DESCRIPTION,
        epilog=replay.EPILOG,
    )
    replay.configure(sp)
    sp.set_defaults(func=replay.run)
    sp = sub.add_parser(
        "simulate",
        parents=[trace_parent(), output_parent()],
        help="decode-time model of a streamed expert pipeline",
        description=simulate.DESCRIPTION,
        epilog=simulate.EPILOG,
    )
    simulate.configure(sp)
    sp.set_defaults(func=simulate.run)
    sp = sub.add_parser(
        "plot-memory",
        parents=[output_parent()],
        help="decode tok/s against the memory limit from onebit-bench --memory-limit reports",
        description=plot_memory.DESCRIPTION,
        epilog=plot_memory.EPILOG,
    )
    plot_memory.configure(sp)
    sp.set_defaults(func=plot_memory.run)
    return p


def with_subcommand(argv: Sequence[str]) -> list[str]:
    """argv with its subcommand first: the rule of the module docstring."""
    argv = list(argv)
    if argv and argv[0] in ("-h", "--help"):
        return argv
    if argv and argv[0] in SUBCOMMANDS:
        required = SUBCOMMANDS[argv[0]]
        given = required is not None and any(a == required or a.startswith(required + "=") for a in argv[1:])
        if given or not Path(argv[0]).is_file():
            return argv
    return [DEFAULT, *argv]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-stats``; return the exit code."""
    args_in = with_subcommand(sys.argv[1:] if argv is None else argv)
    prog = PROG if args_in[:1] in ([DEFAULT], ["-h"], ["--help"]) else f"{PROG} {args_in[0]}"
    return run_command(prog, build_parser(), lambda args: args.func(args), args_in)


if __name__ == "__main__":
    sys.exit(main())
