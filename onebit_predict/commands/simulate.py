"""``onebit-stats simulate TRACE (--model M | --expert-bytes SIZE) --bandwidth BW[,...]
(--layer-ms MS | --bench-json F)``.

The decode-time model of a streamed expert pipeline (onebit_predict.simulate, every rule in
docs/cost-model.md) played on a trace's routing, for each predictor: none, previous-token,
the trace's own (router or block), oracle. Reports tok/s, bytes read and wasted per token,
demand stalls and the speedup over none; with the predictor's cost (``--predictor-cost-pct``,
or the ratio onebit-bench measured, ``--bench-json``) the line "spent N %, saved M %".

``--cold`` empties every layer's expert cache before each token, as ``onebit-bench --cold``
evicts every expert page before each decoded token: the like-for-like model of that
measurement (a prediction can then only help as the same token's prefetch).

A table by default; ``--json`` or ``--csv`` on stdout (commands/simulate_out.py); ``--plot
FILE.png`` (needs the ``plot`` extra: matplotlib); logs on stderr.

``--granularity page``, ``--memory-limit`` and ``--measured`` run the page-granular model
instead (commands/simulate_pages.py, costmodel/page_check.py): major faults, readahead windows, the
page cache under a memory cgroup, the consumer's requests; ``--measured`` checks it against
an ``onebit-bench --memory-limit`` or ``--cold`` report.
Exit codes: 0 ok; 1 a checked row of --measured missed; 2 usage or input error. A
subcommand of ``onebit-stats`` (commands/stats.py).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from ..constants import (
    EXIT_OK,
    REPLAY_POLICIES,
    SIM_LATENCY_US_DEFAULT,
    SIM_PLOT_BANDWIDTHS,
    SIM_QUEUE_DEPTH_DEFAULT,
    SIM_ROUTE_AT_DEFAULT,
)
from ..costmodel.expert_bytes import expert_bytes_from_gguf
from ..costmodel.measured import from_bench
from ..costmodel.replay import CacheConfig
from ..costmodel.routing import Routing, load_routing
from ..costmodel.simulate import ComputeModel, simulate
from ..moe_check import require_trace_model
from ..trace import Trace
from ..units import parse_bandwidth, parse_size
from . import simulate_out, simulate_pages
from .cache_args import add_lfru_window
from .common import UsageError, arg_type, comma_list, nonneg_float, positive_int

logger = logging.getLogger("onebit_predict")
DESCRIPTION = "Decode-time model of a streamed expert pipeline on a P/A trace's routing (docs/cost-model.md)."
EPILOG = "exit codes: 0 ok, 1 a --measured row missed by more than --tolerance, 2 usage or input error"


def _fraction(text: str) -> float:
    value = nonneg_float(text)
    if value > 1:
        raise ValueError(f"'{text}' is not in [0, 1]")
    return value


def configure(p: argparse.ArgumentParser) -> None:
    """The options of ``onebit-stats simulate`` (TRACE and --json/--csv come from the parents)."""
    size = p.add_mutually_exclusive_group()
    size.add_argument(
        "--model",
        type=Path,
        metavar="MODEL.gguf",
        help="bytes per expert and layer from this GGUF's ffn_*_exps tensors",
    )
    size.add_argument(
        "--expert-bytes",
        type=arg_type(parse_size),
        metavar="SIZE",
        help="one expert's bytes in every layer, e.g. 6.75MiB or 2856960",
    )
    p.add_argument(
        "--bandwidth",
        type=arg_type(comma_list(parse_bandwidth)),
        metavar="BW[,BW...]",
        help="drive bandwidth, e.g. 3GB/s or 3GB/s,7GB/s (required but with --measured: its drive)",
    )
    p.add_argument(
        "--latency-us",
        type=arg_type(nonneg_float),
        metavar="US",
        help=f"per-read latency in microseconds (default {SIM_LATENCY_US_DEFAULT:g}, or --measured's drive)",
    )
    p.add_argument(
        "--queue-depth",
        type=arg_type(positive_int),
        metavar="Q",
        help=f"reads in service at once (default {SIM_QUEUE_DEPTH_DEFAULT})",
    )
    p.add_argument(
        "--layer-ms",
        type=arg_type(nonneg_float),
        metavar="MS",
        help="compute time of one layer for one token (or from --bench-json)",
    )
    p.add_argument(
        "--bench-json",
        type=Path,
        metavar="FILE",
        help="onebit-bench --json output: layer time from 'patched off', predictor cost from the "
        "trace mode's row (explicit --layer-ms / --predictor-cost-pct win)",
    )
    p.add_argument(
        "--route-at",
        type=arg_type(_fraction),
        metavar="F",
        help=f"fraction of a layer's compute before its router runs (default {SIM_ROUTE_AT_DEFAULT:g})",
    )
    p.add_argument(
        "--predictor-cost-pct",
        type=arg_type(nonneg_float),
        metavar="PCT",
        help="the trace predictor's cost in %% of a token's compute (e.g. router 4, block 35 from the "
        "onebit-bench table in docs/results.md); default 0, or from --bench-json",
    )
    p.add_argument(
        "--slots",
        type=arg_type(positive_int),
        metavar="N",
        help="expert slots per layer (default n_expert_used: no reuse beyond the last token's experts)",
    )
    p.add_argument("--policy", default="lru", choices=REPLAY_POLICIES, help="eviction policy (default lru)")
    add_lfru_window(p)
    p.add_argument(
        "--cold",
        action="store_true",
        help="empty every layer's cache before each token (as onebit-bench --cold): no expert "
        "survives from one token to the next; a prefetch still serves its own token",
    )
    p.add_argument(
        "--plot",
        type=Path,
        metavar="FILE.png",
        help="per-layer hit rate and tok/s against bandwidth (needs matplotlib: the 'plot' extra)",
    )
    simulate_pages.configure(p)


def _expert_bytes(args: argparse.Namespace, routing: Routing) -> dict[int, float]:
    h = routing.header
    if args.expert_bytes is not None:
        return {layer: float(args.expert_bytes) for layer in range(h.n_layer)}
    require_trace_model(args.model, h.n_expert, routing.layers)
    per_layer, _ = expert_bytes_from_gguf(args.model)
    return {layer: float(b) for layer, b in per_layer.items()}


def run(args: argparse.Namespace) -> int:
    """``onebit-stats simulate``: time the trace's routing per predictor and bandwidth."""
    if simulate_pages.wants_pages(args):
        if args.plot is not None:
            raise UsageError("--plot draws the expert model; the page model's plot is onebit-stats plot-memory")
        trace = Trace.open(args.trace)
        routing = load_routing(trace)
        if not routing.layers:
            raise UsageError(f"{trace.path}: no decode rows to simulate")
        return simulate_pages.run(args, trace, routing)
    if args.drive_rates is not None:
        raise UsageError(
            "--drive-rates times the page model's drive: give --granularity page, --memory-limit or --measured"
        )
    if args.model is None and args.expert_bytes is None:
        raise UsageError("one of the arguments --model --expert-bytes is required")
    if args.bandwidth is None:
        raise UsageError("the following arguments are required: --bandwidth")
    latency_us = SIM_LATENCY_US_DEFAULT if args.latency_us is None else args.latency_us
    queue_depth = SIM_QUEUE_DEPTH_DEFAULT if args.queue_depth is None else args.queue_depth
    route_at = SIM_ROUTE_AT_DEFAULT if args.route_at is None else args.route_at
    if args.layer_ms is None and args.bench_json is None:
        raise UsageError("give the per-layer compute time: --layer-ms MS or --bench-json FILE (onebit-bench --json)")
    if args.plot is not None:
        from ..costmodel.plot import require_matplotlib

        require_matplotlib()
    trace = Trace.open(args.trace)
    routing = load_routing(trace)
    expert_bytes = _expert_bytes(args, routing)
    h = trace.header
    layer_ms, cost = args.layer_ms, args.predictor_cost_pct
    if args.bench_json is not None:
        bench_ms, bench_cost = from_bench(args.bench_json, h.mode_name, h.n_layer)
        layer_ms = bench_ms if layer_ms is None else layer_ms
        cost = bench_cost if cost is None else cost
    slots = h.n_expert_used if args.slots is None else args.slots
    if slots < h.n_expert_used:
        raise UsageError(
            f"--slots {slots}: a layer needs all its n_expert_used ({h.n_expert_used}) experts resident at once"
        )
    if not routing.layers:
        raise UsageError(f"{trace.path}: no decode rows to simulate")
    compute = ComputeModel(layer_ms, route_at, cost or 0.0)
    cache = CacheConfig(slots, args.policy, "none", args.lfru_window, cold=args.cold)
    bandwidths = list(args.bandwidth)
    sweep = sorted(set(bandwidths) | set(SIM_PLOT_BANDWIDTHS)) if args.plot is not None else bandwidths
    res = simulate(routing, expert_bytes, cache, compute, sweep, latency_us / 1000.0, queue_depth)
    sizes = sorted(set(expert_bytes[layer] for layer in routing.layers))
    bytes_text = (f"{sizes[0]:.0f} B" if len(sizes) == 1 else f"{sizes[0]:.0f}-{sizes[-1]:.0f} B") + (
        f" (from {args.model})" if args.model else ""
    )
    if args.json:
        print(simulate_out.to_json(trace, res, bandwidths))
    elif args.csv:
        simulate_out.to_csv(res, bandwidths)
    else:
        print(simulate_out.render(trace, res, bandwidths, bytes_text))
    if args.plot is not None:
        from ..costmodel.plot import plot_simulation

        title = f"{h.model or trace.path.name} ({h.mode_name} trace), expert {bytes_text}"
        plot_simulation(res, args.plot, title, bandwidths)
        logger.info("wrote %s", args.plot)
    return EXIT_OK
