"""``onebit-stats simulate ... --granularity page | --memory-limit L | --measured F.json``: the page-granular model.

The command side of cache/pages.py (every rule in docs/cost-model.md, "Pages"): the page
cache bounded by a memory limit (or unbounded, or emptied before every token with
``--cold``), the kernel's read-around on a major fault, the consumer's ``advise`` and
``read`` as the requests they are; one row per configuration of ``onebit-bench`` that the
trace's mode covers ("patched off", the mode alone, "+ advise", "+ read").

``--measured F.json`` takes an ``onebit-bench --memory-limit ... --json`` or ``--cold --json``
report: its drive, limits (and resident run, for --cold) set the model, and each row
measured is printed next to the model's, with the error; a checked row (``--check``) that
misses by more than ``--tolerance`` % makes the command exit 1. Each row plays the consumer's
room rule with its own factor (the report's per-row ``env``, ONEBIT_MOE_PREFETCH_ROOM; none
for reports without ``env``; ``--prefetch-room`` otherwise), and the table says per row
whether the rule held the consumer off.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from ..cache.expert_bytes import ModelError
from ..cache.measured import OFF, Measured, MeasuredRow, from_bench, load_measured
from ..cache.pages import (
    LLAMA_FADV_SEQUENTIAL_FACTOR,
    PAGE_CACHES,
    PAGE_SIZE,
    ExpertLayout,
    PageModel,
    PageRun,
    device_read_ahead_kb,
    layout_from_gguf,
    run_config,
    synthetic_layout,
)
from ..cache.routing import Routing
from ..constants import (
    ENV_PREFETCH_ROOM,
    EXIT_CHECK_FAILED,
    EXIT_OK,
    MODE_ROUTER,
    PREFETCH_ROOM_DEFAULT,
    PREFETCH_ROOM_MAX,
    SIM_LATENCY_US_DEFAULT,
)
from ..policy import PrefetchEnv, parse_prefetch
from ..trace import Trace
from ..units import fmt_bandwidth, parse_size
from .common import UsageError, arg_type, comma_list, fmt, header_summary, nonneg_float, positive_int, table

logger = logging.getLogger("onebit_predict")
MIB = 2**20
KERNEL_READ_AHEAD_KB = 128  # the kernel's default read_ahead_kb (VM_READAHEAD_PAGES)
CHECK_KINDS = ("off", "predictor", "advise", "read", "oracle")
CHECK_DEFAULT = ("off", "advise")
TOLERANCE_PCT = 25.0
PAGE_CACHE_DEFAULT = "two-list"
COARSE_PAGE = 64 * 1024  # the simulation's page when slices are large (the kernel's fault_around_bytes)
COARSE_MIN_SLICE = 512 * 1024


def _check_kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(dict.fromkeys(s.strip() for s in text.split(",")))
    bad = [k for k in kinds if k not in CHECK_KINDS]
    if bad or not kinds:
        raise ValueError(f"'{text}': give some of {', '.join(CHECK_KINDS)}")
    return kinds


def _tolerance(text: str) -> float:
    v = float(text)
    if not 0 < v < 1000:
        raise ValueError(f"'{text}' is not a percentage in (0, 1000)")
    return v


def configure(p: argparse.ArgumentParser) -> None:
    """The page model's options of ``onebit-stats simulate``."""
    g = p.add_argument_group("page-granular model (docs/cost-model.md, 'Pages')")
    g.add_argument(
        "--granularity",
        choices=("expert", "page"),
        help="expert: one read per expert into N slots per layer (the default); page: major faults, "
        "readahead windows and the page cache (implied by --memory-limit and --measured)",
    )
    g.add_argument(
        "--memory-limit",
        type=arg_type(comma_list(parse_size)),
        metavar="SIZE[,SIZE...]",
        help="the memory cgroup's limit (onebit-bench --memory-limit): the page cache holds the limit "
        "minus --process-bytes",
    )
    g.add_argument(
        "--process-bytes",
        type=arg_type(_size_or_zero),
        metavar="SIZE",
        help="what the process holds in its cgroup besides the model's page cache (anonymous memory, "
        "compute buffers); needed with a memory limit unless the measured report has it",
    )
    g.add_argument(
        "--page-cache",
        choices=tuple(PAGE_CACHES),
        help=f"lru: one LRU list; two-list: the kernel's inactive and active lists (default {PAGE_CACHE_DEFAULT})",
    )
    g.add_argument(
        "--readahead-kb",
        type=arg_type(lambda s: int(nonneg_float(s))),
        metavar="KB",
        help="the drive's read_ahead_kb (a major fault reads twice that around the page: llama.cpp's "
        "POSIX_FADV_SEQUENTIAL); default: the report's drive.read_ahead_kb, else the device holding "
        f"--model here, else {KERNEL_READ_AHEAD_KB}; 0 with --cold (MADV_RANDOM)",
    )
    g.add_argument(
        "--page-kb",
        type=arg_type(lambda s: _page_kb(s)),
        metavar="KB",
        help="the simulation's page (default 4, or 64 when every expert slice is at least 512 KiB and "
        "faults read windows): a coarser page is faster to simulate",
    )
    g.add_argument(
        "--prefetch-threads",
        type=arg_type(positive_int),
        default=2,
        metavar="N",
        help="the consumer's workers (ONEBIT_MOE_PREFETCH_THREADS, default 2)",
    )
    g.add_argument(
        "--prefetch-room",
        type=arg_type(lambda s: _room(s)),
        metavar="R",
        help=f"the consumer's room rule ({ENV_PREFETCH_ROOM}): it issues nothing while the page cache under the "
        "limit (the limit minus --process-bytes) is below R x the mapped bytes one token reads; 0: no rule "
        f"(default {PREFETCH_ROOM_DEFAULT:g}; with --measured: each row's env, 0 for reports without one)",
    )
    g.add_argument(
        "--consumer-op-us",
        type=arg_type(nonneg_float),
        default=0.0,
        metavar="US",
        help="the consumer's op on the compute thread, per predicted layer (default 0)",
    )
    g.add_argument(
        "--fault-us",
        type=arg_type(nonneg_float),
        default=0.0,
        metavar="US",
        help="a major fault's CPU cost beyond the drive's latency (default 0)",
    )
    g.add_argument(
        "--measured",
        type=Path,
        metavar="FILE.json",
        help="an onebit-bench --memory-limit or --cold --json report: model its runs and print measured "
        "against simulated per row; exit 1 when a checked row misses by more than --tolerance",
    )
    g.add_argument(
        "--check",
        type=arg_type(_check_kinds),
        default=CHECK_DEFAULT,
        metavar="KINDS",
        help=f"the rows --measured checks: some of {','.join(CHECK_KINDS)} (default {','.join(CHECK_DEFAULT)})",
    )
    g.add_argument(
        "--tolerance",
        type=arg_type(_tolerance),
        default=TOLERANCE_PCT,
        metavar="PCT",
        help=f"--measured: the largest error a checked row may have, %% (default {TOLERANCE_PCT:g})",
    )


