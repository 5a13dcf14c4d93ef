"""What ``onebit-bench --json`` measured, read for the model to be checked against (and plotted).

Two reports carry rows the page-granular model (costmodel/pages.py) can be played against:

- ``onebit-bench MODEL --memory-limit 50%,25% --json`` (commands/bench.py ``_memory``):
  top-level ``expert_bytes`` (all the routed experts' bytes), ``drive``
  (``bandwidth_mb_s``, ``page_read_us``, ``random_mb_s`` since 2026-12-05), ``memory_limits`` and ``rows``, one per
  configuration and limit (checks/bench_memory.py ``MemoryRow``: ``limit_bytes``, ``name``,
  ``median_tok_s``, ``read_mib_per_token``, ``major_faults_per_token``, ..., ``env``,
  ``config``);
- ``onebit-bench MODEL --cold --json`` (``_cold``): ``cold: true``, ``drive``, ``rows``
  (checks/bench_cold.py ``ColdRow``), the first of them the model resident ("patched off,
  warm").

:func:`load_measured` reads either (ValueError, exit 2, with what is missing otherwise).
Optional fields the model uses where a report has them: ``drive.read_ahead_kb`` (the
device's readahead), ``process_bytes`` (what a run holds in its cgroup besides the model's
page cache) at the top level or in a row, ``drive_samples`` (several drive measurements:
their median bandwidth and latency are used). Each row's configuration is a
:class:`~onebit_predict.costmodel.row_config.RowConfig`: its ``config`` object where the report has
one, else parsed from its name (row_config.from_name: reports written before the objects); a
row's ``env`` (the configuration's ONEBIT_* variables, written since the consumer's room rule)
says the report records each row's knobs; a row read by its name must agree with it (a warning
where it does not).

The drive's readahead a row ran at (:attr:`MeasuredRow.read_ahead_kb`): its configuration's
``read_ahead_kb`` (``--read-ahead-kb``: set for the run), else the value the report recorded for
every row (``drive.read_ahead_kb``: the device's as found, since reports record it), else None:
unknown. Reports written before that read as unknown, not as this machine's 8192, although
they ran at it (docs/results.md says so beside their tables). :attr:`Measured.read_ahead_kb` is
the one value of every row, None where the rows ran at several or it is unknown; ``device`` is
the report's record of the model's block device (llama/read_ahead.py ``BlockDevice``), None
before reports had it.

The drive a row read the model from (:attr:`MeasuredRow.drive`, ``--drive``): its configuration's
``drive``, else the report's one drive where its ``drives`` object records exactly one (a run
without ``--drive``: ``native``), else None: unknown (reports written before ``drives``). A row on
an emulated drive ran at that drive's readahead, not the model's device's: its configuration's
``read_ahead_kb``, else the mount's as the report's ``drives`` records it. :attr:`Measured.drives`
holds each emulated drive as the report records it (:class:`EmulatedDrive`: its profile's latency,
bandwidth and channels, the mount's max_read and read_ahead_kb), for the model to play its rows on.

The consumer's workers when a row does not set them (:attr:`Measured.workers_default`): the
default of the consumer that wrote the report, PREFETCH_THREADS_DEFAULT since route-time reads
(reports whose rows' ``config`` objects carry ``route``), PREFETCH_THREADS_BEFORE_ROUTE before.

Where each decoded token's time went (:class:`DecodeSplit`, a memory row's ``decode`` object since
issue 30; :attr:`MeasuredRow.decode`, None in reports written before): compute and waiting per
token, the read requests served meanwhile, the expert-level hit rate of route-time rows and the
room rule's last measurement. Fields a report lacks read as None.

Prompt processing (``--prompt-tokens``, checks/bench_prefill.py): a report's ``prefill_rows``, a list
apart from ``rows`` (which :func:`load_measured` reads as before, whatever the report holds besides), are
:attr:`Measured.prefill` (:class:`MeasuredPrefill`: the configuration, the prompt's tokens and ubatch,
prompt tok/s, bytes read and the floor per prompt token, where the prompt's time went); empty in reports
written before them.
"""

