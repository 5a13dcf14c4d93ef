"""The page model against the benchmarks: which configurations a trace plays, each row played, the check.

:func:`check_pages` plays the page model (costmodel/pages.py) with the constants costmodel/page_settings.py
resolves: without a report, every configuration of ``onebit-bench`` the trace covers
(:func:`configurations`: the predictor off, the trace's mode alone, ``+ advise``, ``+ read``, route
time alone and with the mode's reads, and for a router trace the oracle) at each memory limit;
with a report (costmodel/measured.py), each of its rows whose configuration (costmodel/row_config.py
``RowConfig``) the trace can play (:func:`playable`: the trace's predictor, depth and lookahead) at
the report's limits, next to what was measured. Each row plays the consumer's room rule with its
own factor: the row's knobs as the consumer reads them (policy.parse_prefetch on the
configuration's environment: a knob absent is its default, a bad one its default with a warning,
R above 64 clamped), none in a report written before the rule (no ``env``), ``--prefetch-room``
over all. A row of ``--check``'s kinds that misses the measurement by more than the tolerance
fails the check; a row that ran with the consumer's guard (not modelled) is shown, not checked
(in a report recording its knobs; before, the rows ran with the guard of the time and are
checked, their "no guard" twins beside them). Each row runs on its own drive, window and workers
(page_settings ``PageSettings.row_model``).
Every rule: docs/cost-model.md, "Pages", "Against the measurements".
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..constants import (
    COMPUTE_THREAD,
    ENV_PREFETCH_GUARD,
    ENV_PREFETCH_ROOM,
    ENV_PREFETCH_THREADS,
    MODE_ROUTER,
    PREFETCH_THREADS_DEFAULT,
)
from ..policy import PrefetchEnv, parse_prefetch
from ..trace import Trace
from .anon import run_anon
from .measured import Measured, MeasuredRow
from .page_settings import CHECK_KINDS, PageOptions, PageSetup, PageUsageError, resolve
from .pages import ORACLE, PageModel, PageRun, run_config
from .routing import Routing
from .row_config import NATIVE, RowConfig

logger = logging.getLogger("onebit_predict")
MIB = 2**20


def kind(config: RowConfig) -> str:
    """What ``--check`` calls a configuration: off, predictor, advise, read, populate, route (route-time
    reads, with a predictor's or not) or oracle."""
    if config.oracle:
        return "oracle"
    if config.route:
        return "route"
    if config.is_off:
        return "off"
    return "predictor" if config.consumer == "off" else config.consumer


def configurations(routing: Routing) -> list[RowConfig]:
    """Every configuration the trace covers: off, route time alone; its mode alone, + advise, + read,
    + read + route; the oracle with advise (router traces: the benchmark's oracle runs router mode)."""
    out = [RowConfig(), RowConfig(route=True)]
    if routing.has_predictor:
        mode = routing.header.mode_name
        out += [RowConfig(mode, consumer) for consumer in ("off", "advise", "read")]
        out.append(RowConfig(mode, "read", route=True))
        if mode == "router":
            out.append(RowConfig("router", "advise", oracle=True))
    return out


def playable(config: RowConfig | None, routing: Routing) -> bool:
    """The trace can play this configuration: the predictor off, or the trace's own (the oracle: a
    router trace's) at the trace's depth (None: the default, n_expert_used) and lookahead; route
    time's expert LRU, with a predictor's guesses in its room for them (costmodel/keep.py); route time's
    wait (not with advise); the workers' pread; the matmuls' hits-first order (ONEBIT_MOE_PREFETCH_ORDER,
    with route time); the LRU in anonymous memory of its own (keep anon, costmodel/anon.py). Not a
    batch's whole layers ahead (ONEBIT_MOE_PREFETCH_LAYERS)."""
    if config is None:
        return False
    if config.wait and (not config.route or config.consumer == "advise"):
        return False
    if config.keep not in (None, "kernel") and not config.route:
        return False
    if config.order == "hits" and not config.route:
        return False  # hits first orders route time's reads
    if config.layers or config.handback:
        return False  # nor batches' reads of whole layers: the trace plays decode
    if config.is_off:
        return True
    h = routing.header
    if not routing.has_predictor or config.predictor != h.mode_name:
        return False
    depth = None if h.depth == h.n_expert_used else h.depth
    return config.depth == depth and (config.ahead or 1) == h.ahead


@dataclass(frozen=True)
class Row:
    """A configuration played at one limit, with what was measured where a report has it."""

    limit_bytes: int | None
    run: PageRun
    config: RowConfig  # as played: its room factor and guard settled (guard None: unknown)
    measured: MeasuredRow | None
    checked: bool
    capacity_pages: int | None
    room_source: str  # where the room factor came from: "env", "default", "given", ...
    model: PageModel | None = None  # the model as this row played it (its drive, window, workers)

    @property
    def kind(self) -> str:
        return kind(self.config)

    @property
    def room_text(self) -> str:
        """The room rule for this row: '-' (no consumer), 'no rule' (R 0), 'held' or 'issues' (R)."""
        if self.run.consumer == "off":
            return "-"
        room = self.config.room or 0.0
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

    def values(self) -> dict[str, Any]:
        """The row's figures, simulated and measured, per token (the report's ``rows``)."""
        run, m, model = self.run, self.measured, self.model
        route_mib = run.per_token(run.route_missing_pages * run.page_size / MIB) if run.route else None
        m_route = None if m is None or m.route_missing_per_token is None else m.route_missing_per_token / MIB
        return {
            "limit_bytes": self.limit_bytes,
            "configuration": run.name,
            "kind": self.kind,
            "capacity_pages": self.capacity_pages,
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
            "error_pct": self.error_pct,
            "checked": self.checked,
            "prefetch_room": self.config.room,
            "prefetch_room_source": self.room_source,
            "prefetch_guard": self.config.guard,
            "room_held": run.room_held,
            "room_rule": self.room_text,
            "need_mib": run.need_bytes / MIB,
            "drive": None if m is None else m.drive,
            "workers": None if model is None else model.workers,
            "layer_ms": None if model is None else model.layer_ms,
            "read_around_kib": None if model is None else model.window_pages * model.page_size // 1024,
            "route_missing_mib_per_token": route_mib,
            "measured_route_missing_mib_per_token": m_route,
            "stale_ranges_per_token": run.per_token(run.stale_ranges) if run.route else None,
            "keep_capacity": run.keep_capacity,
            "keep_evicted_per_token": run.per_token(run.keep_evicted) if run.keep else None,
            "route_wait_ms_per_token": run.per_token(run.route_wait_ms) if run.wait else None,
            "guesses_skipped_per_token": run.per_token(run.spec_skipped) if run.keep and run.predictor else None,
            "guesses_unused_per_token": run.per_token(run.spec_unused) if run.keep and run.predictor else None,
        }


@dataclass(frozen=True)
class PageCheck:
    """The rows played (and, against a report, checked)."""

    setup: PageSetup
    rows: list[Row]
    unplayed: list[str]  # the report's rows that are no configuration of this trace
    measured: Measured | None
    tolerance: float

    @property
    def checked(self) -> list[Row]:
        return [r for r in self.rows if r.checked]

    @property
    def misses(self) -> list[Row]:
        return [r for r in self.rows if r.missed(self.tolerance)] if self.measured is not None else []


def row_layer_ms(m: MeasuredRow | None, n_layers: int) -> float | None:
    """A measured row's own compute a layer: its decode split's compute ms a token (the decoding thread's
    CPU: one compute thread) over the trace's MoE layers; None where it has none (the given layer ms)."""
    d = None if m is None else m.decode
    if d is None or d.compute_ms is None or d.compute_basis != COMPUTE_THREAD or n_layers < 1:
        return None
    return d.compute_ms / n_layers


def played(config: RowConfig, recorded: bool, given: float | None, where: str) -> tuple[RowConfig, str]:
    """The configuration with the room factor, guard and workers the model plays it with, and the
    factor's source: ``given`` (--prefetch-room) over all; a report recording its knobs: the
    consumer's reading of the configuration's variables (a bad one warned about, as the consumer
    does; the workers where it sets them, clamped as the consumer does); a report written before the
    rule: no rule, the guard unknown."""
    if not recorded:
        if given is not None:
            return replace(config, room=given), "given"
        return replace(config, room=0.0), "report without env: measured before the rule"
    env = config.env()
    policy, warnings = parse_prefetch(PrefetchEnv.from_environ(env), MODE_ROUTER)
    for w in warnings:
        if any(name in w for name in (ENV_PREFETCH_ROOM, ENV_PREFETCH_GUARD, ENV_PREFETCH_THREADS)):
            logger.warning("%s: %s", where, w)
    config = replace(config, workers=policy.n_threads if ENV_PREFETCH_THREADS in env else None)
    if given is not None:
        return replace(config, room=given, guard=policy.guard), "given"
    return replace(config, room=policy.room, guard=policy.guard), "env" if ENV_PREFETCH_ROOM in env else "default"


def _rows_at(
    opts: PageOptions, trace: Trace, routing: Routing, measured: Measured | None, setup: PageSetup, limit: int | None
) -> tuple[list[Row], set[str]]:
    """Every configuration of the trace at one limit (with a report: those of its rows the trace plays),
    and the names of the report's rows it does not play."""
    s = setup.settings
    capacity = None
    if limit is not None:
        proc = s.process_bytes[limit]
        capacity = int((limit - proc.value) // s.page_bytes.value)
        if capacity < 1:
            raise PageUsageError(f"process bytes {proc.value} leave no page cache under the limit {limit}")
    model = s.model(trace.header.n_layer, capacity, setup.cold)
    if measured is None:
        room = s.prefetch_room.value
        todo = [(replace(c, room=room), c.name, None, s.prefetch_room.source) for c in configurations(routing)]
        unplayed: set[str] = set()
    else:
        here = {r.name: r for r in measured.timed_rows() if r.limit_bytes == limit}
        # a row on an emulated drive whose profile the report lacks has no drive to play on
        mine = [m for m in here.values() if playable(m.config, routing) and m.drive in (None, NATIVE, *s.drives)]
        unplayed = set(here) - {m.name for m in mine}
        mine.sort(key=lambda m: CHECK_KINDS.index(kind(m.config)))  # stable: the report's order within a kind
        todo = []
        for m in mine:
            assert m.config is not None
            where = f"{measured.path}: {m.name}"
            config, source = played(m.config, measured.knobs_recorded, opts.prefetch_room, where)
            todo.append((config, m.name, m, source))
    # one simulation per configuration (predictor, call, route, keep, wait, order) and model
    runs: dict[tuple[str | None, str, bool, bool | str, bool, bool, PageModel], PageRun] = {}
    rows = []
    default_workers = s.prefetch_threads.value or (measured.workers_default if measured else PREFETCH_THREADS_DEFAULT)
    for config, name, m, source in todo:
        predictor = ORACLE if config.oracle else config.predictor
        workers = s.prefetch_threads.value or config.workers or default_workers
        played_model = replace(s.row_model(model, config, m, workers), prefetch_room=config.room or 0.0)
        own = row_layer_ms(m, len(routing.layers)) if opts.compute_from_rows else None
        played_model = played_model if own is None else replace(played_model, layer_ms=own)
        keep, wait, order = config.keep == "lru", bool(config.wait), config.order == "hits"
        held = "anon" if config.keep == "anon" else keep  # keep anon: its own model (costmodel/anon.py)
        key = (predictor, config.consumer, config.route, held, wait, order, played_model)
        if key not in runs:
            if config.keep == "anon":
                runs[key] = run_anon(routing, setup.layout, played_model, predictor, name, trace, order)
            else:
                runs[key] = run_config(
                    routing,
                    setup.layout,
                    played_model,
                    predictor,
                    config.consumer,
                    name,
                    trace,
                    config.route,
                    keep,
                    wait,
                    order,
                )
        # the model has no guard: a row of a report recording its knobs that ran with one is shown,
        # not checked (reports before them: the guarded rows are checked, "no guard" beside them)
        guarded = measured is not None and measured.knobs_recorded and (config.guard or 0) > 0
        consumer_on = config.consumer != "off" or config.route
        checked = m is not None and kind(config) in opts.check and not (guarded and consumer_on)
        rows.append(Row(limit, replace(runs[key], name=name), config, m, checked, capacity, source, played_model))
    return rows, unplayed


def check_pages(
    opts: PageOptions,
    trace: Trace,
    routing: Routing,
    measured: Measured | None = None,
    probe: Callable[[Path], int | None] | None = None,
) -> PageCheck:
    """The page model of the trace at every limit; with ``measured``, each of its rows the trace
    plays, checked against it (``probe``: the device readahead of a file here, page_settings.resolve)."""
    setup = resolve(opts, trace, routing, measured, probe)
    if measured is not None and measured.generate is not None and measured.generate != routing.n_tokens:
        logger.warning(
            "the report decoded %d tokens, the trace has %d decode tokens: not the same run",
            measured.generate,
            routing.n_tokens,
        )
    rows: list[Row] = []
    unplayed: set[str] = set()
    for limit in setup.limits:
        got, left = _rows_at(opts, trace, routing, measured, setup, limit)
        rows += got
        unplayed |= left
    if measured is not None and not rows:
        mode = trace.header.mode_name
        raise PageUsageError(f"{measured.path}: no row of the report is a configuration of a {mode} trace")
    return PageCheck(setup, rows, sorted(unplayed), measured, opts.tolerance)
