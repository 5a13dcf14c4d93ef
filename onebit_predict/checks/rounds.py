"""What both benchmarks share: a configuration, its worker process, the alternating rounds.

Each configuration of ``onebit-bench`` (checks/bench.py) and ``onebit-bench --cold``
(checks/bench_cold.py) runs in its own process (the unpatched and patched libllama cannot
share one): ``python -m onebit_predict.commands.bench_worker`` (its own entry point, which
runs checks/worker.py), whose last stdout line is a JSON :class:`Sample`. :func:`collect` runs every configuration
``rounds`` times, the order alternating round by round so that drift on the machine spreads
over all of them.

Under ``--memory-limit`` (:func:`run_one`) each run first sets the drive's read_ahead_kb where its
configuration has one (``BenchOptions.read_ahead``: llama/read_ahead.py ``ReadAhead``, restored by
its owner), then drops the model from the page cache and proves with mincore that no expert page
is left (llama/evict.py ``require_evicted``): a run that would start warm is refused (exit 1), not
measured; the worker checks the same again once it has joined its cgroup.

A configuration may name a drive (``Config.drive``, ``--drive``): its run then reads the model from
that drive's :class:`DriveRun` (``BenchOptions.drives``): the model where it is (``native``) or the
file inside an emulated drive's mount, with that drive's read_ahead_kb. On an emulated drive the
emulator's counters are taken just before the worker starts and just after it exits (kept in
``DriveRun.runs``, the report's record of every run), and the worker takes them around its decode
too: FUSE reads never reach the block layer, so /proc/self/io counts none of them, and the bytes the
emulator served while the worker decoded are the run's bytes read.

Each run's worker also times its decode's compute and waiting, counts the read requests its drive
served meanwhile and the route-time op's resident bytes (checks/worker.py); :func:`decode_split`
turns a configuration's runs into the medians of their per-token figures (costmodel/measured.py
``DecodeSplit``, a memory row's ``decode``).

A configuration with ``prompt_tokens`` (``--prompt-tokens``, checks/bench_prefill.py) runs a prefill
instead: its worker times a prompt of that many tokens in calls of ``ubatch``, decodes nothing, and its
Sample is the prompt's (``tok_s`` the prompt's tokens per second, every counter over the prompt).

A worker that dies of a signal is named by the signal (``killed by SIGBUS``), not by the last line
it wrote to stderr, which says nothing of it; one that dies of SIGBUS while its row reads from an
emulated drive whose emulator is gone or whose mount is down is "the emulated drive stopped": a
fault on a mapping of a FUSE file whose server is gone is a SIGBUS.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..constants import COMPUTE_THREAD
from ..costmodel.measured import DecodeSplit
from ..llama.diskstats import ReadRequests
from ..llama.paths import NotBuiltError

logger = logging.getLogger("onebit_predict")

WORKER_MODULE = "onebit_predict.commands.bench_worker"  # the worker's entry point (checks/worker.py)


class WorkerError(RuntimeError):
    """A worker process failed (its exit code and the end of its stderr, or the signal that killed it)."""

    def __init__(self, message: str, returncode: int | None = None) -> None:
        super().__init__(message)
        self.returncode = returncode  # the worker's (negative: killed by that signal); None: it ran, but wrongly

    @property
    def signal(self) -> int | None:
        return -self.returncode if self.returncode is not None and self.returncode < 0 else None


def signal_name(signum: int) -> str:
    """``SIGBUS`` for 7 (``signal 99`` for one Python does not know)."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def worker_failure(what: str, returncode: int, stderr: str) -> WorkerError:
    """The WorkerError of a worker that exited ``returncode``: killed by a signal, the signal's name (its
    stderr's last line says nothing of why it died); otherwise the end of its stderr."""
    if returncode < 0:
        return WorkerError(f"{what}: killed by {signal_name(-returncode)}", returncode)
    return WorkerError(f"{what} ({returncode}): {stderr.strip()[-400:]}", returncode)


