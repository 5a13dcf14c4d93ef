"""The predictor and its consumer under a real memory limit (``onebit-bench MODEL --memory-limit``).

Each run is confined to a fresh memory cgroup (llama/cgroup.py) whose limit is a fraction of
the model's expert bytes, and drops the model file from the page cache after joining it, so
the kernel's own reclaim evicts expert pages as a model that does not fit would see. A limit
of ``resident`` (0 here) is the other side of the never-a-loss rule: no cgroup, the model file
read into the page cache before every run.

The configurations (each in its own process, rounds alternating, each writing a trace, in
/dev/shm: :func:`trace_base`): the predictor off; router and block with the consumer off, advise
and read (the consumer's room rule and guard at their defaults: the rule on, no guard); block +
advise with the guard (``guard 4``) and without the room rule (``room 0``); block + advise with a
depth of every expert (poor predictions: most reads wasted), with and without the room rule; and the oracle,
the consumer spending the routing a trace of the same tokens recorded before the rounds
(ONEBIT_MOE_PREFETCH_DEBUG_ORACLE, router mode, neither rule nor guard: the upper bound), whose
tokens are checked to route as that trace did. Per row: decode tok/s against "patched off" and against the same
predictor with the consumer off, the bytes read from the drive and the major faults per
decoded token (/proc/self/io and getrusage of the worker, all its threads), the drive's
utilisation (bytes read per second over its sequential bandwidth, measured in the same run),
the prediction's read recall and the consumer's counters from the trace. A row named ``..., copy 2``
runs its configuration again beside the first copy: ``patched off, copy 2`` is the A/A control.

Each configuration is a costmodel/row_config.py ``RowConfig`` (:func:`memory_rows`): its name, its
ONEBIT_* variables and the ``config`` object every row of the report carries come from it, and
the page model (costmodel/page_check.py) reads the rows back through it.

The drive is a variable of every run: the report records the model's device and its
read_ahead_kb (llama/read_ahead.py ``DriveSetting``), and ``--read-ahead-kb 128,8192`` runs every
configuration at each value (``read_ahead_kb`` of its ``RowConfig``, ``readahead 128`` in its name,
set on the device before each of its runs and restored after them), side by side, each
compared with "patched off" and the consumer off at the same value. Before the first token of
every confined run, no expert page of the model may be resident (checks/rounds.py: mincore,
EvictionNotHeld, exit 1), and the rounds are odd, so that each median is a measured run.

The drive itself is a dimension too: ``--drive native,nvme,sata`` runs every configuration on each
(``drive`` of its ``RowConfig``, ``block + advise, nvme`` in its name), side by side, each compared
with "patched off" and the consumer off on the same drive. ``native`` reads the model where it is;
``nvme`` and ``sata`` serve it from the emulated drive (drive/emudrive.py ``mounted``, the profile of
drive/profiles.py), mounted by this process before any worker joins its memory cgroup (so the
emulator, which holds the file in its own memory, stays outside the limit) and kept mounted for
every run on it (:func:`drives_mounted`); the workers load the model from the mount.
``--read-ahead-kb`` is then set on the mount's bdi (the first value by the mount itself). Per row:
the emulator's bytes served and CPU seconds over a run and its CPU seconds while the worker decoded
(on 2 cores it competes with the decode); the bytes read per token are the bytes it served while
the worker decoded (FUSE reads never reach /proc/self/io), the drive's utilisation is over the
profile's bandwidth. The report records, per drive (:func:`drives_report`), the mount's max_read
and read_ahead_kb, and the emulator's counters before and after each run.

Where each token's time went, per row (``decode``, costmodel/measured.py ``DecodeSplit``: medians
over the rounds; checks/worker.py measures it): compute (the decoding thread's CPU, exact with
``--threads 1``; the process's with more, labelled) and waiting (off CPU: reads, page locks, reclaim
waits) in ms per token; the read requests the drive served meanwhile (/proc/diskstats of the
model's device, or the emulator's counters): per token, their mean size, the mean in flight and
the device's busy share (io_ticks over wall, not ``drive_utilisation``'s bytes over bandwidth);
the expert-level hit rate of route-time rows; with one thread, the workers' CPU and the decoding thread's
wait for a core (checks/decode_columns.py); the room rule's last measurement (JSON only).

Prompt processing (``--prompt-tokens``, ``--ubatch``): the same configurations, each prompt length and
ubatch a run of its own, in rows of their own (checks/bench_prefill.py, the report's ``prefill_rows``).
"""

