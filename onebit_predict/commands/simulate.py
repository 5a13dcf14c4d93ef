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

A table by default; ``--json`` or ``--csv`` on stdout; ``--plot FILE.png`` (needs the
``plot`` extra: matplotlib); logs on stderr.

``--granularity page``, ``--memory-limit`` and ``--measured`` run the page-granular model
instead (commands/simulate_pages.py, cache/pages.py): major faults, readahead windows, the
page cache under a memory cgroup, the consumer's requests; ``--measured`` checks it against
an ``onebit-bench --memory-limit`` or ``--cold`` report.
Exit codes: 0 ok; 1 a checked row of --measured missed; 2 usage or input error. A
subcommand of ``onebit-stats`` (commands/stats.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from pathlib import Path

from ..cache.expert_bytes import ModelError, expert_bytes_from_gguf
from ..cache.measured import from_bench
from ..cache.replay import CacheConfig
from ..cache.routing import Routing, load_routing
from ..cache.simulate import PRED_NONE, ComputeModel, SimResult, simulate, spent_saved
from ..constants import (
    EXIT_OK,
    REPLAY_POLICIES,
    SIM_LATENCY_US_DEFAULT,
    SIM_PLOT_BANDWIDTHS,
    SIM_QUEUE_DEPTH_DEFAULT,
    SIM_ROUTE_AT_DEFAULT,
)
from ..trace import Trace
from ..units import fmt_bandwidth, parse_bandwidth, parse_size
from . import simulate_pages
from .common import (
    UsageError,
    add_lfru_window,
    arg_type,
    comma_list,
    fmt,
    header_summary,
    nonneg_float,
    positive_int,
    table,
)

logger = logging.getLogger("onebit_predict")
DESCRIPTION = "Decode-time model of a streamed expert pipeline on a P/A trace's routing (docs/cost-model.md)."
EPILOG = "exit codes: 0 ok, 1 a --measured row missed by more than --tolerance, 2 usage or input error"
MB = 1e6


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
    if not args.model.is_file():
        raise ModelError(f"{args.model}: no such file")
    per_layer, n_expert = expert_bytes_from_gguf(args.model)
    if n_expert != h.n_expert:
        raise ModelError(f"{args.model} has {n_expert} experts per layer, the trace {h.n_expert}: not its model")
    missing = sorted(set(routing.layers) - set(per_layer))
    if missing:
        raise ModelError(f"{args.model} has no expert tensors for layers {missing}, which the trace routes")
    return {layer: float(b) for layer, b in per_layer.items()}


def _summary(trace: Trace, res: SimResult, bytes_text: str) -> str:
    h, c = trace.header, res.compute
    cost = f" | {h.mode_name} cost {c.predictor_cost_pct:g} % of compute" if res.routing.has_predictor else ""
    return (
        f"{trace.path}: {res.routing.n_tokens} decode tokens | arch {h.arch or '?'} | model {h.model or '?'}"
        f" | mode {h.mode_name} | n_expert {h.n_expert} | n_used {h.n_expert_used} | depth {h.depth}\n"
        f"expert {bytes_text} | latency {res.latency_ms * 1000:g} us | queue depth {res.queue_depth}"
        f" | layer {c.layer_ms:g} ms, routed at {c.route_at:g} | {res.cache.slots} slots/layer"
        f" {res.cache.policy}{', cold (emptied before every token)' if res.cache.cold else ''}{cost}"
    )


def _row_values(res: SimResult, name: str, bw: float) -> dict[str, float | int | None]:
    r = res.run(name, bw)
    base = res.run(PRED_NONE, bw)
    ss = spent_saved(res, r)
    return {
        "hit_rate": r.counts.hit_rate,
        "late_per_token": r.per_token(r.late),
        "tok_s": r.tok_s,
        "bytes_read_per_token": r.per_token(r.bytes_read),
        "bytes_wasted_per_token": r.per_token(r.bytes_wasted),
        "stalls_per_token": r.per_token(r.stalls),
        "stall_ms_per_token": r.per_token(r.stall_ms),
        "speedup": base.total_ms / r.total_ms if r.total_ms > 0 else None,
        "spent_pct": None if ss is None else ss[0],
        "saved_pct": None if ss is None else ss[1],
    }


def _render(trace: Trace, res: SimResult, bandwidths: list[float], bytes_text: str) -> str:
    out = [_summary(trace, res, bytes_text)]
    titles = [
        "predictor",
        "hit%",
        "late/tok",
        "tok/s",
        "MB read/tok",
        "MB wasted/tok",
        "stalls/tok",
        "stall ms/tok",
        "speedup",
    ]
    mode = trace.header.mode_name
    for bw in bandwidths:
        rows = []
        for name in res.predictors:
            v = _row_values(res, name, bw)
            rows.append(
                [
                    name,
                    fmt(None if v["hit_rate"] is None else 100 * v["hit_rate"], ".1f"),
                    fmt(v["late_per_token"], ".2f"),
                    fmt(v["tok_s"], ".1f"),
                    fmt(None if v["bytes_read_per_token"] is None else v["bytes_read_per_token"] / MB, ".2f"),
                    fmt(None if v["bytes_wasted_per_token"] is None else v["bytes_wasted_per_token"] / MB, ".2f"),
                    fmt(v["stalls_per_token"], ".2f"),
                    fmt(v["stall_ms_per_token"], ".3f"),
                    fmt(v["speedup"], ".3f"),
                ]
            )
        out += ["", f"bandwidth {fmt_bandwidth(bw)}", table(titles, rows)]
        if res.routing.has_predictor:
            v = _row_values(res, mode, bw)
            if v["spent_pct"] is not None:
                out.append(f"{mode}: spent {v['spent_pct']:.1f} %, saved {v['saved_pct']:.1f} %")
    layers = list(res.layer_counts[PRED_NONE])
    rows = [
        [str(layer)]
        + [
            fmt(
                None if res.layer_counts[n][layer].hit_rate is None else 100 * res.layer_counts[n][layer].hit_rate,
                ".1f",
            )
            for n in res.predictors
        ]
        for layer in layers
    ]
    out += ["", "per-layer hit rate, % (does not depend on bandwidth)", table(["layer", *res.predictors], rows)]
    return "\n".join(out)


def _json(trace: Trace, res: SimResult, bandwidths: list[float]) -> str:
    h, c = trace.header, res.compute
    return json.dumps(
        {
            "trace": str(trace.path),
            "header": header_summary(h),
            "tokens": res.routing.n_tokens,
            "model": {
                "expert_bytes": {str(layer): b for layer, b in sorted(res.expert_bytes.items())},
                "latency_us": res.latency_ms * 1000,
                "queue_depth": res.queue_depth,
                "layer_ms": c.layer_ms,
                "route_at": c.route_at,
                "predictor_cost_pct": c.predictor_cost_pct,
                "cost_ms_by_layer": {str(layer): v for layer, v in res.cost_layers.items()},
                "slots": res.cache.slots,
                "policy": res.cache.policy,
                "lfru_window": res.cache.lfru_window,
                "cold": res.cache.cold,
            },
            "runs": [
                {
                    "bandwidth": bw,
                    "predictor": name,
                    **_row_values(res, name, bw),
                    "total_ms": res.run(name, bw).total_ms,
                    "stalls": res.run(name, bw).stalls,
                    "late": res.run(name, bw).late,
                    "bytes_read": res.run(name, bw).bytes_read,
                    "bytes_wasted": res.run(name, bw).bytes_wasted,
                }
                for bw in bandwidths
                for name in res.predictors
            ],
            "layers": {
                name: [{"layer": layer, **x.metrics()} for layer, x in res.layer_counts[name].items()]
                for name in res.predictors
            },
        },
        indent=2,
        allow_nan=False,
    )


def _csv(res: SimResult, bandwidths: list[float]) -> None:
    w = csv.writer(sys.stdout, lineterminator="\n")
    names = list(_row_values(res, PRED_NONE, bandwidths[0]))
    w.writerow(["bandwidth", "predictor", *names, "cold"])
    for bw in bandwidths:
        for name in res.predictors:
            values = ("" if v is None else v for v in _row_values(res, name, bw).values())
            w.writerow([bw, name, *values, int(res.cache.cold)])


def run(args: argparse.Namespace) -> int:
    """``onebit-stats simulate``: time the trace's routing per predictor and bandwidth."""
    args.route_at_given = args.route_at is not None
    args.queue_depth_given = args.queue_depth is not None
    args.queue_depth = SIM_QUEUE_DEPTH_DEFAULT if args.queue_depth is None else args.queue_depth
    args.route_at = SIM_ROUTE_AT_DEFAULT if args.route_at is None else args.route_at
    args.page_cache_given = args.page_cache is not None
    args.page_cache = simulate_pages.PAGE_CACHE_DEFAULT if args.page_cache is None else args.page_cache
    if simulate_pages.wants_pages(args):
        if args.plot is not None:
            raise UsageError("--plot draws the expert model; the page model's plot is onebit-stats plot-memory")
        trace = Trace.open(args.trace)
        routing = load_routing(trace)
        if not routing.layers:
            raise UsageError(f"{trace.path}: no decode rows to simulate")
        return simulate_pages.run(args, trace, routing)
    if args.model is None and args.expert_bytes is None:
        raise UsageError("one of the arguments --model --expert-bytes is required")
    if args.bandwidth is None:
        raise UsageError("the following arguments are required: --bandwidth")
    args.latency_us = SIM_LATENCY_US_DEFAULT if args.latency_us is None else args.latency_us
    if args.layer_ms is None and args.bench_json is None:
        raise UsageError("give the per-layer compute time: --layer-ms MS or --bench-json FILE (onebit-bench --json)")
    if args.plot is not None:
        from ..cache.plot import require_matplotlib

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
    compute = ComputeModel(layer_ms, args.route_at, cost or 0.0)
    cache = CacheConfig(slots, args.policy, "none", args.lfru_window, cold=args.cold)
    bandwidths = list(args.bandwidth)
    sweep = sorted(set(bandwidths) | set(SIM_PLOT_BANDWIDTHS)) if args.plot is not None else bandwidths
    res = simulate(routing, expert_bytes, cache, compute, sweep, args.latency_us / 1000.0, args.queue_depth)
    sizes = sorted(set(expert_bytes[layer] for layer in routing.layers))
    bytes_text = (f"{sizes[0]:.0f} B" if len(sizes) == 1 else f"{sizes[0]:.0f}-{sizes[-1]:.0f} B") + (
        f" (from {args.model})" if args.model else ""
    )
    if args.json:
        print(_json(trace, res, bandwidths))
    elif args.csv:
        _csv(res, bandwidths)
    else:
        print(_render(trace, res, bandwidths, bytes_text))
    if args.plot is not None:
        from ..cache.plot import plot_simulation

        title = f"{h.model or trace.path.name} ({h.mode_name} trace), expert {bytes_text}"
        plot_simulation(res, args.plot, title, bandwidths)
        logger.info("wrote %s", args.plot)
    return EXIT_OK