@dataclass(frozen=True)
class Config:
    name: str
    env: dict[str, str]
    pristine: bool = False  # run on the unpatched pin's libllama: no onebit_* call, so no knob
    evict: bool = True  # --cold: evict the expert pages before every token (False: the warm reference)
    read_ahead_kb: int | None = None  # --memory-limit: the drive's read_ahead_kb for this run (None: as found)
    drive: str | None = None  # --drive: the BenchOptions.drives entry it reads the model from (None: as given)
    prompt_tokens: int | None = None  # --prompt-tokens: the run times a prompt of this many tokens, not the decode
    ubatch: int | None = None  # ... in calls of this many tokens (n_batch = n_ubatch)
    limit_extra: int = 0  # --memory-limit: bytes its cgroup holds beyond the limit (a prefill's larger own memory)

    def __post_init__(self) -> None:
        if self.pristine and self.env:
            # the unpatched build has no predictor: a knob here would be measured as plain llama.cpp
            raise ValueError(f"{self.name}: the unpatched pin takes no predictor knob ({', '.join(sorted(self.env))})")


@dataclass(frozen=True)
class BenchOptions:
    """How each worker runs: the rounds, the tokens, the threads, the eviction of --cold."""

    rounds: int = 5
    prompt: int = 32
    generate: int = 64
    threads: int = 2
    text_file: Path | None = None  # feed this file's bytes as token ids
    cold_method: str | None = None  # --cold: the eviction method (None: no eviction)
    memory_limit: int | None = None  # --memory-limit: each run confined to a memory cgroup of this many bytes
    warm: bool = False  # --memory-limit resident: the model file read into the page cache before each run
    extra_bufts: bool = True  # False: the plain CPU kernels (quantized AMX faults on some VMs)
    read_ahead: Any = None  # --read-ahead-kb: the drive's llama/read_ahead.py ReadAhead, set per run
    drives: dict[str, DriveRun] | None = None  # --drive: each drive a configuration may name


@dataclass
class DriveRun:
    """A drive of ``--drive`` for the runs that name it: the model's path on it, its read_ahead_kb and,
    for an emulated drive, its mount (drive/emudrive.py ``Mount``) and the emulator's counters before and
    after each run (``runs``: the report's record)."""

    name: str
    path: Path  # the model on this drive (the mount's file for an emulated one)
    read_ahead: Any = None  # the llama/read_ahead.py ReadAhead each run sets its read_ahead_kb through
    mount: Any = None  # the emulated drive's Mount (None: native)
    runs: list[dict[str, Any]] = field(default_factory=list)


@dataclass(frozen=True)
class Sample:
    tok_s: float
    compute_mib: float
    n_layer: int
    resident_after_evict: float | None = None  # --cold: the most of the expert pages resident as a token started
    read_bytes: int = 0  # bytes read from the drive while decoding (all threads)
    major_faults: int = 0  # major page faults while decoding
    seconds: float = 0.0  # the decode time
    drive_bytes: int | None = None  # an emulated drive: the bytes its emulator served over the whole run
    drive_cpu_s: float | None = None  # ... the emulator's CPU seconds over the whole run (it competes with the decode)
    drive_decode_cpu_s: float | None = None  # ... the emulator's CPU seconds while the worker decoded
    route_missing_bytes: int | None = None  # route time: what the routed experts lacked in the page cache when routed
    route_resident_bytes: int | None = None  # ... what they had resident already
    route_wait_us: int | None = None  # ... the time the route-time ops waited for their reads (the wait knob)
    keep_evicted: int | None = None  # keep=lru: the experts its LRU evicted while decoding
    keep_capacity: int | None = None  # ... the experts it held at most, after the decode
    spec_skipped: int | None = None  # keep=lru with a predictor: the guesses its room had no place for
    spec_unused: int | None = None  # ... and the guesses read but not routed (paged out)
    layers_ops: int | None = None  # layers: the batches' route-time ops that read the next layers ahead
    layers_bytes: int | None = None  # ... the bytes they queued (not resident)
    layers_cut: int | None = None  # ... the ops whose depth the room cut
    cpu_s: float | None = None  # the decode's CPU seconds: the decoding thread's (cpu_basis COMPUTE_THREAD), else all
    cpu_basis: str | None = None
    others_cpu_s: float | None = None  # ... with one thread: the rest of the process's CPU (the consumer's workers)
    run_delay_s: float | None = None  # ... with one thread: the decoding thread's time runnable, not running
    reads: ReadRequests | None = None  # the read requests the drive served while it decoded (None: not counted)
    room_bytes: int | None = None  # the room rule's last measurement after the decode (-1: unknown)
    room_need_bytes: int | None = None


