"""The page model's constants, each with where it came from: measured, given or assumed.

``onebit-stats simulate --granularity page | --memory-limit | --measured`` (commands/simulate_pages.py)
hands what its command line gave as :class:`PageOptions` (None: not given); :func:`resolve` turns
them, the trace and a measured report (costmodel/measured.py) into the page layout and
:class:`PageSettings`, every constant a :class:`Setting` with its source: the table "The
constants: measured or assumed" of docs/cost-model.md. Nothing here probes the machine: the
readahead of the device holding the model comes from the caller (``probe``: llama/drive.py
``device_read_ahead_kb``).

A report's row is played on its own drive (:meth:`PageSettings.row_model`): on an emulated one
(onebit-bench --drive nvme,sata), the drive of that drive's profile as the report records it
(:class:`DriveModel`: its bandwidth, latency, channels as the queue depth, the mount's max_read as
the largest request) instead of the native drive's measurement; at its own read_ahead_kb (the
fault's window) unless --readahead-kb gives one for all; with its own workers and MADV_RANDOM on
the experts where its configuration sets ``random``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field, replace
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
from .drive_rates import DriveRates, load_fio
from .kernel import LLAMA_FADV_SEQUENTIAL_FACTOR
from .layout import PAGE_SIZE, ExpertLayout, layout_from_gguf, synthetic_layout
from .measured import Measured, MeasuredRow, from_bench
from .pages import PageModel
from .routing import Routing
from .row_config import RowConfig

KERNEL_READ_AHEAD_KB = 128  # the kernel's default read_ahead_kb (VM_READAHEAD_PAGES)
PAGE_CACHE_DEFAULT = "two-list"
COARSE_PAGE = 64 * 1024  # the simulation's page when slices are large (the kernel's fault_around_bytes)
COARSE_MIN_SLICE = 512 * 1024
# what --check names, in the table's order (route: a row with route-time reads, the predictor's or not)
CHECK_KINDS = ("off", "predictor", "advise", "read", "populate", "route", "oracle")
CHECK_DEFAULT = ("off", "advise", "route")
TOLERANCE_PCT = 25.0

RATES_SUMMARY_BYTES = 1 << 20  # with --drive-rates, the one bandwidth reported (and the limits') is the rate here

T = TypeVar("T")


class PageUsageError(ValueError):
    """A constant the model needs is neither given nor in the report (exit 2, saying what to give)."""


@dataclass(frozen=True)
class Setting(Generic[T]):
    """A constant of the model and where it came from (measured, given, assumed)."""

    value: T
    source: str


NO_RATES: Setting[DriveRates | None] = Setting(None, "none: one bandwidth and one latency")


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
    prefetch_threads: int | None = None  # None: each row's (its config, else its consumer's default)
    prefetch_room: float | None = None
    consumer_op_us: float = 0.0
    fault_us: float = 0.0
    process_bytes: float | None = None
    memory_limit: tuple[float, ...] | None = None  # bytes, each
    cold: bool = False
    check: tuple[str, ...] = CHECK_DEFAULT
    tolerance: float = TOLERANCE_PCT
    compute_from_rows: bool = False  # each measured row at its own compute (its decode split), not layer_ms
    drive_rates: tuple[Path, ...] | None = None  # fio's JSON outputs: the drive's rate by request size and depth


@dataclass(frozen=True)
class DriveModel:
    """A drive as the page model plays it (an emulated drive: from its profile in the report)."""

    bandwidth: float  # bytes/s
    latency_us: float
    queue_depth: int  # requests in service at once (an emulated drive's channels)
    request_bytes: int | None  # a request's largest (FUSE's max_read); None: no limit
    read_ahead_kb: int | None  # the mount's (None: not recorded)

    def text(self, bandwidth: Callable[[float], str]) -> str:
        """``6.0 GB/s, latency 65 us, queue depth 64, requests up to 128 KiB, read_ahead_kb 128``."""
        size = "any size" if self.request_bytes is None else f"up to {self.request_bytes // 1024} KiB"
        return (
            f"{bandwidth(self.bandwidth)}, latency {self.latency_us:g} us, queue depth {self.queue_depth}, "
            f"requests {size}, read_ahead_kb {self.read_ahead_kb}"
        )


def window_pages(read_ahead_kb: int, page_bytes: int) -> int:
    """A major fault's read-around, in simulated pages: LLAMA_FADV_SEQUENTIAL_FACTOR x read_ahead_kb."""
    return read_ahead_kb * 1024 * LLAMA_FADV_SEQUENTIAL_FACTOR // page_bytes


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
    prefetch_threads: Setting[int | None]  # None: each row's own
    prefetch_room: Setting[float | None]  # None: each row's own (a report recording its knobs)
    need_bytes: Setting[int]
    process_bytes: dict[int, Setting[int]] = field(default_factory=dict)  # per memory limit
    drives: dict[str, Setting[DriveModel]] = field(default_factory=dict)  # the report's emulated drives
    rows_read_ahead: bool = False  # each row's read_ahead_kb, where known, sets its window
    drive_rates: Setting[DriveRates | None] = NO_RATES  # the native drive's rates (None: one bandwidth, one latency)

    def as_json(self) -> dict[str, Any]:
        """``{name: {"value", "source"}}``; the process bytes as ``process_bytes@LIMIT``, the emulated
        drives as ``drive@NAME`` (the value an object of DriveModel's fields)."""
        out: dict[str, Any] = {
            f.name: {"value": getattr(self, f.name).value, "source": getattr(self, f.name).source}
            for f in dataclasses.fields(self)
            if f.name not in ("process_bytes", "drives", "rows_read_ahead", "drive_rates")
        }
        rates = self.drive_rates.value
        out["drive_rates"] = {"value": None if rates is None else rates.as_json(), "source": self.drive_rates.source}
        for limit, s in self.process_bytes.items():
            out[f"process_bytes@{limit}"] = {"value": s.value, "source": s.source}
        for name, d in self.drives.items():
            out[f"drive@{name}"] = {"value": dataclasses.asdict(d.value), "source": d.source}
        return out

    def row_model(self, base: PageModel, config: RowConfig, row: MeasuredRow | None, workers: int) -> PageModel:
        """``base`` as one row runs it: on its drive (an emulated one's profile), at its read_ahead_kb
        (where rows set the window), with ``workers``, MADV_RANDOM on the experts if it sets ``random``."""
        kw: dict[str, Any] = {"workers": workers, "random_experts": config.random}
        drive = self.drives.get(row.drive) if row is not None and row.drive is not None else None
        if drive is not None:
            d = drive.value
            kw |= {"bandwidth": d.bandwidth, "latency_ms": d.latency_us / 1000.0, "queue_depth": d.queue_depth}
            kw["max_request_bytes"] = d.request_bytes
            kw["drive_rates"] = None  # the profile's, not the native drive's
        if self.rows_read_ahead and row is not None and row.read_ahead_kb is not None and not base.cold:
            kw["window_pages"] = window_pages(row.read_ahead_kb, self.page_bytes.value)
        return replace(base, **kw)

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
            workers=self.prefetch_threads.value or PREFETCH_THREADS_DEFAULT,
            page_size=self.page_bytes.value,
            drive_rates=self.drive_rates.value,
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


