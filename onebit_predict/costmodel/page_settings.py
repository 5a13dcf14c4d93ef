"""The page model's constants, each with where it came from: measured, given or assumed.

``onebit-stats simulate --granularity page | --memory-limit | --measured`` (commands/simulate_pages.py)
hands what its command line gave as :class:`PageOptions` (None: not given); :func:`resolve` turns
them, the trace and a measured report (costmodel/measured.py) into the page layout and
:class:`PageSettings`, every constant a :class:`Setting` with its source: the table "The
constants: measured or assumed" of docs/cost-model.md. Nothing here probes the machine: the
readahead of the device holding the model comes from the caller (``probe``: llama/drive.py
``device_read_ahead_kb``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar

from ..constants import (
    ENV_PREFETCH_ROOM,
    PREFETCH_ROOM_DEFAULT,
    PREFETCH_THREADS_DEFAULT,
    SIM_LATENCY_US_DEFAULT,
    SIM_QUEUE_DEPTH_DEFAULT,
    SIM_ROUTE_AT_DEFAULT,
)
from ..trace import Trace
from .kernel import LLAMA_FADV_SEQUENTIAL_FACTOR
from .layout import PAGE_SIZE, ExpertLayout, layout_from_gguf, synthetic_layout
from .measured import Measured, from_bench
from .pages import PageModel
from .routing import Routing

KERNEL_READ_AHEAD_KB = 128  # the kernel's default read_ahead_kb (VM_READAHEAD_PAGES)
PAGE_CACHE_DEFAULT = "two-list"
COARSE_PAGE = 64 * 1024  # the simulation's page when slices are large (the kernel's fault_around_bytes)
COARSE_MIN_SLICE = 512 * 1024
CHECK_KINDS = ("off", "predictor", "advise", "read", "oracle")  # what --check names, in the table's order
CHECK_DEFAULT = ("off", "advise")
TOLERANCE_PCT = 25.0

T = TypeVar("T")


class PageUsageError(ValueError):
    """A constant the model needs is neither given nor in the report (exit 2, saying what to give)."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    """A constant of the model and where it came from (measured, given, assumed)."""

    value: T
    source: str


@dataclass(frozen=True)
class PageOptions:
    """What the command line gave the page model (None: not given), by the names of its options."""

    model: Path | None = None
    expert_bytes: float | None = None
    bandwidth: tuple[float, ...] | None = None  # the page model takes one
    latency_us: float | None = None
    queue_depth: int | None = None
    layer_ms: float | None = None
    bench_json: Path | None = None
    route_at: float | None = None
    predictor_cost_pct: float | None = None
    readahead_kb: int | None = None
    page_kb: int | None = None
    page_cache: str | None = None
    prefetch_threads: int = PREFETCH_THREADS_DEFAULT
    prefetch_room: float | None = None
    consumer_op_us: float = 0.0
    fault_us: float = 0.0
    process_bytes: float | None = None
    memory_limit: tuple[float, ...] | None = None  # bytes, each
    cold: bool = False
    check: tuple[str, ...] = CHECK_DEFAULT
    tolerance: float = TOLERANCE_PCT


@dataclass(frozen=True)
class PageSettings:
    """Every constant of the page model with its source, in the order the reports print them."""

    layout: Setting[str | int]  # the GGUF or the synthetic expert size
    bandwidth_bytes_s: Setting[float]
    latency_us: Setting[float]
    layer_ms: Setting[float]
    route_at: Setting[float]
    predictor_cost_pct: Setting[float]
    read_ahead_kb: Setting[int]
    read_around_pages: Setting[int]
    page_bytes: Setting[int]
    page_cache: Setting[str]
    consumer_op_us: Setting[float]
    fault_us: Setting[float]
    queue_depth: Setting[int]
    prefetch_threads: Setting[int]
    prefetch_room: Setting[float | None]  # None: each row's own (a report recording its knobs)
    need_bytes: Setting[int]
    process_bytes: dict[int, Setting[int]] = field(default_factory=dict)  # per memory limit

    def as_json(self) -> dict[str, dict[str, Any]]:
        """``{name: {"value", "source"}}``; the process bytes as ``process_bytes@LIMIT``."""
        out = {
            f.name: {"value": getattr(self, f.name).value, "source": getattr(self, f.name).source}
            for f in dataclasses.fields(self)
            if f.name != "process_bytes"
        }
        for limit, s in self.process_bytes.items():
            out[f"process_bytes@{limit}"] = {"value": s.value, "source": s.source}
        return out

    def model(self, n_layer: int, capacity_pages: int | None, cold: bool) -> PageModel:
        """The page model at one page-cache capacity (None: unbounded); the room rule is each row's."""
        layer_ms = self.layer_ms.value
        return PageModel(
            bandwidth=self.bandwidth_bytes_s.value,
            latency_ms=self.latency_us.value / 1000.0,
            queue_depth=self.queue_depth.value,
            layer_ms=layer_ms,
            route_at=self.route_at.value,
            capacity_pages=capacity_pages,
            window_pages=self.read_around_pages.value,
            cold=cold,
            page_cache=self.page_cache.value,
            predictor_cost_ms=self.predictor_cost_pct.value / 100.0 * n_layer * layer_ms,
            op_ms=self.consumer_op_us.value / 1000.0,
            fault_ms=self.fault_us.value / 1000.0,
            workers=self.prefetch_threads.value,
            page_size=self.page_bytes.value,
        )