def worker_env(lib_dir: Path) -> dict[str, str]:
    """This process's environment without any onebit knob, pointed at lib_dir's libllama."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONEBIT_MOE_PREDICT", "ONEBIT_MOE_PREFETCH"))}
    env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    return env


def worker_json(cmd_args: Sequence[str], lib_dir: Path, what: str) -> dict:
    """Run a worker (commands/bench_worker.py) with cmd_args; its last stdout line as JSON
    (WorkerError if it failed)."""
    cmd = [sys.executable, "-m", WORKER_MODULE, *cmd_args]
    proc = subprocess.run(cmd, env=worker_env(lib_dir), capture_output=True, text=True)
    if proc.returncode != 0:
        raise worker_failure(what, proc.returncode, proc.stderr)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_one(model: Path, cfg: Config, lib_dir: Path, opts: BenchOptions) -> Sample:
    drive = _drive(cfg, opts)
    if drive is not None:
        model = drive.path
    cmd = [
        str(model),
        "--env",
        json.dumps(cfg.env),
        "--prompt",
        str(opts.prompt),
        "--generate",
        str(opts.generate),
        "--threads",
        str(opts.threads),
    ]
    if opts.cold_method and cfg.evict:
        cmd += ["--cold-method", opts.cold_method]
    if opts.text_file:
        cmd += ["--text-file", str(opts.text_file)]
    if not opts.extra_bufts:
        cmd += ["--no-extra-bufts"]
    if cfg.pristine:
        cmd += ["--pristine"]
    cmd += prefill_args(cfg)
    group = None
    limit = opts.memory_limit + cfg.limit_extra if opts.memory_limit is not None else None
    read_ahead = opts.read_ahead if drive is None else drive.read_ahead
    if cfg.read_ahead_kb is not None:
        if read_ahead is None:
            raise ValueError(f"{cfg.name}: read_ahead_kb {cfg.read_ahead_kb}, but no drive to set it on")
        read_ahead.set(cfg.read_ahead_kb)
    if opts.warm:
        read_through(model)
    if limit is not None:
        from ..llama.cgroup import MemoryCgroup
        from ..llama.evict import require_evicted

        require_evicted(model, cfg.name)  # before the first token: no expert page resident (exit 1)
        group = MemoryCgroup(f"onebit-bench-{os.getpid()}", limit)  # fresh for every run
        cmd += ["--cgroup", str(group.path)]
    mount = None if drive is None else drive.mount
    if mount is not None:
        cmd += ["--drive-stats", f"{mount.pid}:{mount.stats_path}"]
        before = mount.stats()
    try:
        out = worker_json(cmd, lib_dir, f"{cfg.name}: the worker failed")
    except WorkerError as e:
        raise why_killed(e, cfg.name, mount, group) from None
    finally:
        if group is not None:
            group.remove()
    check_build(out, cfg, lib_dir)
    sample = Sample(
        out["tok_s"],
        out["compute_mib"],
        out["n_layer"],
        out.get("resident_after_evict"),
        out["read_bytes"],
        out["major_faults"],
        out["seconds"],
        route_missing_bytes=out.get("route_missing_bytes"),
        route_resident_bytes=out.get("route_resident_bytes"),
        route_wait_us=out.get("route_wait_us"),
        keep_evicted=out.get("keep_evicted"),
        keep_capacity=out.get("keep_capacity"),
        spec_skipped=out.get("spec_skipped"),
        spec_unused=out.get("spec_unused"),
        layers_ops=out.get("layers_ops"),
        layers_bytes=out.get("layers_bytes"),
        layers_cut=out.get("layers_cut"),
        cpu_s=out.get("cpu_s"),
        cpu_basis=out.get("cpu_basis"),
        others_cpu_s=out.get("others_cpu_s"),
        run_delay_s=out.get("run_delay_s"),
        reads=None if out.get("reads") is None else ReadRequests(**out["reads"]),
        room_bytes=out.get("room_bytes"),
        room_need_bytes=out.get("room_need_bytes"),
    )
    if mount is None:
        return sample
    after = mount.stats()
    run = after.minus(before)
    drive.runs.append({"name": cfg.name, "limit_bytes": limit or 0, "before": asdict(before),
                       "after": asdict(after)})  # fmt: skip
    # FUSE reads bypass the block layer (/proc/self/io reads 0): the bytes the emulator served while it decoded
    return replace(
        sample,
        read_bytes=out["drive_read_bytes"],
        drive_bytes=run.bytes,
        drive_cpu_s=run.serve_cpu_s,
        drive_decode_cpu_s=out["drive_cpu_s"],
    )


def why_killed(e: WorkerError, name: str, mount: Any, group: Any) -> WorkerError:
    """A worker's failure, with the reason where a signal hides it: the emulated drive down (SIGBUS), or
    the run's memory cgroup's OOM killer (SIGKILL, counted in its memory.events)."""
    if mount is not None and e.signal == signal.SIGBUS and (down := mount.down()) is not None:
        return WorkerError(f"{name}: the emulated drive stopped (SIGBUS in the worker; {down})", e.returncode)
    if group is not None and e.signal == signal.SIGKILL and (kills := group.oom_kills()):
        return WorkerError(
            f"{name}: killed by its memory cgroup's OOM killer ({kills} oom_kill in its memory.events) at "
            f"{group.limit_bytes / 2**20:.0f} MiB: the run's own memory (llama.cpp's compute buffer, which a "
            "larger ubatch makes larger, the KV cache, the process) leaves the page cache too little; give a "
            "larger --memory-limit or a smaller --ubatch",
            e.returncode,
        )
    return e


def probe_memory(model: Path, cfg: Config, lib_dir: Path, opts: BenchOptions) -> dict[str, float]:
    """``{"compute_mib", "anon_mib"}`` of ``cfg``'s run: llama.cpp's compute buffer, and the worker's anonymous
    memory after one call of the run's (commands/bench_worker.py ``--memory-probe``; no cgroup, untimed)."""
    cmd = [str(model), "--memory-probe", "--prompt", str(opts.prompt), "--generate", str(opts.generate),
           "--threads", str(opts.threads)]  # fmt: skip
    if opts.text_file:
        cmd += ["--text-file", str(opts.text_file)]
    if not opts.extra_bufts:
        cmd += ["--no-extra-bufts"]
    return worker_json(cmd + prefill_args(cfg), lib_dir, f"{cfg.name}: the memory probe failed")


