"""The predictor and its consumer under a real memory limit (``onebit-bench MODEL --memory-limit``).

Each run is confined to a fresh memory cgroup (llama/cgroup.py) whose limit is a fraction of
the model's expert bytes, and drops the model file from the page cache after joining it, so
the kernel's own reclaim evicts expert pages as a model that does not fit would see. A limit
of ``resident`` (0 here) is the other side of the never-a-loss rule: no cgroup, the model file
read into the page cache before every run.

The configurations (each in its own process, rounds alternating, each writing a trace): the
predictor off; router and block with the consumer off, advise and read (the consumer's room
rule and guard at their defaults: the rule on, no guard); block + advise with the guard
(``guard 4``) and without the room rule (``room 0``); block + advise with a depth of every
expert (poor predictions: most reads wasted), with and without the room rule; and the oracle,
the consumer spending the routing a trace of the same tokens recorded before the rounds
(ONEBIT_MOE_PREFETCH_DEBUG_ORACLE, router mode, neither rule nor guard: the upper bound), whose
tokens are checked to route as that trace did. Per row: decode tok/s against "patched off" and against the same
predictor with the consumer off, the bytes read from the drive and the major faults per
decoded token (/proc/self/io and getrusage of the worker, all its threads), the drive's
utilisation (bytes read per second over its sequential bandwidth, measured in the same run),
the prediction's read recall and the consumer's counters from the trace.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..constants import (
    ENV_DEPTH,
    ENV_MODE,
    ENV_OUT,
    ENV_PREFETCH,
    ENV_PREFETCH_DEBUG_ORACLE,
    ENV_PREFETCH_GUARD,
    ENV_PREFETCH_ROOM,
)
from ..trace import Trace
from .bench_cold import pct, trace_figures
from .rounds import BenchOptions, Config, collect, run_one

RESIDENT = 0  # a limit of 0: no cgroup, the model read into the page cache first
OFF = "patched off"
GUARD = "guard 4"  # the configuration's qualifier: the consumer's guard on, 4 tokens per probe
NO_ROOM = "room 0"  # ... the room rule off


def memory_configs(trace_dir: Path, n_expert: int) -> list[Config]:
    """The predictor off; router and block with the consumer off, advise and read; the never-a-loss
    pairs (block + advise with the guard, and without the room rule; every expert read, with and
    without the rule); the oracle."""

    def cfg(name: str, out: str, **env: str) -> Config:
        return Config(name, {**env, ENV_OUT: str(trace_dir / f"{out}.bin")})

    out = [cfg(OFF, "off")]
    for mode in ("router", "block"):
        for consumer in ("off", "advise", "read"):
            name = mode if consumer == "off" else f"{mode} + {consumer}"
            out.append(cfg(name, f"{mode}-{consumer}", **{ENV_MODE: mode, ENV_PREFETCH: consumer}))
    advise = {ENV_MODE: "block", ENV_PREFETCH: "advise"}
    out.append(cfg(f"block + advise, {GUARD}", "block-advise-guard", **advise, **{ENV_PREFETCH_GUARD: "4"}))
    out.append(cfg(f"block + advise, {NO_ROOM}", "block-advise-noroom", **advise, **{ENV_PREFETCH_ROOM: "0"}))
    deep = {**advise, ENV_DEPTH: str(n_expert)}
    out.append(cfg(f"block + advise, depth {n_expert}", "block-advise-deep", **deep))
    out.append(
        cfg(
            f"block + advise, depth {n_expert}, {NO_ROOM}",
            "block-advise-deep-noroom",
            **deep,
            **{ENV_PREFETCH_ROOM: "0"},
        )
    )
    oracle = {
        ENV_MODE: "router",
        ENV_PREFETCH: "advise",
        ENV_PREFETCH_GUARD: "0",
        ENV_PREFETCH_ROOM: "0",
        ENV_PREFETCH_DEBUG_ORACLE: str(oracle_source(trace_dir)),
    }
    out.append(cfg(ORACLE, "oracle", **oracle))
    return out


ORACLE = "oracle + advise"


def oracle_source(trace_dir: Path) -> Path:
    """Where the oracle's routing is recorded before the rounds."""
    return trace_dir / "oracle-source.bin"


def consumer_off_of(name: str) -> str:
    """The configuration with the same predictor and the consumer off (the never-a-loss baseline)."""
    return "router" if name == ORACLE else name.split(" + ")[0]