from __future__ import annotations

import json
import logging
import statistics
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..constants import (
    COMPUTE_THREAD,
    ENV_PREFETCH_DEBUG_ORACLE,
    PREFETCH_THREADS_BEFORE_ROUTE,
    PREFETCH_THREADS_DEFAULT,
)
from .row_config import OFF, PrefillConfig, RowConfig, from_name

logger = logging.getLogger("onebit_predict")
WARM = "patched off, warm"
RESIDENT = 0  # a memory report's limit_bytes for its resident runs (no cgroup, the file read in first)
__all__ = [
    "OFF",
    "RESIDENT",
    "WARM",
    "DecodeSplit",
    "EmulatedDrive",
    "Measured",
    "MeasuredPrefill",
    "MeasuredRow",
    "from_bench",
    "load_measured",
    "load_memory_reports",
]


@dataclass(frozen=True)
class EmulatedDrive:
    """An emulated drive the report's rows read from (drive/profiles.py, the report's ``drives``)."""

    name: str
    latency_us: float  # per request, overlapping across the requests in service
    bandwidth: float  # bytes/s of the bus the requests share
    channels: int  # requests in service at once
    max_read: int  # the mount's largest request (FUSE max_read), bytes
    read_ahead_kb: int | None  # the mount's bdi readahead (None: not recorded)