def _room(text: str) -> float:
    v = nonneg_float(text)
    if v > PREFETCH_ROOM_MAX:
        raise ValueError(f"'{text}' is above {PREFETCH_ROOM_MAX:g} (the consumer clamps {ENV_PREFETCH_ROOM} there)")
    return v


def _size_or_zero(text: str) -> float:
    return 0.0 if text.strip() == "0" else parse_size(text)


def _page_kb(text: str) -> int:
    v = positive_int(text)
    if v % 4 or v & (v - 1):
        raise ValueError(f"'{text}' is not a power of two multiple of 4 KiB")
    return v


def wants_pages(args: argparse.Namespace) -> bool:
    return args.granularity == "page" or args.memory_limit is not None or args.measured is not None


@dataclass(frozen=True)
class Setting:
    """A constant of the model and where it came from (measured, given, assumed)."""

    value: float | int | str | None
    source: str


def _layout(args: argparse.Namespace, routing: Routing, measured: Measured | None) -> tuple[ExpertLayout, Setting]:
    h = routing.header
    if args.model is not None:
        if not args.model.is_file():
            raise ModelError(f"{args.model}: no such file")
        layout, n_expert = layout_from_gguf(args.model)
        if n_expert != h.n_expert:
            raise ModelError(f"{args.model} has {n_expert} experts per layer, the trace {h.n_expert}: not its model")
        missing = sorted(set(routing.layers) - set(layout.layers))
        if missing:
            raise ModelError(f"{args.model} has no expert tensors for layers {missing}, which the trace routes")
        return layout, Setting(str(args.model), "the GGUF's tensors (dense ones included)")
    if args.expert_bytes is not None:
        size = float(args.expert_bytes)
        src = "--expert-bytes, synthetic layout"
    elif measured is not None and measured.expert_bytes:
        size = measured.expert_bytes / (h.n_layer * h.n_expert)
        src = f"the report's expert_bytes / ({h.n_layer} layers x {h.n_expert} experts), synthetic layout"
    else:
        raise UsageError("give --model or --expert-bytes (or --measured with a report holding expert_bytes)")
    return synthetic_layout({layer: size for layer in range(h.n_layer)}, h.n_expert), Setting(round(size), src)