class OracleMismatch(RuntimeError):
    """The oracle run's tokens did not route as the recorded trace: its upper bound would be wrong."""


def routing_by_row(path: Path) -> dict[tuple[int, int, int], bytes]:
    """(seq_id, pos, layer) -> the actual experts' bytes, of every record of a trace."""
    rec = Trace.open(path).records
    ids = np.ascontiguousarray(rec["actual_ids"])
    return {
        (int(s), int(p), int(layer)): ids[i].tobytes()
        for i, (s, p, layer) in enumerate(zip(rec["seq_id"], rec["pos"], rec["layer"], strict=True))
    }


def check_oracle(source: Path, run: Path) -> None:
    """Every row the oracle run computed routes as the source trace recorded it."""
    want, got = routing_by_row(source), routing_by_row(run)
    missing = [k for k in got if k not in want]
    differ = [k for k in got if k in want and want[k] != got[k]]
    if missing or differ:
        raise OracleMismatch(
            f"the oracle run's routing is not the recorded one: {len(missing)} row(s) missing from "
            f"{source}, {len(differ)} routed differently (not the same tokens?)"
        )


@dataclass(frozen=True)
class MemoryRow:
    """One configuration at one memory limit (limit_bytes 0: resident)."""

    limit_bytes: int
    name: str
    median_tok_s: float
    min_tok_s: float
    max_tok_s: float
    ratio_to_off: float
    ratio_to_consumer_off: float  # against the same predictor with the consumer off (never a loss: >= 1)
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
    env: dict[str, str] = field(default_factory=dict)  # the configuration's ONEBIT_* knobs, its trace path left out


def measure_memory(
    model: Path, cfgs: Sequence[Config], lib: Path, opts: BenchOptions, limits: Sequence[int], bandwidth_mb_s: float
) -> list[MemoryRow]:
    """Every configuration at every limit (each limit's rounds alternating), in limit order."""
    oracle = next((c for c in cfgs if c.name == ORACLE), None)
    if oracle is not None:
        # the routing of the same tokens, recorded once with nothing confined
        source = Path(oracle.env[ENV_PREFETCH_DEBUG_ORACLE])
        run_one(model, Config("oracle source", {ENV_OUT: str(source)}), lib, replace(opts, memory_limit=None))
    rows = []
    for limit in limits:
        resident = limit == RESIDENT
        samples = collect(
            model, cfgs, lib, None, replace(opts, memory_limit=None if resident else limit, warm=resident)
        )
        if oracle is not None:
            check_oracle(source, Path(oracle.env[ENV_OUT]))
        medians = {name: statistics.median(s.tok_s for s in got) for name, got in samples.items()}
        for cfg in cfgs:
            got = samples[cfg.name]
            toks = [s.tok_s for s in got]
            med = medians[cfg.name]
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
                    med / medians[OFF],
                    med / medians.get(consumer_off_of(cfg.name), med),
                    read / 2**20,
                    faults,
                    util,
                    *trace_figures(Path(cfg.env[ENV_OUT])),
                    {k: v for k, v in cfg.env.items() if k != ENV_OUT},
                )  # fmt: skip
            )
    return rows


def limit_label(limit_bytes: int) -> str:
    return "resident" if limit_bytes == RESIDENT else f"{limit_bytes / 2**20:.0f}"


def markdown_memory(rows: Sequence[MemoryRow], header: str) -> str:
    lines = [
        header,
        "",
        "| limit MiB | configuration | decode tok/s (median) | min | max | vs patched off | vs consumer off "
        "| MiB read/token | major faults/token | drive busy | read recall | experts prefetched | MiB prefetched "
        "| of it resident | failed |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {limit_label(r.limit_bytes)} | {r.name} | {r.median_tok_s:.2f} | {r.min_tok_s:.2f} | "
            f"{r.max_tok_s:.2f} | {r.ratio_to_off:.3f} | {r.ratio_to_consumer_off:.3f} | {r.read_mib_per_token:.2f} | "
            f"{r.major_faults_per_token:.1f} | {pct(r.drive_utilisation)} | {pct(r.read_recall)} | "
            f"{r.prefetched_experts} | {r.prefetched_bytes / 2**20:.1f} | {r.already_resident_bytes / 2**20:.1f} | "
            f"{r.failed_ranges} |"
        )
    return "\n".join(lines)
