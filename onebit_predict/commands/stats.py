"""onebit-stats: the per-layer hit-rate table of one or more P/A traces.

``onebit-stats TRACE`` prints the header summary and a table per layer with a total line;
``onebit-stats A B ...`` puts the traces side by side (read recall and slot recall per
trace, the previous-token baseline once) after checking that their actual routing agrees.
``--json`` and ``--csv`` write the same numbers to stdout; logs go to stderr.
``onebit-stats replay ...`` and ``onebit-stats simulate ...`` (a first argument of exactly
that word) run onebit_predict.cli_replay and onebit_predict.cli_simulate instead.

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
import math
import sys
from collections.abc import Sequence

from .constants import (
    EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, SIM_SUBCOMMANDS, STATS_ENGINE_C, STATS_ENGINES,
)
from .cli_common import run_command
from .stats import METRICS, LayerCounts, TraceStats, compare_routing, compute_stats
from .stats_kernel import StatsKernelError
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
    line += (f" | {t.experts} experts, {t.ranges} ranges, {t.bytes} bytes issued"
             f" | {t.resident_bytes} bytes already resident | {t.dropped_bytes} bytes dropped by the cap")
    if h.prefetch_name == "read":
        line += f" | {t.touched_bytes} bytes touched | {t.queue_full} ranges not queued"
    errors = ", ".join(f"errno {e} x{n}" for e, n in t.errors)
    return line + (f" | {t.failed} ranges FAILED ({errors})" if t.failed else " | no failures")


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
        prefetch_mode=h.prefetch_name,
        prefetch_totals=None if h.prefetch_totals is None else h.prefetch_totals._asdict(),
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
        description="Per-layer hit rates of P/A traces (docs/trace-format.md), with a consistency control. "
                    "Subcommands: 'onebit-stats replay TRACE --slots N ...' (expert-cache hit rates) and "
                    "'onebit-stats simulate TRACE ...' (decode-time model, docs/cost-model.md), see their --help; "
                    "a trace file named replay or simulate is given as ./replay.",
        epilog="exit codes: 0 ok, 1 consistency check failed, 2 usage or input error",
    )
    p.add_argument("traces", nargs="+", metavar="TRACE", help="trace files written with ONEBIT_MOE_PREDICT_OUT")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="write JSON to stdout")
    out.add_argument("--csv", action="store_true", help="write CSV to stdout")
    p.add_argument("--layers", type=parse_layers, metavar="LIST", help="only these layers, e.g. 1,3-5")
    p.add_argument("--force", action="store_true", help="compare traces whose actual routing disagrees")
    p.add_argument("--engine", choices=STATS_ENGINES, default=STATS_ENGINE_C,
                   help="c: the compiled kernel (default, built once with cffi); numpy: the slower reference")
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
    try:
        stats = [compute_stats(t, engine=args.engine) for t in traces]
    except StatsKernelError as e:
        logger.error("%s (--engine numpy needs no compiler)", e)
        return EXIT_USAGE
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
    """Run ``onebit-stats``; return the exit code.

    A first argument of exactly ``replay`` or ``simulate`` runs that subcommand
    (onebit_predict.cli_replay, onebit_predict.cli_simulate); a trace file of that name is
    given as ``./replay``.
    """
    args_in = sys.argv[1:] if argv is None else list(argv)
    if args_in and args_in[0] in SIM_SUBCOMMANDS:
        if args_in[0] == "replay":
            from .cli_replay import main as sub_main
        else:
            from .cli_simulate import main as sub_main
        return sub_main(args_in[1:])
    return run_command("onebit-stats", _parser(), _run, args_in)


if __name__ == "__main__":
    sys.exit(main())