def prefill_args(cfg: Config) -> list[str]:
    """The worker's arguments of a prefill configuration (none for a decode one)."""
    if cfg.prompt_tokens is None:
        return []
    return ["--prefill", str(cfg.prompt_tokens)] + ([] if cfg.ubatch is None else ["--ubatch", str(cfg.ubatch)])


def _drive(cfg: Config, opts: BenchOptions) -> DriveRun | None:
    """The drive a configuration reads the model from (None: the model as given)."""
    if cfg.drive is None:
        return None
    if not opts.drives or cfg.drive not in opts.drives:
        raise ValueError(f"{cfg.name}: drive {cfg.drive}, but no such drive was set up for the run")
    return opts.drives[cfg.drive]


def check_build(out: dict, cfg: Config, lib_dir: Path) -> None:
    """WorkerError unless the worker ran the build its row names: the libllama under lib_dir,
    patched or not as cfg says, and no onebit_* symbol resolved on the unpatched one."""
    mapped = out.get("libllama")
    if mapped is not None and Path(mapped).resolve().parent != lib_dir.resolve():
        raise WorkerError(f"{cfg.name}: the worker mapped {mapped}, not the libllama in {lib_dir}")
    if out.get("patched") == cfg.pristine:
        raise WorkerError(f"{cfg.name}: the worker ran the {'patched' if cfg.pristine else 'unpatched'} build")
    if cfg.pristine and out.get("onebit_symbols"):
        raise WorkerError(f"{cfg.name}: the unpatched worker resolved {', '.join(out['onebit_symbols'])}")


def read_through(path: Path, chunk: int = 8 << 20) -> None:
    """Read a file once, so that its pages are in the page cache when a worker maps it."""
    with open(path, "rb", buffering=0) as f:
        while f.read(chunk):
            pass