from __future__ import annotations

import logging
import os
import re
import statistics
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import (
    ENV_COMPENSATOR,
    ENV_LEARNED,
    ENV_OUT,
    ENV_PREFETCH_DEBUG_ORACLE,
    TRACE_RAM_DIR,
)
from ..costmodel.measured import DecodeSplit
from ..costmodel.row_config import DRIVES, NATIVE, RowConfig, from_name
from ..trace import Trace
from .bench_cold import RowPlan, pct, trace_figures
from .bench_prefill import PrefillRow, measure_prefill, prefill_plans, prefill_report, ubatches
from .decode_columns import DECODE_COLUMNS, DECODE_NOTE, decode_cells
from .rounds import BenchOptions, Config, DriveRun, collect, decode_split, run_one

logger = logging.getLogger("onebit_predict")
RESIDENT = 0  # a limit of 0: no cgroup, the model read into the page cache first
SCRATCH_PREFIX = ".onebit-drive-"  # llama/drive.py measure_drive's scratch file, next to the model
OFF = RowConfig().name
ORACLE = RowConfig("router", "advise", oracle=True).name  # "oracle + advise"


def trace_base(ram_dir: Path = Path(TRACE_RAM_DIR)) -> Path | None:
    """Where the rows' traces go: ``ram_dir`` where it is a memory filesystem, else None (the temp dir),
    with a warning. A worker writes its trace inside its memory cgroup, a page at a time. On a disk those
    pages stay dirty, and under cgroup v1 a reclaim pass that finds only dirty pages pauses the run 100 ms
    (VMSCAN_THROTTLE_WRITEBACK): up to half a confined run's time on a small model (docs/results.md)."""
    from ..llama.evict import MEMORY_FILESYSTEMS, filesystem_type

    if ram_dir.is_dir() and os.access(ram_dir, os.W_OK) and filesystem_type(ram_dir) in MEMORY_FILESYSTEMS:
        return ram_dir
    logger.warning(
        "no memory filesystem at %s: the rows' traces go to the temp dir; where it is a disk, under cgroup v1 "
        "their dirty pages can pause a confined run's reclaim (100 ms each)",
        ram_dir,
    )
    return None


def memory_rows(n_expert: int) -> list[RowConfig]:
    """The predictor off; router and block with the consumer off, advise and read (the room rule and
    the guard at their defaults: the rule on, no guard); the never-a-loss pairs: block + advise with
    the guard (4 tokens per probe), and without the room rule; every expert read (depth n_expert),
    with and without the rule; the oracle (neither rule nor guard)."""
    out = [RowConfig()]
    for mode in ("router", "block"):
        out += [RowConfig(mode, consumer) for consumer in ("off", "advise", "read")]
    out += [RowConfig("block", "advise", guard=4), RowConfig("block", "advise", room=0.0)]
    out += [RowConfig("block", "advise", depth=n_expert), RowConfig("block", "advise", depth=n_expert, room=0.0)]
    out.append(RowConfig("router", "advise", oracle=True))
    return out


def route_rows(n_expert: int) -> list[RowConfig]:
    """Route time against prediction (``--rows drives``, docs/results.md): the predictor off; route alone
    (the peers' mechanism, with the default call: read); router and block reading their predictions
    (read) with route; block without route; the oracle with route (the upper bound of prediction +
    route); today's block + advise; and the two candidates for the recommended configuration behind the
    guard (4 tokens per probe)."""
    del n_expert  # the same rows for every model
    return [
        RowConfig(),
        RowConfig(route=True),
        RowConfig("block", "read"),
        RowConfig("router", "read", route=True),
        RowConfig("block", "read", route=True),
        RowConfig("router", "read", oracle=True, route=True),
        RowConfig("block", "advise"),
        RowConfig(route=True, guard=4),
        RowConfig("block", "read", route=True, guard=4),
    ]


ROW_SETS = ("default", "drives")  # --rows: memory_rows, route_rows


def rows_value(text: str) -> tuple[str, ...]:
    """``--rows``: a set's name (default, drives) or configurations by name, separated by ``;``
    (``patched off; route; block + advise + route, exact``); ValueError naming a bad one."""
    if text in ROW_SETS:
        return (text,)
    names = tuple(n.strip() for n in text.split(";") if n.strip())
    for n in names:
        if from_name(n) is None:
            raise ValueError(f"--rows: '{n}' is neither a set ({', '.join(ROW_SETS)}) nor a configuration's name")
    if not names:
        raise ValueError("--rows: no configuration named")
    return names