def _unit(args: argparse.Namespace, layout: ExpertLayout, cold: bool) -> Setting:
    """The simulation's page: 4 KiB, or 64 KiB (the kernel's fault-around block) when every expert
    slice spans at least COARSE_MIN_SLICE bytes and faults read windows (not with --cold)."""
    if args.page_kb is not None:
        return Setting(args.page_kb * 1024, "given")
    smallest = min(t.slice_bytes for ts in layout.layers.values() for t in ts)
    if not cold and smallest >= COARSE_MIN_SLICE:
        return Setting(COARSE_PAGE, f"every expert slice >= {COARSE_MIN_SLICE // 1024} KiB: 64 KiB blocks")
    return Setting(PAGE_SIZE, "the kernel's page")


def _readahead(args: argparse.Namespace, measured: Measured | None, cold: bool) -> Setting:
    if cold:
        return Setting(0, "--cold: MADV_RANDOM, a fault reads its page")
    if args.readahead_kb is not None:
        return Setting(args.readahead_kb, "given")
    if measured is not None and measured.read_ahead_kb is not None:
        return Setting(measured.read_ahead_kb, "measured (drive.read_ahead_kb)")
    for path in (args.model, Path(measured.model) if measured else None):
        if path is not None:
            kb = device_read_ahead_kb(path)
            if kb is not None:
                return Setting(kb, f"this machine's device holding {path}")
    return Setting(KERNEL_READ_AHEAD_KB, "assumed (the kernel's default)")


def _layer_ms(args: argparse.Namespace, measured: Measured | None, n_layer: int) -> Setting:
    if args.layer_ms is not None:
        return Setting(args.layer_ms, "given")
    if args.bench_json is not None:
        return Setting(from_bench(args.bench_json, "", n_layer)[0], f"resident run ({args.bench_json})")
    if measured is not None and measured.warm_tok_s:
        return Setting(1000.0 / measured.warm_tok_s / n_layer, "resident run (the report's warm row)")
    raise UsageError(
        "give the per-layer compute of a resident run: --layer-ms MS or --bench-json FILE (onebit-bench --json "
        "of the same model, nothing evicted)"
    )


def _cost_pct(args: argparse.Namespace, mode: str, n_layer: int) -> Setting:
    if args.predictor_cost_pct is not None:
        return Setting(args.predictor_cost_pct, "given")
    if args.bench_json is not None:
        cost = from_bench(args.bench_json, mode, n_layer)[1]
        if cost is not None:
            return Setting(cost, f"measured ({args.bench_json})")
    return Setting(0.0, "assumed 0")


