"""The decode split's columns of a memory table (checks/bench_memory.py ``markdown_memory``): where each
decoded token's time went, per row (costmodel/measured.py ``DecodeSplit``), as cells and their note."""

from __future__ import annotations

from ..constants import COMPUTE_THREAD
from ..costmodel.measured import DecodeSplit
from .bench_cold import pct

DECODE_COLUMNS = (
    "compute ms",
    "wait ms",
    "run queue ms",
    "workers CPU ms",
    "requests/token",
    "mean KiB",
    "in flight",
    "busy %",
    "expert hit %",
)
DECODE_NOTE = (
    "Per decoded token: compute ms, the decoding thread's CPU (with --threads 1; marked (process): the process's "
    "CPU, every thread's, no wait separable), faults and reclaim in it included; wait ms, the rest of its wall "
    "time, off CPU (reads, page locks, reclaim waits); run queue ms, the part of it runnable but waiting for a "
    "core (/proc/thread-self/schedstat); workers CPU ms, the rest of the process's CPU meanwhile (the consumer's "
    "workers; with --threads 1 only). Requests: the reads the drive served meanwhile "
    "(/proc/diskstats of the model's device, or the emulator's counters), their mean size, the mean in flight "
    "(weighted ms / wall) and busy % (io_ticks / wall; diskstats only). Expert hit: the share of the routed "
    "experts' bytes resident when routed (route-time rows only)."
)


def decode_cells(d: DecodeSplit | None) -> list[str]:
    """A row's DECODE_COLUMNS ("-" where it has no figure: a report before them, a drive without times)."""
    if d is None:
        return ["-"] * len(DECODE_COLUMNS)
    compute = f"{d.compute_ms:.1f}" + ("" if d.compute_basis == COMPUTE_THREAD else f" ({d.compute_basis})")
    return [
        compute,
        _fmt(d.wait_ms, ".1f"),
        _fmt(d.run_queue_ms, ".1f"),
        _fmt(d.others_cpu_ms, ".1f"),
        _fmt(d.requests, ".1f"),
        _fmt(d.request_kib_mean, ".0f"),
        _fmt(d.in_flight, ".2f"),
        pct(d.busy),
        pct(d.expert_hit),
    ]


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)