def chosen_rows(rows: Sequence[str] | None, n_expert: int) -> list[RowConfig]:
    """The configurations ``--rows`` chose (None: the default set), the predictor off always first
    (every ratio is taken against it)."""
    if not rows or rows[0] in ROW_SETS:
        return route_rows(n_expert) if rows and rows[0] == "drives" else memory_rows(n_expert)
    out = [RowConfig()] + [c for c in (from_name(n) for n in rows) if c is not None]
    return list(dict.fromkeys(out))  # each once, in order


def require_learned(rows: Sequence[str] | None, learned: Path | None) -> None:
    """A learned row of ``--rows`` has its sidecar, an existing file (ValueError, exit 2, otherwise)."""
    if any(c.predictor == "learned" for c in chosen_rows(rows, 1)) and not (learned and learned.is_file()):
        raise ValueError(f"--rows with a learned row needs --learned FILE, an existing sidecar (not {learned})")


def memory_configs(
    trace_dir: Path,
    n_expert: int,
    read_ahead_kb: Sequence[int] | None = None,
    drives: Sequence[str] | None = None,
    rows: Sequence[str] | None = None,
    learned: Path | None = None,
    compensator: Path | None = None,
) -> list[RowPlan]:
    """The configurations of ``rows`` (:func:`chosen_rows`), each as the worker runs it: its environment
    (the oracle's with the routing recorded before the rounds, a learned row's with the sidecar
    ``learned``: ValueError without one; every row with the compensator sidecar ``compensator`` when
    given) and its trace in ``trace_dir``; with
    ``read_ahead_kb``, each configuration once at each value, side by side (the drive set to it before
    each of its runs); with ``drives``, each of those once on each drive, side by side."""
    out = []
    for base in chosen_rows(rows, n_expert):
        for kb in read_ahead_kb or [None]:
            for drive in drives or [None]:
                row = replace(base, read_ahead_kb=kb, drive=drive)
                env = row.env(oracle_source(trace_dir) if row.oracle else None)
                if row.predictor == "learned":
                    if learned is None:
                        raise ValueError(f"'{row.name}' needs the learned predictor's sidecar: give --learned FILE")
                    env[ENV_LEARNED] = str(learned)
                if compensator is not None:
                    env[ENV_COMPENSATOR] = str(compensator)
                trace = trace_dir / f"{re.sub(r'[^a-z0-9.]+', '-', row.name).strip('-')}.bin"  # one per name
                run = Config(row.name, {**env, ENV_OUT: str(trace)}, read_ahead_kb=kb, drive=drive)
                out.append(RowPlan(row, run))
    return out


class DriveUnavailable(ValueError):
    """--drive names an emulated drive this machine cannot run (exit 2: why, and the packages it needs)."""


def drive_value(text: str) -> str:
    """One ``--drive`` item: ``native`` or an emulated drive's profile (nvme, nvme-1m, nvme-3g, sata)."""
    if text not in DRIVES:
        raise ValueError(f"unknown drive '{text}': one of {', '.join(DRIVES)}")
    return text


def require_drives(names: Sequence[str] | None) -> None:
    """Every emulated drive of ``names`` can run here: a usable /dev/fuse, the emulator built (into the
    cache, on first use); DriveUnavailable (exit 2) naming the Debian packages otherwise."""
    from ..drive.emudrive import INSTALL_HINT, EmuDriveError, build, unavailable_reason

    emulated = [n for n in names or () if n != NATIVE]
    if not emulated:
        return
    reason = unavailable_reason()
    if reason is None:
        try:
            build()
        except EmuDriveError as e:
            reason = str(e) if INSTALL_HINT in str(e) else f"{e} (it needs {INSTALL_HINT})"
    if reason is not None:
        raise DriveUnavailable(f"--drive {','.join(emulated)}: the emulated drive cannot run here: {reason}")