@dataclass(frozen=True)
class DecodeSplit:
    """Where a memory row's decoded tokens' time went, per token, and what was read meanwhile: the
    medians over its rounds of each run's figures (checks/rounds.py :func:`decode_split`), each its own
    (so compute + waiting is close to the median run's wall time per token, exactly so with one round).

    ``compute_ms`` with ``compute_basis`` COMPUTE_THREAD (--threads 1, what these runs use) is the
    decoding thread's CPU time (the thread that calls ``llama_decode`` computes the graph itself):
    it includes the kernel's work in that thread, the page-fault handling and the reclaim its
    cgroup's limit makes it do. ``wait_ms`` is the token's wall time less that, the time the thread
    was off CPU: the reads it blocked on, page locks, reclaim waits (and, on 2 cores, runnable but
    not running while the consumer's workers or the emulator had the core). The split is exact for
    one thread only: with more, ``compute_basis`` is COMPUTE_PROCESS, ``compute_ms`` the process's CPU
    over the decode (every compute thread and the consumer's workers, not separable), and
    ``wait_ms`` None.

    The read requests come from ``requests_from``: ``diskstats DEV`` (the model's block device,
    llama/diskstats.py: the device's, every process's, with their times) or ``emulated`` (the
    emulator's counters; the times of its device schedule since 2026-12-06, none in reports before).
    ``request_kib_largest`` is the device's cap (max_sectors_kb, the largest possible: LARGEST_CAP) on a
    block device, the largest the emulator served since it was mounted (LARGEST_SEEN) on an emulated
    one, as ``request_kib_largest_is`` says.

    ``expert_hit``: the share of the routed experts' bytes resident when their layer was routed,
    ``route_resident / (route_resident + route_bytes)`` over the decode. Only route-time rows have it
    (None otherwise): only the route-time op looks at residency when a layer is routed; and None where
    that op was held off for the whole decode (the room rule, the guard: it looked at nothing).
    ``room_mib`` and ``room_need_mib``: the room rule's last measurement after the decode (the page
    cache the process could have, one token's weights), None where unknown (the counters' -1, or a
    row without the consumer's object). ``route_wait_ms``: the time the route-time ops waited for their
    layers' reads (ONEBIT_MOE_PREFETCH_WAIT; part of ``wait_ms``), None without route time. ``keep_capacity``
    and ``keep_evicted``: with ONEBIT_MOE_PREFETCH_KEEP=lru, the experts its LRU holds at most and the
    experts it evicted (paged out) per token, None otherwise. ``guesses_skipped`` and ``guesses_unused``:
    with the LRU and a predictor, the guesses per token its room for them had no place for, and those
    read but not routed (paged out at their layer's route), None otherwise. ``layers_ops``, ``layers_mib``
    and ``layers_cut``: with ONEBIT_MOE_PREFETCH_LAYERS, per token, the batches' route-time ops that read the
    next layers ahead, the MiB they queued (not resident when queued) and the ops whose depth the room cut,
    None otherwise (a decode's one-token ubatches never read ahead: 0). With one thread, ``others_cpu_ms``: the
    rest of the process's CPU per token (the consumer's workers: their reads' system time, page allocation,
    mremap), which shares the machine's cores with the decoding thread; ``run_queue_ms``: the part of
    ``wait_ms`` the decoding thread spent runnable but not running, waiting for a core
    (/proc/thread-self/schedstat); both None in reports before them (2026-12-06)."""

    compute_ms: float
    wait_ms: float | None = None
    compute_basis: str = COMPUTE_THREAD
    requests_from: str | None = None
    requests: float | None = None  # read requests per token
    request_kib_mean: float | None = None
    request_kib_largest: float | None = None
    request_kib_largest_is: str | None = None
    request_ms_mean: float | None = None  # a read's mean time, queue and service (diskstats only)
    in_flight: float | None = None  # mean requests in flight over the decode (diskstats: weighted ms / wall ms)
    busy: float | None = None  # the device's busy share over the decode (diskstats: io_ticks / wall)
    expert_hit: float | None = None
    room_mib: float | None = None
    room_need_mib: float | None = None
    route_wait_ms: float | None = None
    keep_capacity: float | None = None
    keep_evicted: float | None = None  # per token
    guesses_skipped: float | None = None  # per token
    guesses_unused: float | None = None  # per token
    layers_ops: float | None = None  # per token
    layers_mib: float | None = None  # per token
    layers_cut: float | None = None  # per token
    others_cpu_ms: float | None = None  # per token, the process's CPU beside the decoding thread's
    run_queue_ms: float | None = None  # per token, the decoding thread runnable but not running (in wait_ms)

    @property
    def wall_ms(self) -> float | None:
        """compute + waiting per token (None where they are not separable)."""
        return None if self.wait_ms is None else self.compute_ms + self.wait_ms

    @classmethod
    def from_fields(cls, data: Any, where: str) -> DecodeSplit | None:
        """A report row's ``decode`` object (None: absent); fields it lacks are None, unknown ones ignored."""
        if data is None:
            return None
        if not isinstance(data, dict) or data.get("compute_ms") is None:
            raise ValueError(f"{where}: decode is not an object with compute_ms")
        got = {f.name: data[f.name] for f in fields(cls) if data.get(f.name) is not None}
        try:
            return cls(**{k: str(v) if k in _DECODE_WORDS else float(v) for k, v in got.items()})
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: decode holds a field that is not a number ({e})") from None


_DECODE_WORDS = ("compute_basis", "requests_from", "request_kib_largest_is")  # DecodeSplit's fields that are words


@dataclass(frozen=True)
class MeasuredRow:
    limit_bytes: int | None  # None: --cold (no limit, every expert page evicted before each token)
    name: str  # as the report names it: "patched off", "router", "router + advise", ...
    config: RowConfig | None  # what it ran (None: a name that is no configuration, "patched off, warm")
    tok_s: float
    min_tok_s: float | None
    max_tok_s: float | None
    ratio_to_off: float | None
    read_mib_per_token: float | None
    major_faults_per_token: float | None
    process_bytes: int | None = None
    read_ahead_kb: int | None = None  # the drive's readahead it ran at (None: unknown)
    drive: str | None = None  # the drive it read the model from: native, nvme, nvme-1m, nvme-3g, sata (None: unknown)
    route_missing_per_token: float | None = None  # bytes the routed experts lacked when routed (None: no route)
    decode: DecodeSplit | None = None  # where its tokens' time went (None: a report written before)

    @property
    def resident(self) -> bool:
        return self.limit_bytes == RESIDENT or self.name == WARM