@dataclass(frozen=True)
class PageSetup:
    """What :func:`resolve` settles: the layout, the constants, the limits to play, cold or not."""

    layout: ExpertLayout
    settings: PageSettings
    limits: tuple[int | None, ...]  # None: no limit (unbounded, or --cold)
    cold: bool


def _given(value: T | None, default: T) -> Setting[T]:
    return Setting(default, "assumed (default)") if value is None else Setting(value, "given")


def _layout(opts: PageOptions, routing: Routing, measured: Measured | None) -> tuple[ExpertLayout, Setting[str | int]]:
    h = routing.header
    if opts.model is not None:
        layout, _ = layout_from_gguf(opts.model)
        return layout, Setting(str(opts.model), "the GGUF's tensors (dense ones included)")
    if opts.expert_bytes is not None:
        size = float(opts.expert_bytes)
        src = "--expert-bytes, synthetic layout"
    elif measured is not None and measured.expert_bytes:
        size = measured.expert_bytes / (h.n_layer * h.n_expert)
        src = f"the report's expert_bytes / ({h.n_layer} layers x {h.n_expert} experts), synthetic layout"
    else:
        raise PageUsageError("give --model or --expert-bytes (or --measured with a report holding expert_bytes)")
    return synthetic_layout({layer: size for layer in range(h.n_layer)}, h.n_expert), Setting(round(size), src)


def _unit(opts: PageOptions, layout: ExpertLayout, cold: bool) -> Setting[int]:
    """The simulation's page: 4 KiB, or 64 KiB (the kernel's fault-around block) when every expert
    slice spans at least COARSE_MIN_SLICE bytes and faults read windows (not with --cold)."""
    if opts.page_kb is not None:
        return Setting(opts.page_kb * 1024, "given")
    if not cold and layout.smallest_slice() >= COARSE_MIN_SLICE:
        return Setting(COARSE_PAGE, f"every expert slice >= {COARSE_MIN_SLICE // 1024} KiB: 64 KiB blocks")
    return Setting(PAGE_SIZE, "the kernel's page")


def _readahead(
    opts: PageOptions, measured: Measured | None, cold: bool, probe: Callable[[Path], int | None] | None
) -> Setting[int]:
    if cold:
        return Setting(0, "--cold: MADV_RANDOM, a fault reads its page")
    if opts.readahead_kb is not None:
        return Setting(opts.readahead_kb, "given")
    if measured is not None and measured.read_ahead_kb is not None:
        return Setting(measured.read_ahead_kb, "measured (drive.read_ahead_kb)")
    for path in (opts.model, Path(measured.model) if measured else None):
        if path is not None and probe is not None:
            kb = probe(path)
            if kb is not None:
                return Setting(kb, f"this machine's device holding {path}")
    return Setting(KERNEL_READ_AHEAD_KB, "assumed (the kernel's default)")


def _layer_ms(opts: PageOptions, measured: Measured | None, n_layer: int) -> Setting[float]:
    if opts.layer_ms is not None:
        return Setting(opts.layer_ms, "given")
    if opts.bench_json is not None:
        return Setting(from_bench(opts.bench_json, "", n_layer)[0], f"resident run ({opts.bench_json})")
    if measured is not None and measured.warm_tok_s:
        return Setting(1000.0 / measured.warm_tok_s / n_layer, "resident run (the report's warm row)")
    raise PageUsageError(
        "give the per-layer compute of a resident run: --layer-ms MS or --bench-json FILE (onebit-bench --json "
        "of the same model, nothing evicted)"
    )


def _cost_pct(opts: PageOptions, mode: str, n_layer: int) -> Setting[float]:
    if opts.predictor_cost_pct is not None:
        return Setting(opts.predictor_cost_pct, "given")
    if opts.bench_json is not None:
        cost = from_bench(opts.bench_json, mode, n_layer)[1]
        if cost is not None:
            return Setting(cost, f"measured ({opts.bench_json})")
    return Setting(0.0, "assumed 0")