@contextmanager
def drives_mounted(
    model: Path, names: Sequence[str] | None, read_ahead_kb: Sequence[int] | None, native_read_ahead: Any = None
) -> Iterator[dict[str, DriveRun] | None]:
    """Each drive of ``names`` as its runs read the model (rounds.py ``DriveRun``; None without
    ``--drive``): ``native`` the model where it is (its device's read_ahead_kb through
    ``native_read_ahead``); an emulated one mounted here, in this process's cgroup, before any worker
    joins its own, with the first ``read_ahead_kb`` set by the mount and the rest through a ReadAhead
    on its bdi, and unmounted on every exit path. A mount that fails is llama/drive.py DriveError (exit 1)."""
    if not names:
        yield None
        return
    from ..drive.emudrive import EmuDriveError, mounted
    from ..drive.profiles import profile
    from ..llama.drive import DriveError
    from ..llama.read_ahead import ReadAhead

    with ExitStack() as stack:
        drives = {}
        for name in names:
            if name == NATIVE:
                drives[name] = DriveRun(name, model, native_read_ahead)
                continue
            try:
                m = stack.enter_context(mounted(model, profile(name), read_ahead_kb[0] if read_ahead_kb else None))
            except EmuDriveError as e:
                raise DriveError(f"--drive {name}: {e}") from None
            memcg = next((c for c in m.cgroup.split(";") if ":memory:" in c or c.startswith("0::")), m.cgroup or "?")
            logger.info(
                "drive %s: %s served by pid %d, in cgroup %s (max_read %d, read_ahead_kb %d)",
                name,
                m.path,
                m.pid,
                memcg,
                m.max_read,
                m.read_ahead_kb,
            )
            # not recorded for a later run: the bdi goes with the mount, and a later mount may take its number
            bdi_ra = ReadAhead(m.bdi / "read_ahead_kb", f"the {name} mount", recorded=False)
            ra = stack.enter_context(bdi_ra) if read_ahead_kb else None
            drives[name] = DriveRun(name, m.path, ra, m)
        yield drives


def drives_report(drives: dict[str, DriveRun] | None, model: Path) -> dict[str, Any]:
    """The report's ``drives``: per drive, where the runs read the model and, for an emulated one, its
    profile, the mount's max_read and read_ahead_kb (as mounted, and as the kernel had it), the
    emulator's pid and cgroup, its counters before and after each run and its final line (None
    without ``--drive``: the model where it is, ``native``)."""
    if drives is None:
        return {NATIVE: {"emulated": False, "path": str(model)}}
    from ..drive.emudrive import EmuDriveError

    out: dict[str, Any] = {}
    for name, d in drives.items():
        m = d.mount
        if m is None:
            out[name] = {"emulated": False, "path": str(d.path)}
            continue
        try:
            final = asdict(m.stats())  # the final line, written when it unmounted
        except EmuDriveError:
            final = None
        out[name] = {
            "emulated": True,
            "profile": asdict(m.profile),
            "path": str(m.path),
            "mountpoint": str(m.mountpoint),
            "max_read": m.max_read,
            "read_ahead_kb": m.read_ahead_kb,
            "read_ahead_kb_initial": m.read_ahead_kb_initial,
            "bdi": str(m.bdi),
            "emulator_pid": m.pid,
            "emulator_cgroup": m.cgroup,
            "runs": d.runs,
            "final": final,
        }
    return out


def drives_text(drives: dict[str, DriveRun] | None) -> str:
    """The table header's words for ``--drive``: ``; drives native, nvme (emulated, max_read 131072,
    read_ahead_kb 128)`` ("" without it)."""
    if not drives:
        return ""
    words = [
        name
        if d.mount is None
        else f"{name} (emulated, {d.mount.profile.latency_us:g} us, {d.mount.profile.bandwidth / 1e6:.0f} MB/s, "
        f"{d.mount.profile.channels} channels, max_read {d.mount.max_read}, read_ahead_kb {d.mount.read_ahead_kb})"
        for name, d in drives.items()
    ]
    return "; drives " + ", ".join(words)


def oracle_source(trace_dir: Path) -> Path:
    """Where the oracle's routing is recorded before the rounds."""
    return trace_dir / "oracle-source.bin"


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
    config: RowConfig = (
        RowConfig()
    )  # the configuration (the report's "config" object, read back by costmodel/measured.py)
    # an emulated drive (None: native): medians over the rounds, per run (the worker's whole life) and
    # while it decoded: the bytes the emulator served, its CPU seconds (taken from the decode's cores)
    drive_served_bytes: int | None = None
    drive_cpu_s: float | None = None
    drive_decode_cpu_s: float | None = None
    # route-time rows: the bytes per decoded token the routed experts lacked in the page cache when routed
    # (median over the rounds); the route-alone row's is the cell's floor (docs/results.md)
    route_missing_per_token: float | None = None
    decode: DecodeSplit | None = None  # where its tokens' time went, per token (the module docstring)


