"""The predictor and its consumer under a real memory limit (``onebit-bench MODEL --memory-limit``).

Each run is confined to a fresh memory cgroup (llama/cgroup.py) whose limit is a fraction of
the model's expert bytes, and drops the model file from the page cache after joining it, so
the kernel's own reclaim evicts expert pages as a model that does not fit would see. The
configurations: the predictor off, router and block, each with the consumer off, advise and
read, each in its own process, rounds alternating, each writing a trace. Per row: decode
tok/s against "patched off" at the same limit, the bytes read from the drive and the major
faults per decoded token (/proc/self/io and getrusage of the worker, all its threads), the
drive's utilisation (bytes read per second over its sequential bandwidth, measured in the
same run), the prediction's read recall and the consumer's counters from the trace.
Not here yet: the oracle configuration (the actual routing replayed as the prediction).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..constants import ENV_MODE, ENV_OUT, ENV_PREFETCH
from .bench_cold import pct, trace_figures
from .rounds import BenchOptions, Config, collect

OFF = "patched off"


def memory_configs(trace_dir: Path) -> list[Config]:
    """The predictor off, then router and block with the consumer off, advise and read."""
    out = [Config(OFF, {ENV_OUT: str(trace_dir / "off.bin")})]
    for mode in ("router", "block"):
        for consumer in ("off", "advise", "read"):
            name = mode if consumer == "off" else f"{mode} + {consumer}"
            env = {ENV_MODE: mode, ENV_PREFETCH: consumer, ENV_OUT: str(trace_dir / f"{mode}-{consumer}.bin")}
            out.append(Config(name, env))
    return out


@dataclass(frozen=True)
class MemoryRow:
    """One configuration at one memory limit."""

    limit_bytes: int
    name: str
    median_tok_s: float
    min_tok_s: float
    max_tok_s: float
    ratio_to_off: float
    read_mib_per_token: float  # median over the rounds
    major_faults_per_token: float
    drive_utilisation: float  # bytes read per decode second over the drive's sequential bandwidth
    read_recall: float | None
    precision: float | None
    prefetched_experts: int
    prefetched_bytes: int
    already_resident_bytes: int
    failed_ranges: int
    dropped_bytes: int


def measure_memory(
    model: Path, cfgs: Sequence[Config], lib: Path, opts: BenchOptions, limits: Sequence[int], bandwidth_mb_s: float
) -> list[MemoryRow]:
    """Every configuration at every limit (each limit's rounds alternating), in limit order."""
    rows = []
    for limit in limits:
        samples = collect(model, cfgs, lib, None, replace(opts, memory_limit=limit))
        off = statistics.median(s.tok_s for s in samples[OFF])
        for cfg in cfgs:
            got = samples[cfg.name]
            toks = [s.tok_s for s in got]
            med = statistics.median(toks)
            read = statistics.median(s.read_bytes / opts.generate for s in got)
            faults = statistics.median(s.major_faults / opts.generate for s in got)
            util = statistics.median(s.read_bytes / s.seconds / (bandwidth_mb_s * 1e6) for s in got)
            rows.append(
                MemoryRow(
                    limit,
                    cfg.name,
                    med,
                    min(toks),
                    max(toks),
                    med / off,
                    read / 2**20,
                    faults,
                    util,
                    *trace_figures(Path(cfg.env[ENV_OUT])),
                )  # fmt: skip
            )
    return rows


def markdown_memory(rows: Sequence[MemoryRow], header: str) -> str:
    lines = [
        header,
        "",
        "| limit MiB | configuration | decode tok/s (median) | min | max | vs patched off | MiB read/token "
        "| major faults/token | drive busy | read recall | experts prefetched | MiB prefetched | of it resident "
        "| failed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.limit_bytes / 2**20:.0f} | {r.name} | {r.median_tok_s:.2f} | {r.min_tok_s:.2f} | "
            f"{r.max_tok_s:.2f} | {r.ratio_to_off:.3f} | {r.read_mib_per_token:.2f} | "
            f"{r.major_faults_per_token:.1f} | {pct(r.drive_utilisation)} | {pct(r.read_recall)} | "
            f"{r.prefetched_experts} | {r.prefetched_bytes / 2**20:.1f} | {r.already_resident_bytes / 2**20:.1f} | "
            f"{r.failed_ranges} |"
        )
    return "\n".join(lines)
