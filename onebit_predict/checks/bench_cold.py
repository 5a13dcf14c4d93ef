"""``onebit-bench MODEL.gguf --cold``: the prefetch consumer, measured with the experts on the drive.

The bundled models fit in memory many times over; this mode makes them behave like a model
that does not. Before every decoded token each worker (onebit_predict/bench.py) evicts the
model's expert pages (onebit_predict/evict.py: MADV_DONTNEED plus POSIX_FADV_DONTNEED, or
MADV_PAGEOUT, whichever works on the machine, detected first), with readahead off on them,
so each token faults its experts in from the drive. The configurations: the model warm (no
eviction, for scale), then evicted with the predictor off, router and block, each with the
consumer off, advise and read, all writing a trace; in read mode each token waits for its
own reads (ONEBIT_MOE_PREFETCH_DEBUG_DRAIN), so no late read refills the next token. The
drive under the model is measured in the same run (onebit_predict/drive.py). The table: decode
tok/s against the evicted "patched off", the largest share of expert pages resident as a
token started (the proof that the eviction held), the prediction's read recall and precision
and the consumer's counters, from each configuration's trace.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from .bench import Config, collect, worker_env
from .constants import ENV_MODE, ENV_OUT, ENV_PREFETCH, ENV_PREFETCH_DEBUG_DRAIN, EXIT_CHECK_FAILED, EXIT_OK


def cold_configs(trace_dir: Path) -> list[Config]:
    """--cold: the consumer off/advise/read for each predictor; every run writes a trace."""
    out = [Config("patched off, warm", {ENV_OUT: str(trace_dir / "warm.bin")}, evict=False),
           Config("patched off", {ENV_OUT: str(trace_dir / "off.bin")})]
    for mode in ("router", "block"):
        for consumer in ("off", "advise", "read"):
            name = mode if consumer == "off" else f"{mode} + {consumer}"
            # read mode's workers may still be reading when a token ends: each token waits for its
            # own reads (timed), so no late read refills the next token's evicted experts
            out.append(Config(name, {ENV_MODE: mode, ENV_PREFETCH: consumer, ENV_PREFETCH_DEBUG_DRAIN: "1",
                                     ENV_OUT: str(trace_dir / f"{mode}-{consumer}.bin")}))
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


def _trace_figures(path: Path) -> tuple[float | None, float | None, int, int, int, int, int]:
    from .stats import compute_stats  # noqa: PLC0415
    from .trace import Trace  # noqa: PLC0415

    trace = Trace.open(path)
    metrics = compute_stats(trace).total.metrics()
    t = trace.header.prefetch_totals
    pf = (t.experts, t.bytes, t.resident_bytes, t.failed, t.dropped_bytes) if t else (0, 0, 0, 0, 0)
    return (metrics["read_recall"], metrics["precision"], *pf)


def measure_cold(model: Path, cfgs: Sequence[Config], lib: Path, args: argparse.Namespace) -> list[ColdRow]:
    samples = collect(model, cfgs, lib, None, args)
    off = statistics.median(s.tok_s for s in samples["patched off"])
    rows = []
    for cfg in cfgs:
        toks = [s.tok_s for s in samples[cfg.name]]
        med = statistics.median(toks)
        left = max(s.resident_after_evict or 0.0 for s in samples[cfg.name]) if cfg.evict else None
        # the trace of the last round; every round runs the same tokens
        figures = _trace_figures(Path(cfg.env[ENV_OUT]))
        rows.append(ColdRow(cfg.name, med, min(toks), max(toks), med / off, left, *figures))
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def markdown_cold(rows: Sequence[ColdRow], header: str) -> str:
    lines = [header, "", "| configuration | decode tok/s (median) | min | max | vs patched off | expert pages "
             "resident at token start (max) | read recall | precision | experts prefetched | MiB prefetched "
             "| of it resident already | failed | dropped by cap |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.name} | {r.median_tok_s:.1f} | {r.min_tok_s:.1f} | {r.max_tok_s:.1f} | "
                     f"{r.ratio_to_off:.3f} | {_pct(r.resident_after_evict)} | {_pct(r.read_recall)} | "
                     f"{_pct(r.precision)} | {r.prefetched_experts} | "
                     f"{r.prefetched_bytes / 2**20:.2f} | {r.already_resident_bytes / 2**20:.2f} | {r.failed_ranges} | "
                     f"{r.dropped_bytes} |")
    return "\n".join(lines)


def detect_eviction(model: Path, lib: Path, args: argparse.Namespace) -> tuple[str, list[str], int]:
    """(method, what each method did, expert bytes) from a worker that maps the model."""
    env = worker_env(lib)
    cmd = [sys.executable, "-m", "onebit_predict.bench", "--worker", "--detect", str(model)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"eviction check failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return out["method"], out["notes"], out["expert_bytes"]


def main_cold(args: argparse.Namespace, lib: Path) -> int:
    from .drive import DriveError, measure_drive  # noqa: PLC0415

    try:
        method, notes, expert_bytes = detect_eviction(args.model, lib, args)
        drive = measure_drive(args.model.resolve().parent)
    except (RuntimeError, DriveError) as exc:
        print(f"onebit-bench: {exc}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    print(f"onebit-bench: drive under {drive.directory}: {drive.bandwidth_mb_s:.0f} MB/s sequential, "
          f"{drive.page_read_us:.0f} us per random 4 KiB read", file=sys.stderr)
    for note in notes:
        print(f"onebit-bench: eviction {note}", file=sys.stderr)
    if args.evict_method != "auto":
        method = args.evict_method
    args.cold_method = method
    with tempfile.TemporaryDirectory(prefix="onebit-bench-") as tmp:
        try:
            rows = measure_cold(args.model, cold_configs(Path(tmp)), lib, args)
        except RuntimeError as exc:
            print(f"onebit-bench: {exc}", file=sys.stderr)
            return EXIT_CHECK_FAILED
    if args.json:
        print(json.dumps({"model": str(args.model), "cold": True, "evict_method": method, "eviction_notes": notes,
                          "expert_bytes": expert_bytes, "drive": asdict(drive), "rounds": args.rounds,
                          "prompt": args.prompt, "generate": args.generate, "threads": args.threads,
                          "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print(markdown_cold(rows, f"model {args.model.name}, experts evicted before every token ({method}; "
                                  f"{expert_bytes / 2**20:.2f} MiB of expert weights), {args.rounds} alternating "
                                  f"rounds, prompt {args.prompt}, {args.generate} decoded tokens, "
                                  f"{args.threads} threads; drive {drive.bandwidth_mb_s:.0f} MB/s sequential, "
                                  f"{drive.page_read_us:.0f} us per random 4 KiB read"))
    return EXIT_OK