def measure_memory(
    model: Path, plans: Sequence[RowPlan], lib: Path, opts: BenchOptions, limits: Sequence[int], bandwidth_mb_s: float
) -> list[MemoryRow]:
    """Every configuration at every limit (each limit's rounds alternating), in limit order. The
    rounds are odd (ValueError, exit 2, otherwise): with an even count the median is the mean of
    the middle two, and one bad run moves it."""
    require_odd_rounds(opts.rounds)
    oracles = [p for p in plans if p.config.oracle]
    oracle = oracles[0] if oracles else None
    if oracle is not None:
        # the routing of the same tokens, recorded once with nothing confined
        source = Path(oracle.env[ENV_PREFETCH_DEBUG_ORACLE])
        run_one(model, Config("oracle source", {ENV_OUT: str(source)}), lib, replace(opts, memory_limit=None))
    runs = [p.run for p in plans]
    rows = []
    for limit in limits:
        resident = limit == RESIDENT
        samples = collect(
            model, runs, lib, None, replace(opts, memory_limit=None if resident else limit, warm=resident)
        )
        for o in oracles:
            check_oracle(source, Path(o.env[ENV_OUT]))
        medians = {name: statistics.median(s.tok_s for s in got) for name, got in samples.items()}
        for plan in plans:
            got = samples[plan.name]
            toks = [s.tok_s for s in got]
            med = medians[plan.name]
            read = statistics.median(s.read_bytes / opts.generate for s in got)
            faults = statistics.median(s.major_faults / opts.generate for s in got)
            bw = _bandwidth_mb_s(plan.run, opts, bandwidth_mb_s)
            util = statistics.median(s.read_bytes / s.seconds / (bw * 1e6) for s in got)
            rows.append(
                MemoryRow(
                    limit,
                    plan.name,
                    med,
                    min(toks),
                    max(toks),
                    med / medians[plan.config.predictor_off().name],
                    med / medians.get(plan.config.consumer_off().name, med),
                    read / 2**20,
                    faults,
                    util,
                    *trace_figures(Path(plan.env[ENV_OUT])),
                    {k: v for k, v in plan.env.items() if k != ENV_OUT},
                    plan.config,
                    _median([s.drive_bytes for s in got]),
                    _median([s.drive_cpu_s for s in got]),
                    _median([s.drive_decode_cpu_s for s in got]),
                    _median(
                        [None if s.route_missing_bytes is None else s.route_missing_bytes / opts.generate for s in got]
                    ),
                    decode_split(got, opts.generate),
                )  # fmt: skip
            )
    return rows


def _bandwidth_mb_s(run: Config, opts: BenchOptions, native_mb_s: float) -> float:
    """The sequential bandwidth of the drive a run reads from: an emulated drive's profile, else the native drive's."""
    drive = (opts.drives or {}).get(run.drive) if run.drive else None
    return native_mb_s if drive is None or drive.mount is None else drive.mount.profile.bandwidth / 1e6


def _median(values: Sequence[Any]) -> Any:
    """The median of a figure only emulated drives have (None where a run has none)."""
    return None if not values or any(v is None for v in values) else statistics.median(values)


