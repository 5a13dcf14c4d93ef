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

Which subcommand runs depends on the command line alone, never on the files in the current
directory: a first argument that is a subcommand's name (``rates``, ``replay``, ``simulate``,
``plot-memory``, ``plot-drives``) is that subcommand, always; any other first argument is a
trace (or an option) of ``rates``, so ``onebit-stats router.bin block.bin`` is ``onebit-stats rates
router.bin block.bin``. A trace file literally named like a subcommand is given with a path:
``onebit-stats ./replay`` reads it, ``onebit-stats replay ./replay --slots 2`` replays it.

A trace its writer did not finish is read all the same, with one warning on stderr per trace
(``Trace.open``, where rates, replay and simulate all read their traces): header flag OPEN,
"not closed cleanly (the writer died or is still running)"; INCOMPLETE, "record write(s)
failed (full disk?)". The summary line says so too, and --json carries ``open`` and
``incomplete`` in the header; the exit code stays 0 for the records read.

Exit codes (commands/common.py): 0 ok; 1 the consistency control found issues, or the
traces' actual routing disagrees (without ``--force``); 2 usage or input error (missing
file, bad header, bad ``--layers``, a stats kernel that cannot be built).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from ..constants import EXIT_CHECK_FAILED, EXIT_OK, STATS_ENGINE_C, STATS_ENGINES
from ..metrics.stats import compare_routing, compute_stats
from ..metrics.stats_kernel import StatsKernelError
from ..trace import Trace
from . import plot_drives, plot_memory, replay, simulate, stats_out
from .common import check_layers, layers_parent, output_parent, run_command, trace_parent

logger = logging.getLogger("onebit_predict")
PROG = "onebit-stats"
DEFAULT = "rates"
# a first argument of these names is the subcommand
SUBCOMMANDS = (DEFAULT, "replay", "simulate", "plot-memory", "plot-drives")


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
        print(stats_out.to_json(traces, stats, differences))
    elif args.csv:
        stats_out.write_csv(traces, stats)
    elif len(traces) == 1:
        print(stats_out.render_one(traces[0], stats[0], distances[0]))
    else:
        print(stats_out.render_side_by_side(traces, stats, distances))
    return rc


def build_parser() -> argparse.ArgumentParser:
    """``onebit-stats {rates,replay,simulate}``: one parser, a function per subcommand (``func``)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Per-layer hit rates of P/A traces (docs/trace-format.md), with a consistency control, and the "
        "expert-cache model on them (docs/cost-model.md). 'onebit-stats TRACE ...' is 'onebit-stats "
        "rates TRACE ...'; a trace file named like a subcommand is given with a path (./replay).",
        epilog="exit codes: 0 ok, 1 consistency check failed, 2 usage or input error",
    )
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}", required=True)
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
    sp = sub.add_parser(
        "plot-drives",
        parents=[output_parent()],
        help="per drive, each configuration's ratio to off over the cells of onebit-bench --drive reports",
        description=plot_drives.DESCRIPTION,
        epilog=plot_drives.EPILOG,
    )
    plot_drives.configure(sp)
    sp.set_defaults(func=plot_drives.run)
    return p


def with_subcommand(argv: Sequence[str]) -> list[str]:
    """argv with its subcommand first: the rule of the module docstring (argv alone decides)."""
    argv = list(argv)
    if argv and argv[0] in ("-h", "--help", *SUBCOMMANDS):
        return argv
    return [DEFAULT, *argv]


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-stats``; return the exit code."""
    args_in = with_subcommand(sys.argv[1:] if argv is None else argv)
    prog = PROG if args_in[:1] in ([DEFAULT], ["-h"], ["--help"]) else f"{PROG} {args_in[0]}"
    return run_command(prog, build_parser(), lambda args: args.func(args), args_in)


if __name__ == "__main__":
    sys.exit(main())
