"""What the predictor costs, measured side by side in one run (the ``onebit-bench`` command).

Each configuration (the unpatched pin, the patched build with the predictor off, router,
router writing a trace, block, block without the mixer, block on a subset of layers) runs
in its own process (checks/rounds.py), the order alternating round by round so that drift
on the machine spreads over all of them. Decode tok/s is reported as the median of the
rounds with min and max, next to the ratio to "patched off" and the compute-buffer size
llama.cpp reports when it reserves the graph. No absolute number is meant to be quoted
alone: the ratios are the result.

``--cold`` (checks/bench_cold.py) emulates a model whose experts do not fit in memory:
before every decoded token the worker evicts the expert pages (llama/evict.py:
MADV_DONTNEED plus POSIX_FADV_DONTNEED, or MADV_PAGEOUT, whichever works here;
``--evict-method``), with readahead off on them, so each token reads its experts from the
drive. Only the decode calls are timed, not the eviction. The configurations are then the
prefetch consumer off, advise and read, for router and block predictions, each writing a
trace, and the table adds the consumer's counters and the prediction's read recall and
precision from that trace.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..constants import ENV_COMPENSATOR, ENV_LAYERS, ENV_MODE, ENV_NO_ATTN, ENV_OUT
from ..policy import parse_layers
from .rounds import BenchOptions, Config, collect


@dataclass(frozen=True)
class Row:
    name: str
    median_tok_s: float
    min_tok_s: float
    max_tok_s: float
    ratio_to_off: float
    compute_mib: float
    layers_predicted: int
    extra_mib_per_layer: float | None  # compute buffer above patched off, per predicted layer
    cost_pct_per_layer: float | None  # decode time above patched off, % of its time, per predicted layer


def require_compensator(compensator: Path | None, cold: bool) -> None:
    """``--compensator FILE``: an existing file, and not with --cold (ValueError, exit 2, otherwise)."""
    if compensator is not None and not compensator.is_file():
        raise ValueError(f"--compensator {compensator}: no such file")
    if compensator is not None and cold:
        raise ValueError("--compensator is a row of the warm run and a dimension of --memory-limit, not of --cold")


def configs(trace_dir: Path, layers_subset: str, compensator: Path | None = None) -> list[Config]:
    """The warm run's rows; with a compensator sidecar, one more: the predictor off, the sidecar on
    (what the compensator itself costs, beside patched off)."""
    extra = [Config("compensator", {ENV_COMPENSATOR: str(compensator)})] if compensator is not None else []
    return [
        Config("unpatched pin", {}, pristine=True),
        Config("patched off", {}),
        Config("router", {ENV_MODE: "router"}),
        Config("router + trace", {ENV_MODE: "router", ENV_OUT: str(trace_dir / "router.bin")}),
        Config("block", {ENV_MODE: "block"}),
        Config("block no-attn", {ENV_MODE: "block", ENV_NO_ATTN: "1"}),
        Config(f"block layers {layers_subset}", {ENV_MODE: "block", ENV_LAYERS: layers_subset}),
        *extra,
    ]


def measure(model: Path, cfgs: Sequence[Config], lib: Path, lib_pristine: Path | None, opts: BenchOptions) -> list[Row]:
    samples = collect(model, cfgs, lib, lib_pristine, opts)
    off = statistics.median(s.tok_s for s in samples["patched off"])
    off_mib = samples["patched off"][0].compute_mib
    rows = []
    for cfg in cfgs:
        toks = [s.tok_s for s in samples[cfg.name]]
        med = statistics.median(toks)
        first = samples[cfg.name][0]
        n_pred = len(parse_layers(cfg.env.get(ENV_LAYERS), first.n_layer)[0]) if ENV_MODE in cfg.env else 0
        extra = (first.compute_mib - off_mib) / n_pred if n_pred else None
        cost = 100 * (off / med - 1) / n_pred if n_pred else None  # time per token grows as 1/tok_s
        rows.append(Row(cfg.name, med, min(toks), max(toks), med / off, first.compute_mib, n_pred, extra, cost))
    return rows


def markdown(rows: Sequence[Row], header: str) -> str:
    lines = [
        header,
        "",
        "| configuration | decode tok/s (median) | min | max | vs patched off | compute buffer MiB "
        "| layers predicted | extra MiB per predicted layer | time cost per predicted layer |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        extra = "-" if r.extra_mib_per_layer is None else f"{r.extra_mib_per_layer:.3f}"
        cost = "-" if r.cost_pct_per_layer is None else f"{r.cost_pct_per_layer:.1f}%"
        lines.append(
            f"| {r.name} | {r.median_tok_s:.1f} | {r.min_tok_s:.1f} | {r.max_tok_s:.1f} | "
            f"{r.ratio_to_off:.3f} | {r.compute_mib:.2f} | {r.layers_predicted or '-'} | {extra} | {cost} |"
        )
    return "\n".join(lines)
