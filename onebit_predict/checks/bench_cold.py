"""The prefetch consumer, measured with the experts on the drive (``onebit-bench MODEL.gguf --cold``).

The bundled models fit in memory many times over; this mode makes them behave like a model
that does not. Before every decoded token each worker (checks/worker.py) evicts the
model's expert pages (llama/evict.py: MADV_DONTNEED plus POSIX_FADV_DONTNEED, or
MADV_PAGEOUT, whichever works on the machine, detected first), with readahead off on them,
so each token faults its experts in from the drive. The configurations: the model warm (no
eviction, for scale), then evicted with the predictor off, router and block, each with the
consumer off, advise and read, all writing a trace; in read mode each token waits for its
own reads (ONEBIT_MOE_PREFETCH_DEBUG_DRAIN), so no late read refills the next token. The
drive under the model is measured in the same run (llama/drive.py). The table: decode
tok/s against the evicted "patched off", the largest share of expert pages resident as a
token started (the proof that the eviction held), the prediction's read recall and precision
and the consumer's counters, from each configuration's trace.

Each row is a :class:`RowPlan`: its configuration (costmodel/row_config.py ``RowConfig``: the name,
the ONEBIT_* variables, the ``config`` object each row of the report carries) and the worker's
run of it (checks/rounds.py ``Config``: that environment with the row's trace).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..constants import ENV_OUT, ENV_PREFETCH_DEBUG_DRAIN
from ..costmodel.row_config import RowConfig
from ..metrics.stats import compute_stats
from ..trace import Trace
from .rounds import BenchOptions, Config, collect, worker_json

WARM = "patched off, warm"


@dataclass(frozen=True)
class RowPlan:
    """A benchmark row: its configuration, and the worker's run of it (the name, the environment
    with the row's trace, whether its expert pages are evicted)."""

    config: RowConfig
    run: Config

    @property
    def name(self) -> str:
        return self.run.name

    @property
    def env(self) -> dict[str, str]:
        return self.run.env

    @classmethod
    def of(cls, config: RowConfig, trace: Path, **extra: str) -> RowPlan:
        """The worker runs the configuration's environment, ``extra`` variables and its trace ``trace``."""
        return cls(config, Config(config.name, {**config.env(), **extra, ENV_OUT: str(trace)}))


def cold_configs(trace_dir: Path) -> list[RowPlan]:
    """--cold: the consumer off/advise/read for each predictor; every run writes a trace."""
    off = RowConfig()
    out = [
        RowPlan(off, Config(WARM, {ENV_OUT: str(trace_dir / "warm.bin")}, evict=False)),
        RowPlan.of(off, trace_dir / "off.bin"),
    ]
    for mode in ("router", "block"):
        for consumer in ("off", "advise", "read"):
            # read mode's workers may still be reading when a token ends: each token waits for its
            # own reads (timed), so no late read refills the next token's evicted experts
            drain = {ENV_PREFETCH_DEBUG_DRAIN: "1"}
            out.append(RowPlan.of(RowConfig(mode, consumer), trace_dir / f"{mode}-{consumer}.bin", **drain))
    return out


@dataclass(frozen=True)
class ColdRow:
    """--cold: one configuration's decode speed with the experts on the drive, and what its trace shows."""

    name: str
    median_tok_s: float
    min_tok_s: float
    max_tok_s: float
    ratio_to_off: float
    resident_after_evict: float | None  # the most of the expert pages resident as a token started (None: warm)
    read_recall: float | None  # of the prediction, over the decode rows (onebit-stats)
    precision: float | None
    prefetched_experts: int  # the consumer's totals (0 without a consumer)
    prefetched_bytes: int
    already_resident_bytes: int
    failed_ranges: int
    dropped_bytes: int
    config: RowConfig = RowConfig()  # what the row ran (the report's "config" object)


def trace_figures(path: Path) -> tuple[float | None, float | None, int, int, int, int, int]:
    trace = Trace.open(path)
    metrics = compute_stats(trace).total.metrics()
    t = trace.header.prefetch_totals
    pf = (t.experts, t.bytes, t.resident_bytes, t.failed, t.dropped_bytes) if t else (0, 0, 0, 0, 0)
    return (metrics["read_recall"], metrics["precision"], *pf)


def measure_cold(model: Path, plans: Sequence[RowPlan], lib: Path, opts: BenchOptions) -> list[ColdRow]:
    samples = collect(model, [p.run for p in plans], lib, None, opts)
    off = statistics.median(s.tok_s for s in samples[RowConfig().name])
    rows = []
    for plan in plans:
        got = samples[plan.name]
        toks = [s.tok_s for s in got]
        med = statistics.median(toks)
        left = max(s.resident_after_evict or 0.0 for s in got) if plan.run.evict else None
        # the trace of the last round; every round runs the same tokens
        figures = trace_figures(Path(plan.env[ENV_OUT]))
        rows.append(ColdRow(plan.name, med, min(toks), max(toks), med / off, left, *figures, plan.config))
    return rows


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown_cold(rows: Sequence[ColdRow], header: str) -> str:
    lines = [
        header,
        "",
        "| configuration | decode tok/s (median) | min | max | vs patched off | expert pages "
        "resident at token start (max) | read recall | precision | experts prefetched | MiB prefetched "
        "| of it resident already | failed | dropped by cap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.median_tok_s:.1f} | {r.min_tok_s:.1f} | {r.max_tok_s:.1f} | "
            f"{r.ratio_to_off:.3f} | {pct(r.resident_after_evict)} | {pct(r.read_recall)} | "
            f"{pct(r.precision)} | {r.prefetched_experts} | "
            f"{r.prefetched_bytes / 2**20:.2f} | {r.already_resident_bytes / 2**20:.2f} | {r.failed_ranges} | "
            f"{r.dropped_bytes} |"
        )
    return "\n".join(lines)


def detect_eviction(model: Path, lib: Path) -> tuple[str, list[str], int]:
    """(method, what each method did, expert bytes) from a worker that maps the model (WorkerError if none works)."""
    out = worker_json(["--detect", str(model)], lib, "eviction check failed")
    return out["method"], out["notes"], out["expert_bytes"]