def run_memory(
    model: Path,
    opts: BenchOptions,
    lib: Path,
    limits: Sequence[int],
    setting: Any,
    drive_names: Sequence[str] | None = None,
    read_ahead_kb: Sequence[int] | None = None,
    row_names: Sequence[str] | None = None,
    learned: Path | None = None,
    compensator: Path | None = None,
    prompt_tokens: Sequence[int] | None = None,
    ubatch: Sequence[int] | None = None,
    expert_bytes: int = 0,
) -> tuple[list[MemoryRow], list[PrefillRow], dict[str, Any], str]:
    """``onebit-bench --memory-limit``'s run: the cgroup proven makeable (CgroupError, exit 2), the native
    drive measured, its read_ahead_kb set per run through ``setting`` (llama/read_ahead.py
    ``DriveSetting``), the emulated drives of ``drive_names`` mounted before any worker joins its
    cgroup, then every configuration at every limit, value and drive (:func:`measure_memory`), and with
    ``prompt_tokens`` each of them once more per prompt and ubatch (checks/bench_prefill.py; its floor
    from the model's ``expert_bytes``). Returns the decode rows, the prefill rows, the report's fields
    (beside the rows) and the table header's words on the drives."""
    from ..grow.gguf_keys import arch_value
    from ..llama import run_state
    from ..llama.cgroup import MemoryCgroup
    from ..llama.drive import measure_drive

    for limit in [n for n in limits if n][:1]:
        MemoryCgroup(f"onebit-bench-probe-{os.getpid()}", limit).remove()  # CgroupError (exit 2) says why not
    with run_state.scratch(model.resolve().parent, SCRATCH_PREFIX):  # its 256 MiB file, if this run is killed
        drive = measure_drive(model.resolve().parent)
    n_expert = int(arch_value(model, "expert_count"))
    with (
        run_state.temp_dir("onebit-bench-", trace_base()) as tmp,  # the rows' traces
        setting.applied() as read_ahead,
        drives_mounted(model, drive_names, read_ahead_kb, read_ahead) as drives,  # before any worker's cgroup
    ):
        plans = memory_configs(Path(tmp), n_expert, read_ahead_kb, drive_names, row_names, learned, compensator)
        run_opts = replace(opts, read_ahead=read_ahead, drives=drives)
        rows = measure_memory(model, plans, lib, run_opts, limits, drive.bandwidth_mb_s)
        us = ubatches(prompt_tokens, ubatch)
        pre = prefill_plans(plans, prompt_tokens or (), us)
        prefill = measure_prefill(model, pre, lib, run_opts, limits, expert_bytes) if pre else []
    extra = {"memory_limits": list(limits), **setting.report(asdict(drive))}
    extra |= {"read_ahead_kb": None if not read_ahead_kb else list(read_ahead_kb)}
    extra["drives"] = drives_report(drives, model)
    extra["compensator"] = None if compensator is None else str(compensator)
    extra |= prefill_report(prefill, prompt_tokens or (), us)
    words = f"{setting.text()}, {drive.words()}{drives_text(drives)}"
    if compensator is not None:
        words += f", every row with the compensator {compensator.name}"
    return rows, prefill, extra, words


def require_odd_rounds(rounds: int) -> None:
    """--memory-limit's rounds: odd, so that every median is one measured run (ValueError, exit 2)."""
    if rounds < 1 or rounds % 2 == 0:
        raise ValueError(f"--memory-limit takes an odd --rounds (not {rounds}): each median is then a measured run")


def limit_label(limit_bytes: int) -> str:
    return "resident" if limit_bytes == RESIDENT else f"{limit_bytes / 2**20:.0f}"


def markdown_memory(rows: Sequence[MemoryRow], header: str) -> str:
    lines = [
        header,
        "",
        "| limit MiB | configuration | decode tok/s (median) | min | max | vs patched off | vs consumer off "
        "| MiB read/token | major faults/token | drive busy | read recall | experts prefetched | MiB prefetched "
        "| of it resident | failed | MiB missing at route time/token | emulator CPU s/run (decoding) "
        f"| {' | '.join(DECODE_COLUMNS)} |",
        "|---:|---|" + "---:|" * (15 + len(DECODE_COLUMNS)),
    ]
    for r in rows:
        lines.append(
            f"| {limit_label(r.limit_bytes)} | {r.name} | {r.median_tok_s:.2f} | {r.min_tok_s:.2f} | "
            f"{r.max_tok_s:.2f} | {r.ratio_to_off:.3f} | {r.ratio_to_consumer_off:.3f} | {r.read_mib_per_token:.2f} | "
            f"{r.major_faults_per_token:.1f} | {pct(r.drive_utilisation)} | {pct(r.read_recall)} | "
            f"{r.prefetched_experts} | {r.prefetched_bytes / 2**20:.1f} | {r.already_resident_bytes / 2**20:.1f} | "
            f"{r.failed_ranges} | {_mib(r.route_missing_per_token)} | {_cpu(r)} | "
            f"{' | '.join(decode_cells(r.decode))} |"
        )
    return "\n".join([*lines, "", DECODE_NOTE])


def _mib(n: float | None) -> str:
    return "-" if n is None else f"{n / 2**20:.2f}"


def _cpu(r: MemoryRow) -> str:
    if r.drive_cpu_s is None:
        return "-"
    return f"{r.drive_cpu_s:.3f}" + ("" if r.drive_decode_cpu_s is None else f" ({r.drive_decode_cpu_s:.3f})")