@dataclass(frozen=True)
class Config:
    """A configuration of onebit-bench the trace lets the model play."""

    name: str
    predictor: str | None  # the trace's mode, "oracle" (its actual routing), None (off)
    consumer: str
    kind: str  # what --check calls it

    def matches(self, row: MeasuredRow, depth: int | None) -> bool:
        """The row is this configuration (at the trace's depth; a guard is not modelled, see guarded)."""
        pred, consumer, row_depth, _ = row.parts
        if (pred, consumer) != (self.predictor, self.consumer):
            return False
        return pred is None or row_depth == depth


def configurations(routing: Routing) -> list[Config]:
    """Every configuration the trace covers: off, its mode alone, + advise, + read; the oracle
    with advise (router traces: the benchmark's oracle runs router mode)."""
    out = [Config(OFF, None, "off", "off")]
    if routing.has_predictor:
        mode = routing.header.mode_name
        out += [Config(mode, mode, "off", "predictor"), Config(f"{mode} + advise", mode, "advise", "advise")]
        out += [Config(f"{mode} + read", mode, "read", "read")]
        if mode == "router":
            out.append(Config("oracle + advise", "oracle", "advise", "oracle"))
    return out


def _trace_depth(routing: Routing) -> int | None:
    """The depth a row's name carries for this trace: None at the default (n_expert_used)."""
    h = routing.header
    return None if h.depth == h.n_expert_used else h.depth


@dataclass(frozen=True)
class RowKnobs:
    """The consumer's knobs a measured row ran with (its report's per-row "env"), as the model plays them."""

    room: float  # ONEBIT_MOE_PREFETCH_ROOM (0: no rule)
    guard: int | None  # ONEBIT_MOE_PREFETCH_GUARD (None: unknown, a report without env); not modelled
    source: str  # "env", "given", "default", or why the rule is off


def _knobs(env: dict[str, str] | None, given: float | None, where: str) -> RowKnobs:
    """A row's room factor and guard: --prefetch-room when given; else its env, read as the consumer
    reads it (policy.parse_prefetch: a knob absent is its default, a bad value its default with a
    warning, R above the maximum clamped); a report without env: no rule (measured before it), the
    guard unknown."""
    if env is None:
        if given is not None:
            return RowKnobs(given, None, "given")
        return RowKnobs(0.0, None, "report without env: measured before the rule")
    policy, warnings = parse_prefetch(PrefetchEnv.from_environ(env), MODE_ROUTER)
    for w in warnings:
        if "PREFETCH_ROOM" in w or "PREFETCH_GUARD" in w:
            logger.warning("%s: %s", where, w)
    if given is not None:
        return RowKnobs(given, policy.guard, "given")
    return RowKnobs(policy.room, policy.guard, "env" if ENV_PREFETCH_ROOM in env else "default")


@dataclass(frozen=True)
class Row:
    limit_bytes: int | None
    run: PageRun
    kind: str
    measured: MeasuredRow | None
    checked: bool
    capacity_pages: int | None
    knobs: RowKnobs | None = None

    @property
    def room_text(self) -> str:
        """The room rule for this row: '-' (no consumer), 'no rule' (R 0), 'held' or 'issues' (R)."""
        if self.run.consumer == "off":
            return "-"
        room = self.knobs.room if self.knobs is not None else 0.0
        if room == 0:
            return "no rule"
        return f"{'held' if self.run.room_held else 'issues'} (R {room:g})"

    @property
    def error_pct(self) -> float | None:
        if self.measured is None or self.run.tok_s is None or not self.measured.tok_s > 0:
            return None
        return 100.0 * (self.run.tok_s / self.measured.tok_s - 1.0)

    def missed(self, tolerance: float) -> bool:
        e = self.error_pct
        return self.checked and (e is None or abs(e) > tolerance)