def _unit(opts: PageOptions, layout: ExpertLayout, cold: bool, measured: Measured | None) -> Setting[int]:
    """The simulation's page: 4 KiB, or 64 KiB (the kernel's fault-around block) when every expert
    slice spans at least COARSE_MIN_SLICE bytes and faults read windows (not with --cold, nor for a
    report with a row that sets ``random``: its faults read single pages)."""
    if opts.page_kb is not None:
        return Setting(opts.page_kb * 1024, "given")
    exact = measured is not None and any(r.config is not None and r.config.random for r in measured.timed_rows())
    if exact:
        return Setting(PAGE_SIZE, "the kernel's page (a row reads single pages: MADV_RANDOM on the experts)")
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


def _rates(opts: PageOptions) -> Setting[DriveRates | None]:
    if opts.drive_rates is None:
        return NO_RATES
    if opts.bandwidth is not None or opts.latency_us is not None:
        raise PageUsageError("--drive-rates times the drive: leave out --bandwidth and --latency-us")
    try:
        rates = load_fio(opts.drive_rates)
    except ValueError as e:
        raise PageUsageError(f"--drive-rates: {e}") from None
    return Setting(rates, "given (fio's JSON output)")


def _drive(
    opts: PageOptions, measured: Measured | None, rates: DriveRates | None
) -> tuple[Setting[float], Setting[float]]:
    if rates is not None:
        depth = opts.queue_depth or SIM_QUEUE_DEPTH_DEFAULT
        bandwidth = Setting(rates.rate(RATES_SUMMARY_BYTES, depth), f"the drive's rates at 1 MiB and depth {depth}")
        return bandwidth, Setting(0.0, "in the drive's rates")
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


def _threads(opts: PageOptions, measured: Measured | None) -> Setting[int | None]:
    if opts.prefetch_threads is not None:
        return Setting(opts.prefetch_threads, "given")
    if measured is None:
        return Setting(PREFETCH_THREADS_DEFAULT, "the consumer's default")
    return Setting(None, f"each row's (absent: {measured.workers_default}, the default of the consumer that ran it)")


def _drives(measured: Measured | None, unit: int) -> dict[str, Setting[DriveModel]]:
    """The report's emulated drives as the model plays them: their profiles, requests up to the mount's max_read."""
    out = {}
    for d in measured.drives if measured is not None else ():
        request = max(unit, d.max_read // unit * unit)
        model = DriveModel(d.bandwidth, d.latency_us, d.channels, request, d.read_ahead_kb)
        out[d.name] = Setting(model, f"the report's drives.{d.name} (its profile; the mount's max_read)")
    return out


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
    if opts.compute_from_rows and measured is None:
        raise PageUsageError("--compute-from-rows plays a report's rows at their own compute: give --measured")
    cold = opts.cold or (measured is not None and measured.kind == "cold")
    if cold and (opts.memory_limit or (measured is not None and measured.kind == "memory")):
        raise PageUsageError(
            "--cold (or a --cold report) and a memory limit (or a --memory-limit report) are two settings"
        )
    layout, layout_src = _layout(opts, routing, measured)
    rates = _rates(opts)
    bandwidth, latency = _drive(opts, measured, rates.value)
    layer_ms = _layer_ms(opts, measured, h.n_layer)
    ra = _readahead(opts, measured, cold, probe)
    rows_ra = measured is not None and opts.readahead_kb is None and not cold
    ra = Setting(ra.value, f"{ra.source}; a row's own where the report records it") if rows_ra else ra
    unit = _unit(opts, layout, cold, measured)
    window = window_pages(ra.value, unit.value)
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
        prefetch_threads=_threads(opts, measured),
        prefetch_room=_room(opts, measured),
        need_bytes=Setting(need, f"dense tensors + {h.n_expert_used}/{h.n_expert} of the routed experts"),
        process_bytes={limit: _process_bytes(opts, measured, limit) for limit in limits if limit is not None},
        drives=_drives(measured, unit.value),
        rows_read_ahead=rows_ra,
        drive_rates=rates,
    )
    return PageSetup(layout, settings, limits, cold)