@dataclass(frozen=True)
class MeasuredPrefill:
    """A report's prefill row (checks/bench_prefill.py ``PrefillRow``): per prompt token, medians over its rounds."""

    limit_bytes: int
    name: str
    config: PrefillConfig  # the configuration, the prompt's tokens and the ubatch
    prompt_tok_s: float
    ratio_to_off: float | None
    read_mib_per_token: float | None
    expert_bytes_per_ubatch_mib: float | None  # the floor: expert bytes * ceil(N / U) / N
    prefill: DecodeSplit | None = None  # where the prompt's time went, per prompt token


@dataclass(frozen=True)
class Measured:
    path: Path
    kind: str  # "memory" or "cold"
    model: str
    expert_bytes: int | None  # all the routed experts' bytes of the model
    bandwidth: float | None  # bytes per second
    latency_us: float | None
    read_ahead_kb: int | None
    process_bytes: int | None
    threads: int | None
    generate: int | None
    prompt: int | None
    rows: tuple[MeasuredRow, ...]
    knobs_recorded: bool = False  # each row's knobs are in the report (env or config: since the room rule)
    device: dict[str, Any] | None = None  # the model's block device as the report recorded it
    drives: tuple[EmulatedDrive, ...] = ()  # the emulated drives its rows read from
    workers_default: int = PREFETCH_THREADS_BEFORE_ROUTE  # the consumer's workers where a row sets none
    prefill: tuple[MeasuredPrefill, ...] = ()  # its prefill_rows (none before --prompt-tokens)
    random_bandwidth: float | None = None  # bytes/s of 1 MiB random reads at the workers' depth (None: before)

    @property
    def warm_tok_s(self) -> float | None:
        """The resident run's decode tok/s: --cold's "patched off, warm" row, a memory report's
        "patched off" at the limit ``resident`` (RESIDENT; on several drives, the native one's first)."""
        warm = [r for r in self.rows if r.resident and (r.name in (WARM, OFF) or (r.config and r.config.is_off))]
        warm = [r for r in warm if r.config is None or not r.config.route]
        warm.sort(key=lambda r: r.drive not in (None, "native"))
        return warm[0].tok_s if warm else None

    def drive(self, name: str | None) -> EmulatedDrive | None:
        """The emulated drive called ``name`` (None: native, unknown, or not recorded)."""
        return next((d for d in self.drives if d.name == name), None)

    def timed_rows(self) -> list[MeasuredRow]:
        """The rows a model plays: every one but the resident runs."""
        return [r for r in self.rows if not r.resident]

    @property
    def limits(self) -> list[int | None]:
        return list(dict.fromkeys(r.limit_bytes for r in self.timed_rows()))


def _rate(samples: list, drive: dict, key: str) -> float | None:
    """A drive rate in MB/s as bytes/s: the median of the report's ``drive_samples`` that have it, else
    its ``drive``'s; None where neither has it (0 counts as not measured)."""
    rates = [float(s[key]) for s in samples if s.get(key)] or ([float(drive[key])] if drive.get(key) else [])
    return statistics.median(rates) * 1e6 if rates else None


def _num(d: dict, key: str) -> float | None:
    v = d.get(key)
    return None if v is None else float(v)