def _drive(args: argparse.Namespace, measured: Measured | None) -> tuple[Setting, Setting]:
    if args.bandwidth is not None and len(args.bandwidth) > 1:
        raise UsageError("the page model takes one --bandwidth")
    if args.bandwidth is not None:
        bandwidth = Setting(args.bandwidth[0], "given")
    elif measured is not None and measured.bandwidth:
        bandwidth = Setting(measured.bandwidth, "measured (the report's drive)")
    else:
        raise UsageError("give --bandwidth (or --measured with a report holding the drive)")
    if args.latency_us is not None:
        latency = Setting(args.latency_us, "given")
    elif measured is not None and measured.latency_us is not None:
        latency = Setting(measured.latency_us, "measured (the report's drive.page_read_us)")
    else:
        latency = Setting(SIM_LATENCY_US_DEFAULT, "assumed (default)")
    return bandwidth, latency


def _process_bytes(args: argparse.Namespace, measured: Measured | None, rows: dict[str, MeasuredRow]) -> Setting:
    if args.process_bytes is not None:
        return Setting(int(args.process_bytes), "given")
    got = next((r.process_bytes for r in rows.values() if r.process_bytes is not None), None)
    if got is not None:
        return Setting(got, "measured (the row's process_bytes)")
    if measured is not None and measured.process_bytes is not None:
        return Setting(measured.process_bytes, "measured (the report's process_bytes)")
    raise UsageError(
        "give --process-bytes: what a run holds in its cgroup besides the model's page cache "
        "(the report has no process_bytes)"
    )


def _settings(args: argparse.Namespace, trace: Trace, routing: Routing, measured: Measured | None, cold: bool):
    """(layout, every constant with its source) of the page model the command line asks for."""
    h = trace.header
    layout, layout_src = _layout(args, routing, measured)
    bandwidth, latency = _drive(args, measured)
    layer_ms = _layer_ms(args, measured, h.n_layer)
    ra = _readahead(args, measured, cold)
    unit = _unit(args, layout, cold)
    window = int(ra.value) * 1024 * LLAMA_FADV_SEQUENTIAL_FACTOR // int(unit.value)
    return layout, {
        "layout": layout_src,
        "bandwidth_bytes_s": bandwidth,
        "latency_us": latency,
        "layer_ms": layer_ms,
        "route_at": Setting(args.route_at, "given" if args.route_at_given else "assumed (default)"),
        "predictor_cost_pct": _cost_pct(args, h.mode_name, h.n_layer),
        "read_ahead_kb": ra,
        "read_around_pages": Setting(window, f"{LLAMA_FADV_SEQUENTIAL_FACTOR} x read_ahead_kb (FADV_SEQUENTIAL)"),
        "page_bytes": unit,
        "page_cache": Setting(args.page_cache, "given" if args.page_cache_given else "default"),
        "consumer_op_us": Setting(args.consumer_op_us, "given" if args.consumer_op_us else "assumed 0"),
        "fault_us": Setting(args.fault_us, "given" if args.fault_us else "assumed 0"),
        "queue_depth": Setting(args.queue_depth, "given" if args.queue_depth_given else "assumed (default)"),
        "prefetch_threads": Setting(args.prefetch_threads, "given"),
    }


def _page_model(args: argparse.Namespace, s: dict, n_layer: int, capacity: int | None, cold: bool) -> PageModel:
    layer_ms = float(s["layer_ms"].value)
    return PageModel(
        bandwidth=float(s["bandwidth_bytes_s"].value),
        latency_ms=float(s["latency_us"].value) / 1000.0,
        queue_depth=args.queue_depth,
        layer_ms=layer_ms,
        route_at=args.route_at,
        capacity_pages=capacity,
        window_pages=int(s["read_around_pages"].value),
        cold=cold,
        page_cache=args.page_cache,
        predictor_cost_ms=float(s["predictor_cost_pct"].value) / 100.0 * n_layer * layer_ms,
        op_ms=args.consumer_op_us / 1000.0,
        fault_ms=args.fault_us / 1000.0,
        workers=args.prefetch_threads,
        page_size=int(s["page_bytes"].value),
    )