def _drive(opts: PageOptions, measured: Measured | None) -> tuple[Setting[float], Setting[float]]:
    if opts.bandwidth is not None and len(opts.bandwidth) > 1:
        raise PageUsageError("the page model takes one --bandwidth")
    if opts.bandwidth is not None:
        bandwidth = Setting(opts.bandwidth[0], "given")
    elif measured is not None and measured.bandwidth:
        bandwidth = Setting(measured.bandwidth, "measured (the report's drive)")
    else:
        raise PageUsageError("give --bandwidth (or --measured with a report holding the drive)")
    if opts.latency_us is not None:
        latency = Setting(opts.latency_us, "given")
    elif measured is not None and measured.latency_us is not None:
        latency = Setting(measured.latency_us, "measured (the report's drive.page_read_us)")
    else:
        latency = Setting(SIM_LATENCY_US_DEFAULT, "assumed (default)")
    return bandwidth, latency


def _room(opts: PageOptions, measured: Measured | None) -> Setting[float | None]:
    if measured is None or opts.prefetch_room is not None:
        room = PREFETCH_ROOM_DEFAULT if opts.prefetch_room is None else opts.prefetch_room
        return Setting(room, "given" if opts.prefetch_room is not None else "default")
    if not measured.knobs_recorded:
        return Setting(0.0, "the report has no env: measured before the rule, played without it")
    return Setting(None, f"each row's env ({ENV_PREFETCH_ROOM}; absent: {PREFETCH_ROOM_DEFAULT:g})")


def _process_bytes(opts: PageOptions, measured: Measured | None, limit: int) -> Setting[int]:
    if opts.process_bytes is not None:
        return Setting(int(opts.process_bytes), "given")
    rows = {r.name: r for r in measured.timed_rows() if r.limit_bytes == limit} if measured is not None else {}
    got = next((r.process_bytes for r in rows.values() if r.process_bytes is not None), None)
    if got is not None:
        return Setting(got, "measured (the row's process_bytes)")
    if measured is not None and measured.process_bytes is not None:
        return Setting(measured.process_bytes, "measured (the report's process_bytes)")
    raise PageUsageError(
        "give --process-bytes: what a run holds in its cgroup besides the model's page cache "
        "(the report has no process_bytes)"
    )


def resolve(
    opts: PageOptions,
    trace: Trace,
    routing: Routing,
    measured: Measured | None,
    probe: Callable[[Path], int | None] | None = None,
) -> PageSetup:
    """The layout, every constant with its source, the limits to play and whether tokens run cold.

    ``probe``: the read_ahead_kb of the device holding a file on this machine (None: not probed)."""
    h = trace.header
    cold = opts.cold or (measured is not None and measured.kind == "cold")
    if cold and (opts.memory_limit or (measured is not None and measured.kind == "memory")):
        raise PageUsageError(
            "--cold (or a --cold report) and a memory limit (or a --memory-limit report) are two settings"
        )
    layout, layout_src = _layout(opts, routing, measured)
    bandwidth, latency = _drive(opts, measured)
    layer_ms = _layer_ms(opts, measured, h.n_layer)
    ra = _readahead(opts, measured, cold, probe)
    unit = _unit(opts, layout, cold)
    window = ra.value * 1024 * LLAMA_FADV_SEQUENTIAL_FACTOR // unit.value
    need = layout.token_need_bytes(h.n_expert_used)
    if measured is not None and measured.kind == "memory":
        limits: tuple[int | None, ...] = tuple(int(x) for x in (opts.memory_limit or measured.limits))
    else:
        limits = tuple(int(x) for x in opts.memory_limit) if opts.memory_limit else (None,)
    settings = PageSettings(
        layout=layout_src,
        bandwidth_bytes_s=bandwidth,
        latency_us=latency,
        layer_ms=layer_ms,
        route_at=_given(opts.route_at, SIM_ROUTE_AT_DEFAULT),
        predictor_cost_pct=_cost_pct(opts, h.mode_name, h.n_layer),
        read_ahead_kb=ra,
        read_around_pages=Setting(window, f"{LLAMA_FADV_SEQUENTIAL_FACTOR} x read_ahead_kb (FADV_SEQUENTIAL)"),
        page_bytes=unit,
        page_cache=Setting(opts.page_cache, "given") if opts.page_cache else Setting(PAGE_CACHE_DEFAULT, "default"),
        consumer_op_us=Setting(opts.consumer_op_us, "given" if opts.consumer_op_us else "assumed 0"),
        fault_us=Setting(opts.fault_us, "given" if opts.fault_us else "assumed 0"),
        queue_depth=_given(opts.queue_depth, SIM_QUEUE_DEPTH_DEFAULT),
        prefetch_threads=Setting(opts.prefetch_threads, "given"),
        prefetch_room=_room(opts, measured),
        need_bytes=Setting(need, f"dense tensors + {h.n_expert_used}/{h.n_expert} of the routed experts"),
        process_bytes={limit: _process_bytes(opts, measured, limit) for limit in limits if limit is not None},
    )
    return PageSetup(layout, settings, limits, cold)