def collect(
    model: Path, cfgs: Sequence[Config], lib: Path, lib_pristine: Path | None, opts: BenchOptions
) -> dict[str, list[Sample]]:
    """opts.rounds samples of every configuration, the order alternating round by round."""
    samples: dict[str, list[Sample]] = {c.name: [] for c in cfgs}
    for rnd in range(opts.rounds):
        order = list(cfgs) if rnd % 2 == 0 else list(reversed(cfgs))
        for cfg in order:
            lib_dir = lib_pristine if cfg.pristine else lib
            if lib_dir is None:
                raise NotBuiltError(f"{cfg.name}: no unpatched llama.cpp build; run ./build.sh pristine")
            samples[cfg.name].append(run_one(model, cfg, lib_dir, opts))
            logger.info("round %d/%d %s: %.1f tok/s", rnd + 1, opts.rounds, cfg.name, samples[cfg.name][-1].tok_s)
    return samples


# --- where the decoded tokens' time went (a memory row's ``decode``) ----------------------------


def split_ms(seconds: float, cpu_s: float, basis: str, tokens: int) -> tuple[float, float | None]:
    """(compute, waiting) ms per token of a decode of ``tokens`` that took ``seconds`` of wall time and
    ``cpu_s`` of CPU: waiting is wall less compute for the decoding thread's own CPU (COMPUTE_THREAD),
    None for the process's (several threads' CPU is no share of one thread's wall time)."""
    compute = 1e3 * cpu_s / tokens
    if basis != COMPUTE_THREAD:
        return compute, None
    return compute, max(0.0, 1e3 * seconds / tokens - compute)  # clock reads apart by microseconds


def expert_hit_rate(resident: int | None, missing: int | None) -> float | None:
    """The share of the routed experts' bytes resident when routed (None: no route time, nothing routed)."""
    if resident is None or missing is None or resident + missing <= 0:
        return None
    return resident / (resident + missing)


def _mib(n: int | None) -> float | None:
    return None if n is None or n < 0 else n / 2**20  # the room rule's -1: unknown


def run_split(s: Sample, tokens: int) -> DecodeSplit | None:
    """One run's figures per decoded token (None: a worker that timed no CPU)."""
    if s.cpu_s is None or not tokens:
        return None
    compute, wait = split_ms(s.seconds, s.cpu_s, s.cpu_basis or COMPUTE_THREAD, tokens)
    r = s.reads
    return DecodeSplit(
        compute,
        wait,
        s.cpu_basis or COMPUTE_THREAD,
        None if r is None else r.source,
        None if r is None else r.requests / tokens,
        None if r is None or r.mean_bytes is None else r.mean_bytes / 1024,
        None if r is None or r.largest_bytes is None else r.largest_bytes / 1024,
        None if r is None else r.largest_is,
        None if r is None else r.mean_ms,
        None if r is None else r.in_flight,
        None if r is None else r.busy,
        expert_hit_rate(s.route_resident_bytes, s.route_missing_bytes),
        _mib(s.room_bytes),
        _mib(s.room_need_bytes),
        None if s.route_wait_us is None else s.route_wait_us / 1000 / tokens,
        None if s.keep_capacity is None else float(s.keep_capacity),
        None if s.keep_capacity is None or s.keep_evicted is None else s.keep_evicted / tokens,
        None if s.spec_skipped is None else s.spec_skipped / tokens,
        None if s.spec_unused is None else s.spec_unused / tokens,
        None if s.layers_ops is None else s.layers_ops / tokens,
        None if s.layers_bytes is None else s.layers_bytes / 2**20 / tokens,
        None if s.layers_cut is None else s.layers_cut / tokens,
        others_cpu_ms=None if s.others_cpu_s is None else 1e3 * s.others_cpu_s / tokens,
        run_queue_ms=None if s.run_delay_s is None else 1e3 * s.run_delay_s / tokens,
    )


def decode_split(samples: Sequence[Sample], tokens: int) -> DecodeSplit | None:
    """The median over the runs of each per-token figure (:func:`run_split`); a figure any run lacks is
    None, a word (the basis, the source) the first run's. None where a run timed no CPU."""
    runs = [run_split(s, tokens) for s in samples]
    if not runs or any(r is None for r in runs):
        return None
    out: dict[str, Any] = {}
    for f in fields(DecodeSplit):
        values = [getattr(r, f.name) for r in runs]
        if any(v is None for v in values):
            out[f.name] = None
        else:
            out[f.name] = values[0] if isinstance(values[0], str) else statistics.median(values)
    return DecodeSplit(**out)