def _rows_at(args, trace, routing, measured, layout, settings, limit, cold) -> list[Row]:
    """Every configuration of the trace at one limit (with --measured: those the report has)."""
    here = {r.name: r for r in measured.timed_rows() if r.limit_bytes == limit} if measured else {}
    capacity = None
    if limit is not None:
        proc = _process_bytes(args, measured, here)
        settings[f"process_bytes@{limit}"] = proc
        capacity = int((limit - int(proc.value)) // int(settings["page_bytes"].value))
        if capacity < 1:
            raise UsageError(f"process bytes {proc.value} leave no page cache under the limit {limit}")
    model = _page_model(args, settings, trace.header.n_layer, capacity, cold)
    depth = _trace_depth(routing)
    rows, played = [], set()
    for c in configurations(routing):
        matched = [m for m in here.values() if c.matches(m, depth)] if measured is not None else [None]
        if not matched:
            continue
        runs: dict[float, PageRun] = {}  # one simulation per room factor the matched rows ran with
        for m in matched:
            if m is None:  # no report: the factor run() settled (given or the default)
                knobs = RowKnobs(settings["prefetch_room"].value, None, settings["prefetch_room"].source)
            else:
                env = None if not measured.has_env else (m.env or {})
                knobs = _knobs(env, args.prefetch_room, f"{measured.path}: {m.name}")
            if knobs.room not in runs:
                runs[knobs.room] = run_config(
                    routing, layout, replace(model, prefetch_room=knobs.room), c.predictor, c.consumer, c.name, trace
                )
            name = c.name if m is None else m.name
            played.add(name)
            # the model has no guard: a row of a report with env that ran with one is shown, not checked
            # (reports without env: as before, the guarded rows are checked, "no guard" beside them)
            guarded = knobs.guard is not None and knobs.guard > 0 and c.consumer != "off"
            checked = m is not None and c.kind in args.check and not guarded
            rows.append(Row(limit, replace(runs[knobs.room], name=name), c.kind, m, checked, capacity, knobs))
    args.unplayed = sorted(set(getattr(args, "unplayed", ())) | (set(here) - played))
    return rows


def run(args: argparse.Namespace, trace: Trace, routing: Routing) -> int:
    """The page-granular model (and, with --measured, the check against a measured report)."""
    measured = load_measured(args.measured) if args.measured is not None else None
    h = trace.header
    cold = args.cold or (measured is not None and measured.kind == "cold")
    if cold and (args.memory_limit or (measured is not None and measured.kind == "memory")):
        raise UsageError("--cold (or a --cold report) and a memory limit (or a --memory-limit report) are two settings")
    layout, settings = _settings(args, trace, routing, measured, cold)
    need = layout.token_need_bytes(h.n_expert_used)
    if measured is None or args.prefetch_room is not None:
        room = PREFETCH_ROOM_DEFAULT if args.prefetch_room is None else args.prefetch_room
        room_setting = Setting(room, "given" if args.prefetch_room is not None else "default")
    elif not measured.has_env:
        room_setting = Setting(0.0, "the report has no env: measured before the rule, played without it")
    else:
        room_setting = Setting(None, f"each row's env ({ENV_PREFETCH_ROOM}; absent: {PREFETCH_ROOM_DEFAULT:g})")
    settings["prefetch_room"] = room_setting
    settings["need_bytes"] = Setting(need, f"dense tensors + {h.n_expert_used}/{h.n_expert} of the routed experts")
    if measured is not None and measured.kind == "memory":
        limits: list[int | None] = [int(x) for x in (args.memory_limit or measured.limits)]
    else:
        limits = [int(x) for x in args.memory_limit] if args.memory_limit else [None]
    if measured is not None and measured.generate is not None and measured.generate != routing.n_tokens:
        logger.warning(
            "the report decoded %d tokens, the trace has %d decode tokens: not the same run",
            measured.generate,
            routing.n_tokens,
        )
    rows: list[Row] = []
    for limit in limits:
        rows += _rows_at(args, trace, routing, measured, layout, settings, limit, cold)
    if getattr(args, "unplayed", None):
        logger.info("not simulated (not a configuration of this trace): %s", ", ".join(args.unplayed))
    if measured is not None and not rows:
        raise UsageError(f"{args.measured}: no row of the report is a configuration of a {h.mode_name} trace")
    misses = [r for r in rows if r.missed(args.tolerance)] if measured is not None else []
    if args.json:
        print(_json(trace, routing, measured, settings, rows, args.tolerance, misses))
    elif args.csv:
        _csv(rows)
    else:
        print(_render(trace, routing, measured, settings, rows, args.tolerance))
    if measured is None:
        return EXIT_OK
    checked = [r for r in rows if r.checked]
    if misses:
        logger.error(
            "%d of %d checked rows miss by more than %g %%: %s",
            len(misses),
            len(checked),
            args.tolerance,
            "; ".join(f"{_limit_text(r.limit_bytes)} {r.run.name} {r.error_pct:+.1f} %" for r in misses),
        )
        return EXIT_CHECK_FAILED
    logger.info("%d checked rows within %g %%", len(checked), args.tolerance)
    return EXIT_OK


def _limit_text(limit: int | None) -> str:
    if limit is None:
        return "cold"
    return f"{limit / MIB:.0f} MiB" if limit >= MIB else f"{limit / 1024:.0f} KiB"


def _values(r: Row) -> dict[str, float | int | str | bool | None]:
    run = r.run
    m = r.measured
    return {
        "limit_bytes": r.limit_bytes,
        "configuration": run.name,
        "kind": r.kind,
        "capacity_pages": r.capacity_pages,
        "tok_s": run.tok_s,
        "read_mib_per_token": run.per_token(run.read_bytes / MIB),
        "major_faults_per_token": run.per_token(run.counts.major_faults),
        "waits_per_token": run.per_token(run.counts.waits),
        "requests_per_token": run.per_token(run.counts.requests),
        "stall_ms_per_token": run.per_token(run.stall_ms),
        "evicted_mib_per_token": run.per_token(run.evicted_pages * run.page_size / MIB),
        "measured_tok_s": None if m is None else m.tok_s,
        "measured_read_mib_per_token": None if m is None else m.read_mib_per_token,
        "measured_major_faults_per_token": None if m is None else m.major_faults_per_token,
        "error_pct": r.error_pct,
        "checked": r.checked,
        "prefetch_room": None if r.knobs is None else r.knobs.room,
        "prefetch_room_source": None if r.knobs is None else r.knobs.source,
        "prefetch_guard": None if r.knobs is None else r.knobs.guard,
        "room_held": run.room_held,
        "room_rule": r.room_text,
        "need_mib": run.need_bytes / MIB,
    }


def _settings_json(settings: dict) -> dict:
    return {k: {"value": v.value, "source": v.source} for k, v in settings.items()}


def _json(trace, routing, measured, settings, rows, tolerance, misses) -> str:
    return json.dumps(
        {
            "trace": str(trace.path),
            "header": header_summary(trace.header),
            "tokens": routing.n_tokens,
            "granularity": "page",
            "measured": None if measured is None else str(measured.path),
            "model": _settings_json(settings),
            "tolerance_pct": tolerance if measured is not None else None,
            "ok": None if measured is None else not misses,
            "rows": [_values(r) for r in rows],
        },
        indent=2,
        allow_nan=False,
    )


def _csv(rows: list[Row]) -> None:
    w = csv.writer(sys.stdout, lineterminator="\n")
    if not rows:
        return
    names = list(_values(rows[0]))
    w.writerow(names)
    for r in rows:
        w.writerow(["" if v is None else v for v in _values(r).values()])


def _render(trace, routing, measured, settings, rows, tolerance) -> str:
    h = trace.header
    s = settings
    out = [
        f"{trace.path}: {routing.n_tokens} decode tokens | model {h.model or '?'} | mode {h.mode_name} | "
        f"n_expert {h.n_expert} | n_used {h.n_expert_used} | page-granular model",
        f"layout: {s['layout'].value} ({s['layout'].source})",
        f"drive {fmt_bandwidth(float(s['bandwidth_bytes_s'].value))} ({s['bandwidth_bytes_s'].source}), "
        f"latency {float(s['latency_us'].value):g} us ({s['latency_us'].source})",
        f"layer {float(s['layer_ms'].value):.4g} ms ({s['layer_ms'].source}), routed at {s['route_at'].value:g} "
        f"({s['route_at'].source}), predictor cost {float(s['predictor_cost_pct'].value):.3g} % "
        f"({s['predictor_cost_pct'].source})",
        f"read_ahead_kb {s['read_ahead_kb'].value} ({s['read_ahead_kb'].source}): a fault reads "
        f"{int(s['read_around_pages'].value) * int(s['page_bytes'].value) // 1024} KiB around its page "
        f"(pages of {int(s['page_bytes'].value) // 1024} KiB: {s['page_bytes'].source}); page cache "
        f"{s['page_cache'].value}; consumer op {s['consumer_op_us'].value:g} us, fault overhead "
        f"{s['fault_us'].value:g} us, {s['prefetch_threads'].value} prefetch threads",
    ]
    room = s["prefetch_room"]
    out.append(
        f"one token's need {int(s['need_bytes'].value) / MIB:.1f} MiB ({s['need_bytes'].source}); room rule "
        + (f"R {room.value:g}" if room.value is not None else "R per row")
        + f" ({room.source})"
    )
    procs = [f"{_limit_text(int(k.split('@')[1]))}: {v.value / MIB:.1f} MiB ({v.source})" for k, v in s.items()
             if k.startswith("process_bytes@")]  # fmt: skip
    if procs:
        out.append("process bytes " + "; ".join(procs))
    if measured is None:
        titles = ["limit", "configuration", "tok/s", "MiB read/tok", "faults/tok", "waits/tok", "stall ms/tok", "room"]
        body = []
        for r in rows:
            v = _values(r)
            body.append(
                [
                    _limit_text(r.limit_bytes) if r.limit_bytes is not None else ("cold" if r.run else "-"),
                    r.run.name,
                    fmt(v["tok_s"], ".2f"),
                    fmt(v["read_mib_per_token"], ".1f"),
                    fmt(v["major_faults_per_token"], ".1f"),
                    fmt(v["waits_per_token"], ".1f"),
                    fmt(v["stall_ms_per_token"], ".1f"),
                    r.room_text,
                ]
            )
        return "\n".join([*out, "", table(titles, body)])
    titles = [
        "limit",
        "configuration",
        "measured tok/s",
        "simulated",
        "error %",
        "check",
        "MiB read/tok meas",
        "sim",
        "faults/tok meas",
        "sim",
        "room",
    ]
    body = []
    for r in rows:
        v = _values(r)
        verdict = "-" if not r.checked else ("MISS" if r.missed(tolerance) else "ok")
        body.append(
            [
                _limit_text(r.limit_bytes),
                r.run.name,
                fmt(v["measured_tok_s"], ".2f"),
                fmt(v["tok_s"], ".2f"),
                fmt(v["error_pct"], "+.1f"),
                verdict,
                fmt(v["measured_read_mib_per_token"], ".1f"),
                fmt(v["read_mib_per_token"], ".1f"),
                fmt(v["measured_major_faults_per_token"], ".1f"),
                fmt(v["major_faults_per_token"], ".1f"),
                r.room_text,
            ]
        )
    out += ["", f"against {measured.path} ({measured.kind}; checked: error within {tolerance:g} %)"]
    return "\n".join([*out, table(titles, body)])
