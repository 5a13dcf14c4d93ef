"""``onebit-stats replay TRACE --slots N[,N...] --policy lru|lfru|belady[,...] [--prefetch none|trace|protect]``.

Per-layer expert-cache hit rates of a trace's decode routing with N slots per layer
(costmodel/replay.py; the rules in docs/cost-model.md). ``--prefetch trace`` prefetches
the trace's predictions (charged: a prefetch takes a slot and counts as a read),
``--prefetch protect`` only spares them from eviction (free). ``belady`` is the offline
optimum of demand caching: the ceiling of the other policies without prefetch. ``--cold``
empties every layer's cache before each token (as ``onebit-bench --cold``): only the same
token's charged prefetch can then bring a hit.

A table by default; ``--json`` or ``--csv`` on stdout; logs on stderr.
Exit codes: 0 ok; 2 usage or input error (missing file, bad trace, slots below
n_expert_used, bad --layers). A subcommand of ``onebit-stats`` (commands/stats.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys

from ..constants import EXIT_OK, REPLAY_POLICIES, REPLAY_PREFETCH_MODES
from ..costmodel.replay import CacheConfig, ReplayResult, replay
from ..costmodel.routing import Routing, load_routing
from ..trace import Trace
from .cache_args import add_lfru_window, header_summary
from .common import UsageError, arg_type, check_layers, comma_list, fmt, positive_int, table

logger = logging.getLogger("onebit_predict")
DESCRIPTION = "Per-layer expert-cache hit rates of a P/A trace's decode routing (docs/cost-model.md)."
EPILOG = "exit codes: 0 ok, 2 usage or input error"


def _policy(text: str) -> str:
    if text not in REPLAY_POLICIES:
        raise ValueError(f"unknown policy '{text}' (one of {', '.join(REPLAY_POLICIES)})")
    return text


def configure(p: argparse.ArgumentParser) -> None:
    """The options of ``onebit-stats replay`` (TRACE, --layers, --json/--csv come from the parents)."""
    p.add_argument(
        "--slots",
        required=True,
        type=arg_type(comma_list(positive_int)),
        metavar="N[,N...]",
        help="expert slots per layer (at least n_expert_used), e.g. 4,8,16",
    )
    p.add_argument(
        "--policy",
        default=["lru"],
        type=arg_type(comma_list(_policy)),
        metavar="P[,P...]",
        help="eviction policy: lru, lfru, belady (offline optimum); several comma-separated (default lru)",
    )
    p.add_argument(
        "--prefetch",
        default="none",
        choices=REPLAY_PREFETCH_MODES,
        help="none; trace: read the trace's predictions into the cache (charged); "
        "protect: only spare them from eviction (free) (default none)",
    )
    add_lfru_window(p)
    p.add_argument(
        "--cold",
        action="store_true",
        help="empty every layer's cache before each token (as onebit-bench --cold); "
        "only --prefetch trace can then bring hits",
    )


def _label(cfg: CacheConfig) -> str:
    return f"{cfg.policy}@{cfg.slots}"


def _render(trace: Trace, routing: Routing, results: list[ReplayResult], prefetch: str, cold: bool) -> str:
    h = trace.header
    lines = [
        f"{trace.path}: {routing.n_tokens} decode tokens",
        f"arch {h.arch or '?'} | model {h.model or '?'} | mode {h.mode_name} | n_expert {h.n_expert}"
        f" | n_used {h.n_expert_used} | depth {h.depth} | prefetch {prefetch}"
        + {"trace": " (charged)", "protect": " (free)", "none": ""}[prefetch]
        + (" | cold (emptied before every token)" if cold else ""),
        "",
    ]
    titles = ["layer", "tokens", "pred"]
    for r in results:
        titles += [f"{_label(r.config)} hit%", "reads/tok"] + (["wasted/tok"] if prefetch == "trace" else [])

    def cells(counts_of) -> list[str]:
        out = []
        for r in results:
            c = counts_of(r)
            m = c.metrics()
            hit = None if m["hit_rate"] is None else 100 * m["hit_rate"]
            out += [fmt(hit, ".1f"), fmt(m["reads_per_token"], ".2f")]
            if prefetch == "trace":
                out.append(fmt(c.prefetch_wasted / c.tokens if c.tokens else None, ".2f"))
        return out

    layers = list(results[0].layers)
    rows = [
        [
            str(layer),
            str(results[0].layers[layer].counts.tokens),
            "yes" if layer in routing.predicted_layers and routing.has_predictor else "-",
        ]
        + cells(lambda r, layer=layer: r.layers[layer].counts)
        for layer in layers
    ]
    total_tokens = results[0].total.tokens
    rows.append(["total", str(total_tokens), ""] + cells(lambda r: r.total))
    return "\n".join(lines) + "\n" + table(titles, rows)


def _json(trace: Trace, routing: Routing, results: list[ReplayResult]) -> str:
    h = trace.header
    return json.dumps(
        {
            "trace": str(trace.path),
            "header": header_summary(h),
            "tokens": routing.n_tokens,
            "predicted_layers": sorted(routing.predicted_layers) if routing.has_predictor else [],
            "results": [
                {
                    "policy": r.config.policy,
                    "slots": r.config.slots,
                    "prefetch": r.config.prefetch,
                    "lfru_window": r.config.lfru_window,
                    "cold": r.config.cold,
                    "layers": [{"layer": layer, **x.counts.metrics()} for layer, x in r.layers.items()],
                    "total": r.total.metrics(),
                }
                for r in results
            ],
        },
        indent=2,
        allow_nan=False,
    )


def _csv(results: list[ReplayResult]) -> None:
    w = csv.writer(sys.stdout, lineterminator="\n")
    names = list(results[0].total.metrics())
    w.writerow(["policy", "slots", "prefetch", "layer", *names, "cold"])
    for r in results:
        c = r.config
        for layer, counts in [*((layer, x.counts) for layer, x in r.layers.items()), ("total", r.total)]:
            values = ("" if v is None else v for v in counts.metrics().values())
            w.writerow([c.policy, c.slots, c.prefetch, layer, *values, int(c.cold)])


def run(args: argparse.Namespace) -> int:
    """``onebit-stats replay``: replay the trace through every --policy and --slots."""
    trace = Trace.open(args.trace)
    routing = load_routing(trace)
    h = trace.header
    too_few = [n for n in args.slots if n < h.n_expert_used]
    if too_few:
        raise UsageError(
            f"--slots {','.join(map(str, too_few))}: a layer needs all its n_expert_used "
            f"({h.n_expert_used}) experts resident at once"
        )
    check_layers(args.layers, h.n_layer, trace.path)
    if args.cold and args.prefetch == "protect":
        logger.warning(
            "--cold with --prefetch protect: nothing survives a token to be protected, "
            "it gives the same hits as --prefetch none"
        )
    if args.prefetch != "none" and not routing.has_predictor:
        logger.warning(
            "%s: mode off, the trace holds no predictions: --prefetch %s changes nothing", trace.path, args.prefetch
        )
    layers = {layer: lr for layer, lr in routing.layers.items() if args.layers is None or layer in args.layers}
    if not layers:
        logger.warning("%s: no decode rows to replay", trace.path)
    demand = {layer: lr.actual for layer, lr in layers.items()}
    pred = {layer: lr.trace_pred for layer, lr in layers.items()}
    results = [
        replay(demand, pred, CacheConfig(n, policy, args.prefetch, args.lfru_window, args.cold))
        for policy in args.policy
        for n in args.slots
    ]
    if args.json:
        print(_json(trace, routing, results))
    elif args.csv:
        _csv(results)
    else:
        print(_render(trace, routing, results, args.prefetch, args.cold))
    return EXIT_OK