def load_measured(path: str | Path) -> Measured:
    """An onebit-bench --memory-limit or --cold --json report; ValueError when it is neither."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError:
        raise
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not data["rows"]:
        raise ValueError(f"{path}: not an onebit-bench --json report (no rows)")
    if data.get("cold"):
        kind = "cold"
    elif "memory_limits" in data or any("limit_bytes" in r for r in data["rows"]):
        kind = "memory"
    else:
        raise ValueError(
            f"{path}: neither an onebit-bench --memory-limit report (memory_limits, rows with limit_bytes) "
            "nor a --cold one (cold: true)"
        )
    drive = data.get("drive") or {}
    samples = data.get("drive_samples") or []
    lat = [float(s["page_read_us"]) for s in samples if s.get("page_read_us") is not None] or (
        [float(drive["page_read_us"])] if drive.get("page_read_us") is not None else []
    )
    rows = []
    recorded = False
    drive_ra = None if drive.get("read_ahead_kb") is None else int(drive["read_ahead_kb"])
    drives = data.get("drives") if isinstance(data.get("drives"), dict) else {}
    only_drive = next(iter(drives)) if len(drives) == 1 else None
    for i, r in enumerate(data["rows"]):
        where = f"{path}: row {i} ({r.get('name') if isinstance(r, dict) else r!r})"
        if not isinstance(r, dict):
            raise ValueError(f"{where}: not an object")
        recorded = recorded or r.get("env") is not None or r.get("config") is not None
        config = _config(r, where)
        decode = DecodeSplit.from_fields(r.get("decode"), where)
        on = config.drive if config is not None and config.drive is not None else only_drive
        record = drives.get(on) if isinstance(drives.get(on), dict) else {}
        ra = drive_ra if not record.get("emulated") else record.get("read_ahead_kb")
        ra = None if ra is None else int(ra)
        try:
            limit = None if kind == "cold" else int(r["limit_bytes"])
            rows.append(
                MeasuredRow(
                    limit,
                    str(r["name"]),
                    config,
                    float(r["median_tok_s"]),
                    _num(r, "min_tok_s"),
                    _num(r, "max_tok_s"),
                    _num(r, "ratio_to_off"),
                    _num(r, "read_mib_per_token"),
                    _num(r, "major_faults_per_token"),
                    None if r.get("process_bytes") is None else int(r["process_bytes"]),
                    ra if config is None or config.read_ahead_kb is None else config.read_ahead_kb,
                    on,
                    _num(r, "route_missing_per_token"),
                    decode,
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: row {i} lacks a field the comparison needs ({e!r})") from None
    return Measured(
        path,
        kind,
        str(data.get("model", "?")),
        None if data.get("expert_bytes") is None else int(data["expert_bytes"]),
        _rate(samples, drive, "bandwidth_mb_s"),
        statistics.median(lat) if lat else None,
        _one({r.read_ahead_kb for r in rows}),
        None if data.get("process_bytes") is None else int(data["process_bytes"]),
        None if data.get("threads") is None else int(data["threads"]),
        None if data.get("generate") is None else int(data["generate"]),
        None if data.get("prompt") is None else int(data["prompt"]),
        tuple(rows),
        recorded,
        data.get("device") if isinstance(data.get("device"), dict) else None,
        _drives(drives, path),
        _workers_default(data["rows"]),
        _prefill_rows(data.get("prefill_rows"), path),
        _rate(samples, drive, "random_mb_s"),
    )


def _prefill_rows(rows: Any, path: Path) -> tuple[MeasuredPrefill, ...]:
    """A report's ``prefill_rows`` (None: a report without them); ValueError naming a row that is not one."""
    if rows is None:
        return ()
    if not isinstance(rows, list):
        raise ValueError(f"{path}: prefill_rows is not a list")
    out = []
    for i, r in enumerate(rows):
        where = f"{path}: prefill row {i} ({r.get('name') if isinstance(r, dict) else r!r})"
        config = PrefillConfig.from_fields(r, where)
        try:
            out.append(
                MeasuredPrefill(
                    int(r["limit_bytes"]),
                    str(r["name"]),
                    config,
                    float(r["median_prompt_tok_s"]),
                    _num(r, "ratio_to_off"),
                    _num(r, "read_mib_per_token"),
                    _num(r, "expert_bytes_per_ubatch_mib"),
                    DecodeSplit.from_fields(r.get("prefill"), where),
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: lacks a field ({e!r})") from None
    return tuple(out)


def _workers_default(rows: list[dict[str, Any]]) -> int:
    """The consumer's default workers when the report ran: its rows' config objects carry ``route`` since
    route-time reads, which raised the default (PREFETCH_THREADS_DEFAULT; before, PREFETCH_THREADS_BEFORE_ROUTE)."""
    route_era = any(isinstance(r.get("config"), dict) and "route" in r["config"] for r in rows)
    return PREFETCH_THREADS_DEFAULT if route_era else PREFETCH_THREADS_BEFORE_ROUTE


def _drives(drives: dict[str, Any], path: Path) -> tuple[EmulatedDrive, ...]:
    """The emulated drives of a report's ``drives`` that record their profile (the device model's
    parameters), with the mount's max_read and read_ahead_kb."""
    out = []
    for name, d in drives.items():
        if not (isinstance(d, dict) and d.get("emulated") and isinstance(d.get("profile"), dict)):
            continue
        prof = d["profile"]
        try:
            max_read = int(d.get("max_read") or prof["max_read"])
            ra = None if d.get("read_ahead_kb") is None else int(d["read_ahead_kb"])
            latency, bandwidth, channels = float(prof["latency_us"]), float(prof["bandwidth"]), int(prof["channels"])
            out.append(EmulatedDrive(name, latency, bandwidth, channels, max_read, ra))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: drives.{name} lacks a field of its profile ({e!r})") from None
    return tuple(out)


def _one(values: set[int | None]) -> int | None:
    """The value every row shares (None: several, or unknown)."""
    return values.pop() if len(values) == 1 else None


def _config(row: dict[str, Any], where: str) -> RowConfig | None:
    """A row's configuration: its ``config`` object, or (a report written before them) its name
    parsed, checked against its ``env`` where it has one."""
    env = row.get("env")
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) for k in env)):
        raise ValueError(f"{where}: env is not an object of ONEBIT_* variables")
    if row.get("config") is not None:
        return RowConfig.from_fields(row["config"], f"{where}: config")
    config = from_name(str(row.get("name", "")))
    if config is not None and env is not None:
        ran = {k: str(v) for k, v in env.items()}
        if config.env(ran.get(ENV_PREFETCH_DEBUG_ORACLE)) != ran:
            logger.warning("%s: its env %s is not the configuration its name says; played as named", where, ran)
    return config


def from_bench(path: Path, mode: str, n_layer: int) -> tuple[float, float | None]:
    """(layer ms, cost % of the trace's mode or None) from onebit-bench --json; ValueError if unusable."""
    try:
        rows = {r["name"]: r for r in json.loads(path.read_text())["rows"]}
        off = float(rows["patched off"]["median_tok_s"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--bench-json {path}: not an onebit-bench --json report ({e!r})") from None
    if not off > 0:
        raise ValueError(f"--bench-json {path}: 'patched off' has {off} tok/s")
    cost = None
    if mode in rows and float(rows[mode].get("ratio_to_off", 0)) > 0:
        cost = max(0.0, (1.0 / float(rows[mode]["ratio_to_off"]) - 1.0) * 100.0)
    return 1000.0 / off / n_layer, cost


def load_memory_reports(paths: list[Path]) -> list[Measured]:
    """``onebit-bench --memory-limit`` reports, each read by :func:`load_measured`; ValueError (exit 2)
    naming every file that is another kind of report (``--cold``)."""
    reports = [load_measured(p) for p in paths]
    bad = [str(m.path) for m in reports if m.kind != "memory"]
    if bad:
        raise ValueError(f"not onebit-bench --memory-limit reports: {', '.join(bad)}")
    return reports
