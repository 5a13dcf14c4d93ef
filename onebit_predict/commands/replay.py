"""``onebit-stats replay TRACE --slots N[,N...] --policy lru|lfru|belady[,...] [--prefetch none|trace|protect]``.

Per-layer expert-cache hit rates of a trace's decode routing with N slots per layer
(onebit_predict.replay; the rules in docs/cost-model.md). ``--prefetch trace`` prefetches
the trace's predictions (charged: a prefetch takes a slot and counts as a read),
``--prefetch protect`` only spares them from eviction (free). ``belady`` is the offline
optimum of demand caching: the ceiling of the other policies without prefetch. ``--cold``
empties every layer's cache before each token (as ``onebit-bench --cold``): only the same
token's charged prefetch can then bring a hit.

A table by default; ``--json`` or ``--csv`` on stdout; logs on stderr.
Exit codes: 0 ok; 2 usage or input error (missing file, bad trace, slots below
n_expert_used, bad --layers).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from collections.abc import Sequence

from .cli_common import arg_type, comma_list, fmt, positive_int, run_command, table
from .cli_stats import parse_layers
from .constants import EXIT_OK, EXIT_USAGE, LFRU_WINDOW_DEFAULT, REPLAY_POLICIES, REPLAY_PREFETCH_MODES
from .replay import CacheConfig, ReplayResult, replay
from .routing import Routing, load_routing
from .trace import Trace, TraceError

logger = logging.getLogger("onebit_predict")
PROG = "onebit-stats replay"


def _policy(text: str) -> str:
    if text not in REPLAY_POLICIES:
        raise ValueError(f"unknown policy '{text}' (one of {', '.join(REPLAY_POLICIES)})")
    return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Per-layer expert-cache hit rates of a P/A trace's decode routing (docs/cost-model.md).",
        epilog="exit codes: 0 ok, 2 usage or input error",
    )
    p.add_argument("trace", metavar="TRACE")
    p.add_argument("--slots", required=True, type=arg_type(comma_list(positive_int)), metavar="N[,N...]",
                   help="expert slots per layer (at least n_expert_used), e.g. 4,8,16")
    p.add_argument("--policy", default=["lru"], type=arg_type(comma_list(_policy)), metavar="P[,P...]",
                   help="eviction policy: lru, lfru, belady (offline optimum); several comma-separated (default lru)")
    p.add_argument("--prefetch", default="none", choices=REPLAY_PREFETCH_MODES,
                   help="none; trace: read the trace's predictions into the cache (charged); "
                        "protect: only spare them from eviction (free) (default none)")
    p.add_argument("--lfru-window", type=arg_type(positive_int), default=LFRU_WINDOW_DEFAULT, metavar="T",
                   help=f"tokens over which lfru counts uses (default {LFRU_WINDOW_DEFAULT})")
    p.add_argument("--cold", action="store_true",
                   help="empty every layer's cache before each token (as onebit-bench --cold); "
                        "only --prefetch trace can then bring hits")
    p.add_argument("--layers", type=parse_layers, metavar="LIST", help="only these layers, e.g. 1,3-5")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="write JSON to stdout")
    out.add_argument("--csv", action="store_true", help="write CSV to stdout")
    return p


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
    rows = [[str(l), str(results[0].layers[l].counts.tokens), "yes" if l in routing.predicted_layers
             and routing.has_predictor else "-"] + cells(lambda r, l=l: r.layers[l].counts) for l in layers]
    total_tokens = results[0].total.tokens
    rows.append(["total", str(total_tokens), ""] + cells(lambda r: r.total))
    return "\n".join(lines) + "\n" + table(titles, rows)


def _json(trace: Trace, routing: Routing, results: list[ReplayResult]) -> str:
    h = trace.header
    return json.dumps({
        "trace": str(trace.path),
        "header": {"arch": h.arch, "model": h.model, "mode": h.mode_name, "n_layer": h.n_layer,
                   "n_expert": h.n_expert, "n_expert_used": h.n_expert_used, "depth": h.depth},
        "tokens": routing.n_tokens,
        "predicted_layers": sorted(routing.predicted_layers) if routing.has_predictor else [],
        "results": [
            {"policy": r.config.policy, "slots": r.config.slots, "prefetch": r.config.prefetch,
             "lfru_window": r.config.lfru_window, "cold": r.config.cold,
             "layers": [{"layer": l, **x.counts.metrics()} for l, x in r.layers.items()],
             "total": r.total.metrics()}
            for r in results
        ],
    }, indent=2, allow_nan=False)


def _csv(results: list[ReplayResult]) -> None:
    w = csv.writer(sys.stdout, lineterminator="\n")
    names = list(results[0].total.metrics())
    w.writerow(["policy", "slots", "prefetch", "layer", *names, "cold"])
    for r in results:
        c = r.config
        for layer, counts in [*((l, x.counts) for l, x in r.layers.items()), ("total", r.total)]:
            values = ("" if v is None else v for v in counts.metrics().values())
            w.writerow([c.policy, c.slots, c.prefetch, layer, *values, int(c.cold)])


def _run(args: argparse.Namespace) -> int:
    try:
        trace = Trace.open(args.trace)
        routing = load_routing(trace)
    except (OSError, TraceError) as e:
        logger.error("%s", e)
        return EXIT_USAGE
    h = trace.header
    too_few = [n for n in args.slots if n < h.n_expert_used]
    if too_few:
        logger.error("--slots %s: a layer needs all its n_expert_used (%d) experts resident at once",
                     ",".join(map(str, too_few)), h.n_expert_used)
        return EXIT_USAGE
    if args.layers is not None:
        beyond = sorted(l for l in args.layers if l >= h.n_layer)
        if beyond:
            logger.error("--layers %s: %s has layers 0..%d", beyond, trace.path, h.n_layer - 1)
            return EXIT_USAGE
    if args.cold and args.prefetch == "protect":
        logger.warning("--cold with --prefetch protect: nothing survives a token to be protected, "
                       "it gives the same hits as --prefetch none")
    if args.prefetch != "none" and not routing.has_predictor:
        logger.warning("%s: mode off, the trace holds no predictions: --prefetch %s changes nothing",
                       trace.path, args.prefetch)
    layers = {l: lr for l, lr in routing.layers.items() if args.layers is None or l in args.layers}
    if not layers:
        logger.warning("%s: no decode rows to replay", trace.path)
    demand = {l: lr.actual for l, lr in layers.items()}
    pred = {l: lr.trace_pred for l, lr in layers.items()}
    results = [replay(demand, pred, CacheConfig(n, policy, args.prefetch, args.lfru_window, args.cold))
               for policy in args.policy for n in args.slots]
    if args.json:
        print(_json(trace, routing, results))
    elif args.csv:
        _csv(results)
    else:
        print(_render(trace, routing, results, args.prefetch, args.cold))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-stats replay``; return the exit code."""
    return run_command(PROG, _parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
