"""How ``onebit-stats simulate`` prints the expert model (commands/simulate.py): the summary, a table
per bandwidth and the per-layer hit rates, or ``--json``, or ``--csv``."""

from __future__ import annotations

import csv
import json
import sys

from ..costmodel.simulate import PRED_NONE, SimResult
from ..trace import Trace
from ..units import fmt_bandwidth
from .cache_args import header_summary
from .common import fmt, table

MB = 1e6


def summary(trace: Trace, res: SimResult, bytes_text: str) -> str:
    h, c = trace.header, res.compute
    cost = f" | {h.mode_name} cost {c.predictor_cost_pct:g} % of compute" if res.routing.has_predictor else ""
    return (
        f"{trace.path}: {res.routing.n_tokens} decode tokens | arch {h.arch or '?'} | model {h.model or '?'}"
        f" | mode {h.mode_name} | n_expert {h.n_expert} | n_used {h.n_expert_used} | depth {h.depth}\n"
        f"expert {bytes_text} | latency {res.latency_ms * 1000:g} us | queue depth {res.queue_depth}"
        f" | layer {c.layer_ms:g} ms, routed at {c.route_at:g} | {res.cache.slots} slots/layer"
        f" {res.cache.policy}{', cold (emptied before every token)' if res.cache.cold else ''}{cost}"
    )


def render(trace: Trace, res: SimResult, bandwidths: list[float], bytes_text: str) -> str:
    out = [summary(trace, res, bytes_text)]
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
            v = res.values(name, bw)
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
            v = res.values(mode, bw)
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


def to_json(trace: Trace, res: SimResult, bandwidths: list[float]) -> str:
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
                    **res.values(name, bw),
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


def to_csv(res: SimResult, bandwidths: list[float]) -> None:
    w = csv.writer(sys.stdout, lineterminator="\n")
    names = list(res.values(PRED_NONE, bandwidths[0]))
    w.writerow(["bandwidth", "predictor", *names, "cold"])
    for bw in bandwidths:
        for name in res.predictors:
            values = ("" if v is None else v for v in res.values(name, bw).values())
            w.writerow([bw, name, *values, int(res.cache.cold)])
