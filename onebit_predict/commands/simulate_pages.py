"""``onebit-stats simulate ... --granularity page | --memory-limit L | --measured F.json``: the page-granular model.

The command side of the page model: its options, and the table, ``--json`` or ``--csv`` of what
costmodel/page_check.py plays (the model in costmodel/pages.py, its constants in costmodel/page_settings.py;
every rule in docs/cost-model.md, "Pages"): the page cache bounded by a memory limit (or
unbounded, or emptied before every token with ``--cold``), the kernel's read-around on a major
fault, the consumer's ``advise`` and ``read`` as the requests they are; one row per
configuration of ``onebit-bench`` that the trace's mode covers ("patched off", the mode alone,
"+ advise", "+ read").

``--measured F.json`` takes an ``onebit-bench --memory-limit ... --json`` or ``--cold --json``
report: its drive, limits (and resident run, for --cold) set the model, and each row
measured is printed next to the model's, with the error; a checked row (``--check``) that
misses by more than ``--tolerance`` % makes the command exit 1. Each row plays the consumer's
room rule with its own factor (the row's configuration; none for reports without ``env``;
``--prefetch-room`` otherwise), and the table says per row whether the rule held the consumer off.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import logging
import sys
from pathlib import Path

from ..constants import ENV_PREFETCH_ROOM, EXIT_CHECK_FAILED, EXIT_OK, PREFETCH_ROOM_DEFAULT
from ..costmodel.kernel import PAGE_CACHES
from ..costmodel.measured import load_measured
from ..costmodel.page_check import PageCheck, Row, check_pages
from ..costmodel.page_settings import (
    CHECK_DEFAULT,
    CHECK_KINDS,
    KERNEL_READ_AHEAD_KB,
    PAGE_CACHE_DEFAULT,
    TOLERANCE_PCT,
    PageOptions,
)
from ..costmodel.routing import Routing
from ..llama.drive import device_read_ahead_kb
from ..moe_check import require_trace_model
from ..trace import Trace
from ..units import fmt_bandwidth, parse_size
from .cache_args import header_summary
from .common import arg_type, comma_list, fmt, nonneg_float, positive_int, table
from .page_args import check_kinds, page_kb, room, size_or_zero, tolerance

logger = logging.getLogger("onebit_predict")
MIB = 2**20


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
        type=arg_type(size_or_zero),
        metavar="SIZE",
        help="what the process holds in its cgroup besides the model's page cache (anonymous memory, "
        "compute buffers); needed with a memory limit unless the measured report has it",
    )
    g.add_argument(
        "--drive-rates",
        type=arg_type(comma_list(Path)),
        metavar="FIO.json[,FIO.json...]",
        help="the native drive as fio times it: fio's --output-format=json of random reads, one job per "
        "request size (bs) and depth (iodepth), a full grid (a cell timed in several files: their mean); "
        "a request is served at the rate of its size and of the requests in flight (instead of "
        "--bandwidth and --latency-us)",
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
        type=arg_type(page_kb),
        metavar="KB",
        help="the simulation's page (default 4, or 64 when every expert slice is at least 512 KiB and "
        "faults read windows): a coarser page is faster to simulate",
    )
    g.add_argument(
        "--prefetch-threads",
        type=arg_type(positive_int),
        metavar="N",
        help="the consumer's workers (ONEBIT_MOE_PREFETCH_THREADS; default the consumer's, with --measured each row's)",
    )
    g.add_argument(
        "--prefetch-room",
        type=arg_type(room),
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
        "--compute-from-rows",
        action="store_true",
        help="--measured: play each row at its own measured compute (its decode split's compute ms a token "
        "over the trace's MoE layers) instead of --layer-ms, so the check is of the reads and waits alone",
    )
    g.add_argument(
        "--check",
        type=arg_type(check_kinds),
        default=CHECK_DEFAULT,
        metavar="KINDS",
        help=f"the rows --measured checks: some of {','.join(CHECK_KINDS)} (default {','.join(CHECK_DEFAULT)})",
    )
    g.add_argument(
        "--tolerance",
        type=arg_type(tolerance),
        default=TOLERANCE_PCT,
        metavar="PCT",
        help=f"--measured: the largest error a checked row may have, %% (default {TOLERANCE_PCT:g})",
    )


def wants_pages(args: argparse.Namespace) -> bool:
    return args.granularity == "page" or args.memory_limit is not None or args.measured is not None


def options(args: argparse.Namespace) -> PageOptions:
    """The page model's options as given (None: not given; the model settles each and says why)."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(PageOptions)}
    return PageOptions(**{k: tuple(v) if isinstance(v, list) else v for k, v in given.items()})


def run(args: argparse.Namespace, trace: Trace, routing: Routing) -> int:
    """The page-granular model (and, with --measured, the check against a measured report)."""
    measured = load_measured(args.measured) if args.measured is not None else None
    if args.model is not None:
        require_trace_model(args.model, trace.header.n_expert, routing.layers)
    got = check_pages(options(args), trace, routing, measured, probe=device_read_ahead_kb)
    if args.compute_from_rows:
        logger.info("each row with a decode split plays at its own compute (json: layer_ms), the others at --layer-ms")
    if got.unplayed:
        logger.info("not simulated (not a configuration of this trace): %s", ", ".join(got.unplayed))
    if args.json:
        print(_json(trace, routing, got))
    elif args.csv:
        _csv(got.rows)
    else:
        print(_render(trace, routing, got))
    if measured is None:
        return EXIT_OK
    if got.misses:
        logger.error(
            "%d of %d checked rows miss by more than %g %%: %s",
            len(got.misses),
            len(got.checked),
            got.tolerance,
            "; ".join(f"{_limit_text(r.limit_bytes)} {r.run.name} {r.error_pct:+.1f} %" for r in got.misses),
        )
        return EXIT_CHECK_FAILED
    logger.info("%d checked rows within %g %%", len(got.checked), got.tolerance)
    return EXIT_OK


def _limit_text(limit: int | None) -> str:
    if limit is None:
        return "cold"
    return f"{limit / MIB:.0f} MiB" if limit >= MIB else f"{limit / 1024:.0f} KiB"


def _json(trace: Trace, routing: Routing, got: PageCheck) -> str:
    measured = got.measured
    return json.dumps(
        {
            "trace": str(trace.path),
            "header": header_summary(trace.header),
            "tokens": routing.n_tokens,
            "granularity": "page",
            "measured": None if measured is None else str(measured.path),
            "model": got.setup.settings.as_json(),
            "tolerance_pct": got.tolerance if measured is not None else None,
            "ok": None if measured is None else not got.misses,
            "rows": [r.values() for r in got.rows],
        },
        indent=2,
        allow_nan=False,
    )


def _csv(rows: list[Row]) -> None:
    w = csv.writer(sys.stdout, lineterminator="\n")
    if not rows:
        return
    w.writerow(list(rows[0].values()))
    for r in rows:
        w.writerow(["" if v is None else v for v in r.values().values()])


_MEASURED_COLUMNS = [("measured_tok_s", ".2f"), ("tok_s", ".2f"), ("error_pct", "+.1f")]
_MEASURED_COLUMNS += [("measured_read_mib_per_token", ".1f"), ("read_mib_per_token", ".1f")]
_MEASURED_COLUMNS += [("measured_major_faults_per_token", ".1f"), ("major_faults_per_token", ".1f")]
_MEASURED_COLUMNS += [("measured_route_missing_mib_per_token", ".1f"), ("route_missing_mib_per_token", ".1f")]


def _render(trace: Trace, routing: Routing, got: PageCheck) -> str:
    h, s, measured = trace.header, got.setup.settings, got.measured
    room = s.prefetch_room
    out = [
        f"{trace.path}: {routing.n_tokens} decode tokens | model {h.model or '?'} | mode {h.mode_name} | "
        f"n_expert {h.n_expert} | n_used {h.n_expert_used} | page-granular model",
        f"layout: {s.layout.value} ({s.layout.source})",
        f"drive {fmt_bandwidth(s.bandwidth_bytes_s.value)} ({s.bandwidth_bytes_s.source}), "
        f"latency {s.latency_us.value:g} us ({s.latency_us.source})",
        f"layer {s.layer_ms.value:.4g} ms ({s.layer_ms.source}), routed at {s.route_at.value:g} "
        f"({s.route_at.source}), predictor cost {s.predictor_cost_pct.value:.3g} % ({s.predictor_cost_pct.source})",
        f"read_ahead_kb {s.read_ahead_kb.value} ({s.read_ahead_kb.source}): a fault reads "
        f"{s.read_around_pages.value * s.page_bytes.value // 1024} KiB around its page "
        f"(pages of {s.page_bytes.value // 1024} KiB: {s.page_bytes.source}); page cache "
        f"{s.page_cache.value}; consumer op {s.consumer_op_us.value:g} us, fault overhead "
        f"{s.fault_us.value:g} us, prefetch threads {s.prefetch_threads.value or 'per row'}",
        f"one token's need {s.need_bytes.value / MIB:.1f} MiB ({s.need_bytes.source}); room rule "
        + (f"R {room.value:g}" if room.value is not None else "R per row")
        + f" ({room.source})",
    ]
    procs = [f"{_limit_text(limit)}: {v.value / MIB:.1f} MiB ({v.source})" for limit, v in s.process_bytes.items()]
    out += ["process bytes " + "; ".join(procs)] if procs else []
    out += [f"drive {name}: {d.value.text(fmt_bandwidth)} ({d.source})" for name, d in s.drives.items()]
    rates = s.drive_rates.value
    out += [f"drive rates {rates.text(fmt_bandwidth)} ({s.drive_rates.source})"] if rates is not None else []
    if measured is None:
        titles = ["limit", "configuration", "tok/s", "MiB read/tok", "faults/tok", "waits/tok", "stall ms/tok", "room"]
        cols = ["tok_s", "read_mib_per_token", "major_faults_per_token", "waits_per_token", "stall_ms_per_token"]
        body = []
        for r in got.rows:
            v = r.values()
            figures = [fmt(v[c], ".2f" if c == "tok_s" else ".1f") for c in cols]
            body.append([_limit_text(r.limit_bytes), r.run.name, *figures, r.room_text])
        return "\n".join([*out, "", table(titles, body)])
    titles = ["limit", "configuration", "measured tok/s", "simulated", "error %", "check", "MiB read/tok meas", "sim"]
    titles += ["faults/tok meas", "sim", "route MiB/tok meas", "sim", "room"]
    body = []
    for r in got.rows:
        v = r.values()
        f = [fmt(v[c], spec) for c, spec in _MEASURED_COLUMNS]
        verdict = "-" if not r.checked else ("MISS" if r.missed(got.tolerance) else "ok")
        body.append([_limit_text(r.limit_bytes), r.run.name, *f[:3], verdict, *f[3:], r.room_text])
    out += ["", f"against {measured.path} ({measured.kind}; checked: error within {got.tolerance:g} %)"]
    return "\n".join([*out, table(titles, body)])
