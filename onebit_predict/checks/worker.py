"""One timed run of a benchmark configuration, in the worker process (checks/rounds.py).

A prefill, then ``generate`` single-token decodes, timed one by one; with ``cold_method``,
the expert pages are evicted before every decode (untimed). The worker is started as
``python -m onebit_predict.commands.bench_worker`` (its own entry point, which parses
:class:`WorkerOptions` from its arguments) with the patched or the unpatched libllama in
``LLAMA_CPP_LIB_PATH`` (``--pristine`` says which: the unpatched one has no onebit_* symbol, so
that worker makes its context with plain ``llama_init_from_model``), and prints
:func:`run_worker`'s dict as a JSON line, with the libllama it mapped and the onebit_* symbols
it resolved, so that the caller can check it ran the build it was told to.

With ``drive_stats`` (the model on an emulated drive: the emulator's pid and stats file) it takes
the emulator's counters just before the first timed decode and just after the last
(drive/emudrive.py ``snapshot``): ``drive_read_bytes`` (the bytes served while it decoded: FUSE
reads never reach the block layer, so ``read_bytes`` from /proc/self/io is 0 there) and
``drive_cpu_s`` (the emulator's CPU seconds meanwhile, taken from the cores the decode runs on).

Where each token's time goes: ``cpu_s`` sums the CPU time around each decode call. With one
thread (``cpu_basis`` COMPUTE_THREAD) it is this thread's own (``time.thread_time``): llama.cpp's
CPU backend computes a one-thread graph on the calling thread, so that is the compute, the
kernel's fault handling and reclaim in that thread included, and the rest of the wall time is the
thread off CPU (waiting on reads, page locks, reclaim). With more threads it is the process's
(``time.process_time``, COMPUTE_PROCESS): every compute thread and the consumer's workers together,
no split of the wall time. With one thread, :class:`DecodeClocks` also takes ``others_cpu_s`` (the rest
of the process's CPU around the calls: the consumer's workers) and ``run_delay_s`` (the decoding thread's
time runnable but not running, from /proc/thread-self/schedstat: the part of the wait spent waiting for a
core). ``reads`` (llama/diskstats.py ``ReadRequests``) are the read requests the drive served over the
decode loop: /proc/diskstats of the model's block device, or the emulated
drive's counters. ``route_resident_bytes`` (route time: the routed experts' bytes resident when
routed, over the decode) beside ``route_missing_bytes``; ``room_bytes`` and ``room_need_bytes``, the
room rule's last measurement after the decode (-1: unknown).

With ``prefill`` (``onebit-bench --prompt-tokens``, checks/bench_prefill.py) the run processes a prompt of
that many tokens instead, in calls of ``ubatch`` tokens (n_batch = n_ubatch = ubatch, n_ctx holding the
prompt), and decodes nothing after it: ``tok_s`` is the prompt's tokens over the wall time of its decode
calls, and every counter above (bytes read, faults, requests, CPU, route time) is taken around them. The
prompt's tokens: ``text_file``'s bytes, repeated to the length, else the built-in stream.
"""

from __future__ import annotations

import io
import os
import re
import resource
import time
from collections.abc import Callable, Sequence
from contextlib import redirect_stderr
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..constants import (
    COMPUTE_PROCESS,
    COMPUTE_THREAD,
    LARGEST_SEEN,
    PREFILL_CTX_SLACK,
    PROC_DISKSTATS,
    PROC_SCHEDSTAT,
)
from ..llama.cgroup import io_read_bytes
from ..llama.diskstats import ReadRequests, model_disk, read_diskstats

COMPUTE_BUFFER = re.compile(r"(\S+) compute buffer size = +([0-9.]+) MiB")
EVICT_SETTLE_S = 0.02  # --cold: untimed wait before each eviction, for asynchronous readahead to finish


@dataclass(frozen=True)
class WorkerOptions:
    model: Path
    env: dict[str, str]  # the configuration's ONEBIT_* environment
    prompt: int = 32
    generate: int = 64
    threads: int = 2
    text_file: Path | None = None
    cold_method: str | None = None
    cgroup: Path | None = None  # --memory-limit: join this memory cgroup first, then drop the model from the page cache
    extra_bufts: bool = True  # llama.cpp's extra buffer types (runner.Model)
    pristine: bool = False  # LLAMA_CPP_LIB_PATH is the unpatched pin's libllama: no onebit_* call, no knob
    drive_stats: tuple[int, Path] | None = None  # an emulated drive: its emulator's pid and stats file
    prefill: int | None = None  # process a prompt of this many tokens (and decode none), timed
    ubatch: int | None = None  # ... in calls of this many (n_batch = n_ubatch); None: the whole prompt in one


def detect_eviction(model: Path) -> dict:
    """``{"method", "notes", "expert_bytes"}``: the eviction method that works here, with the model mapped."""
    from ..llama.evict import ExpertPages
    from ..llama.runner import Model

    with Model(model) as _:
        pages = ExpertPages(model)
        pages.random_access()
        method, notes = pages.detect()
        return {"method": method, "notes": notes, "expert_bytes": pages.nbytes}


def _drive_snapshot(drive_stats: tuple[int, Path] | None):
    """The emulated drive's counters now (drive/emudrive.py DriveStats), None without one."""
    if drive_stats is None:
        return None
    from ..drive.emudrive import snapshot

    return snapshot(*drive_stats)


def _stats(ctx, opts: WorkerOptions) -> dict[str, int] | None:
    """The context's onebit counters (llama/moe_stats.py), None on the unpatched build or with everything off."""
    if opts.pristine:
        return None
    from ..llama.moe_stats import context_stats
    from ..llama.runner import llama

    return context_stats(llama(), ctx.ptr)


def _route_counter(before: dict[str, int] | None, after: dict[str, int] | None, name: str) -> int | None:
    """A route-time counter's growth between two counts (None without route time)."""
    if not (before and after and before["route"]):
        return None
    return after[name] - before[name]


def _guess_counter(before: dict[str, int] | None, after: dict[str, int] | None, name: str) -> int | None:
    """A counter of the LRU's room for guesses: its growth, None without both a predictor and keep=lru."""
    if not (after and after["speculative"] and after["keep"]):
        return None
    return _route_counter(before, after, name)


def _layers_counter(before: dict[str, int] | None, after: dict[str, int] | None, name: str) -> int | None:
    """A counter of the whole layers a batch reads ahead: its growth, None without the knob."""
    if not (after and after["layers"]):
        return None
    return _route_counter(before, after, name)


def cpu_clock(threads: int) -> tuple[Callable[[], float], str]:
    """The CPU clock of the decode's compute and its basis: one thread, the calling thread's own (the
    CPU backend computes a one-thread graph on the thread that calls llama_decode); more, the process's."""
    return (time.thread_time, COMPUTE_THREAD) if threads == 1 else (time.process_time, COMPUTE_PROCESS)


def run_delay_s(schedstat: str | Path = PROC_SCHEDSTAT) -> float | None:
    """The calling thread's time so far runnable but not running, seconds: the second field of
    /proc/thread-self/schedstat (None where the kernel keeps none)."""
    try:
        return int(Path(schedstat).read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class DecodeClocks:
    """The clocks around each decode call (:meth:`start`, :meth:`stop`): ``cpu`` the compute's
    (:func:`cpu_clock`); with one thread also ``others``, the rest of the process's CPU meanwhile (the
    consumer's workers: their pread, page allocation and mremap, which share the cores with the decode),
    and ``run_delay``, the decoding thread's time on the run queue (runnable, not running: part of the
    wait), None where the kernel keeps no schedstat."""

    def __init__(self, threads: int, schedstat: str | Path = PROC_SCHEDSTAT) -> None:
        self.clock, self.basis = cpu_clock(threads)
        self.schedstat = schedstat
        self.cpu = self.others = 0.0
        self.run_delay: float | None = 0.0
        self._at = (0.0, 0.0, None)

    def _delay(self) -> float | None:
        # with several compute threads no thread's wait is the token's (as_json leaves it out): not read
        return run_delay_s(self.schedstat) if self.basis == COMPUTE_THREAD else None

    def start(self) -> None:
        self._at = (self.clock(), time.process_time(), self._delay())

    def stop(self) -> None:
        cpu0, process0, delay0 = self._at
        cpu = self.clock() - cpu0
        self.cpu += cpu
        self.others += max(0.0, time.process_time() - process0 - cpu)  # clock reads apart by microseconds
        delay = self._delay()
        if self.run_delay is not None and delay is not None and delay0 is not None:
            self.run_delay += delay - delay0
        else:
            self.run_delay = None

    def as_json(self) -> dict[str, Any]:
        """The run's ``cpu_s``, ``cpu_basis``, ``others_cpu_s`` and ``run_delay_s`` (the last two None with
        several compute threads: the process's CPU is the compute's then, and no thread's wait is the token's)."""
        one = self.basis == COMPUTE_THREAD
        return {
            "cpu_s": self.cpu,
            "cpu_basis": self.basis,
            "others_cpu_s": self.others if one else None,
            "run_delay_s": self.run_delay if one else None,
        }


class ReadCounter:
    """The read requests the model's drive serves between :meth:`start` and :meth:`stop`: the emulated
    drive's counters where the model is on one, else /proc/diskstats of its block device (None where it
    has none: tmpfs, FUSE without the emulator's counters)."""

    def __init__(self, model: Path, drive_stats: tuple[int, Path] | None, diskstats: str | Path = PROC_DISKSTATS):
        self.drive_stats, self.diskstats = drive_stats, Path(diskstats)
        self.disk = None if drive_stats is not None else model_disk(model)
        self._t0, self._disk0, self._drive0 = 0.0, None, None

    def start(self) -> None:
        self._drive0 = _drive_snapshot(self.drive_stats)
        self._disk0 = None if self.disk is None else read_diskstats(self.disk.names, self.diskstats)
        self._t0 = time.perf_counter()

    def stop(self) -> tuple[ReadRequests | None, Any]:
        """(the requests, the emulated drive's counters over the interval: drive/emudrive.py DriveStats or None)."""
        wall = time.perf_counter() - self._t0
        if self._drive0 is not None:
            d = _drive_snapshot(self.drive_stats).minus(self._drive0)
            # the device's schedule: residence is diskstats' read and weighted time, busy its io_ticks
            ms = 1e3 * d.residence_s
            return ReadRequests(
                "emulated", d.requests, d.bytes, wall, d.max_request, LARGEST_SEEN, ms, ms, 1e3 * d.busy_s
            ), d
        after = None if self.disk is None else read_diskstats(self.disk.names, self.diskstats)
        if after is None or self._disk0 is None or after.name != self._disk0.name:
            return None, None
        return ReadRequests.of_disk(after.minus(self._disk0), wall, self.disk.max_sectors_kb), None


class Span:
    """What the drive, this process and the consumer did between its making and :meth:`stop`: the bytes
    read (all threads), the major faults, the read requests and the route-time and room counters."""

    def __init__(self, ctx, opts: WorkerOptions) -> None:
        self.ctx, self.opts = ctx, opts
        self.counter = ReadCounter(opts.model, opts.drive_stats)
        self.counter.start()
        self.stats0 = _stats(ctx, opts)
        self.read0, self.faults0 = io_read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt

    def stop(self) -> dict[str, Any]:
        read_bytes = io_read_bytes() - self.read0
        major_faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - self.faults0
        reads, drive = self.counter.stop()
        stats1 = _stats(self.ctx, self.opts)
        return {
            "read_bytes": read_bytes,
            "major_faults": major_faults,
            "drive_read_bytes": None if drive is None else drive.bytes,
            "drive_cpu_s": None if drive is None else drive.serve_cpu_s,
            # route time (the consumer's route-time op): what the timed tokens' routed experts lacked when routed
            "route_missing_bytes": _route_counter(self.stats0, stats1, "route_bytes"),
            "route_resident_bytes": _route_counter(self.stats0, stats1, "route_resident"),
            "route_wait_us": _route_counter(self.stats0, stats1, "route_wait_us"),
            "keep_evicted": _route_counter(self.stats0, stats1, "keep_evicted"),
            "keep_capacity": None if stats1 is None or not stats1["keep"] else stats1["keep_capacity"],
            # keep=lru with a predictor: the guesses its room had no place for, and those read but not routed
            "spec_skipped": _guess_counter(self.stats0, stats1, "spec_skipped"),
            "spec_unused": _guess_counter(self.stats0, stats1, "spec_unused"),
            # layers: the batches' ops that read the next layers ahead, the bytes they queued, the depths cut
            "layers_ops": _layers_counter(self.stats0, stats1, "layers_ops"),
            "layers_bytes": _layers_counter(self.stats0, stats1, "layers_bytes"),
            "layers_cut": _layers_counter(self.stats0, stats1, "layers_cut"),
            "reads": None if reads is None else asdict(reads),
            "room_bytes": None if stats1 is None else stats1["room_bytes"],
            "room_need_bytes": None if stats1 is None else stats1["room_need_bytes"],
        }


def run_tokens(text_file: Path | None, n: int, n_vocab: int) -> list[int]:
    """A run's n tokens: text_file's bytes (byte-level models: a byte is its own token id), repeated to
    reach n, else the built-in stream."""
    from ..llama.runner import builtin_tokens

    if text_file is None:
        return builtin_tokens(n, n_vocab, 0)
    data = text_file.read_bytes()
    if not data:
        raise ValueError(f"--text-file {text_file} is empty")
    return list((data * -(-n // len(data)))[:n])


def decode_at(ctx, toks: Sequence[int], start: int) -> None:
    """Decode ``toks`` as one call at positions ``start``.., sequence 0, the last token's logits wanted (as
    llama_batch_get_one asks)."""
    n = len(toks)
    ctx.decode(toks, range(start, start + n), [0] * n, [False] * (n - 1) + [True])


def timed_prefill(ctx, opts: WorkerOptions, toks: Sequence[int]) -> tuple[float, DecodeClocks, dict[str, Any]]:
    """(wall seconds, the clocks, the Span's counters) of the prompt ``toks`` decoded in calls of
    ``opts.ubatch`` tokens, each call's last token's logits wanted (as llama_batch_get_one asks)."""
    n = len(toks)
    step = opts.ubatch or n
    elapsed = 0.0
    clocks = DecodeClocks(opts.threads)
    span = Span(ctx, opts)
    for start in range(0, n, step):
        chunk = list(toks[start : start + step])
        t0 = time.perf_counter()
        clocks.start()
        decode_at(ctx, chunk, start)
        clocks.stop()
        elapsed += time.perf_counter() - t0
    return elapsed, clocks, span.stop()


def mapped_libllama() -> str | None:
    """The libllama.so this process has mapped (/proc/self/maps), or None where it cannot tell."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    fields = (line.split(None, 5) for line in maps.splitlines())
    # the file itself, whatever version suffix the build gave it (libllama.so.0.0.N behind the symlink)
    paths = {f[5] for f in fields if len(f) == 6 and Path(f[5]).name.startswith("libllama.so")}
    return paths.pop() if len(paths) == 1 else None


def context_settings(opts: WorkerOptions):
    """The context a run makes: a prefill's n_batch = n_ubatch = its ubatch (n_ctx holding the prompt), a
    decode's the prompt's length."""
    from ..llama.runner import ContextSettings

    if opts.prefill is not None:
        u = opts.ubatch or opts.prefill
        return ContextSettings(n_ctx=opts.prefill + PREFILL_CTX_SLACK, n_batch=u, n_ubatch=u, n_threads=opts.threads)
    n_ctx = opts.prompt + opts.generate + 8
    return ContextSettings(n_ctx=n_ctx, n_batch=opts.prompt, n_ubatch=opts.prompt, n_threads=opts.threads)


def compute_buffer_mib(log: str) -> float:
    """llama.cpp's compute buffers in MiB, summed over backends, from the log of a context's creation."""
    return sum(float(m.group(2)) for m in COMPUTE_BUFFER.finditer(log))


def anon_mib() -> float:
    """This process's anonymous memory now (RssAnon of /proc/self/status), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("/proc/self/status has no RssAnon line")


def probe_memory(opts: WorkerOptions) -> dict:
    """``{"compute_mib", "anon_mib"}``: the compute buffer of the context ``opts`` would run in, and the
    process's anonymous memory once that context has computed one call of the run's (a prefill's first
    ubatch; a decode's prompt, then one token), its work buffers included (no cgroup joined, nothing timed:
    checks/bench_prefill.py sizes a prefill run's cgroup with it)."""
    os.environ["ONEBIT_VERBOSE"] = "1"  # the compute-buffer line is an info log
    from ..llama.runner import Context, Model, use_unpatched

    if opts.pristine:
        use_unpatched()
    captured = io.StringIO()
    with Model(opts.model, extra_bufts=opts.extra_bufts) as model:
        with redirect_stderr(captured):
            ctx = Context(model, context_settings(opts), opts.env)
        with ctx:
            if opts.prefill is not None:
                first = min(opts.ubatch or opts.prefill, opts.prefill)  # the first ubatch: the largest call
                decode_at(ctx, run_tokens(opts.text_file, first, model.n_vocab), 0)
            else:
                toks = run_tokens(opts.text_file, opts.prompt + 1, model.n_vocab)
                decode_at(ctx, toks[: opts.prompt], 0)
                decode_at(ctx, toks[opts.prompt :], opts.prompt)
            anon = anon_mib()
    return {"compute_mib": compute_buffer_mib(captured.getvalue()), "anon_mib": anon}


def run_worker(opts: WorkerOptions) -> dict:
    """``{"tok_s", "compute_mib", "n_layer", "resident_after_evict", ..., "patched", "libllama",
    "onebit_symbols"}`` of one run in this process."""
    os.environ["ONEBIT_VERBOSE"] = "1"  # the compute-buffer line is an info log
    from ..llama.runner import Context, Model, onebit_symbols, patched, use_unpatched

    if opts.pristine:
        use_unpatched()

    captured = io.StringIO()
    if opts.cgroup is not None:
        from ..llama.cgroup import drop_from_page_cache, join

        join(opts.cgroup)
        drop_from_page_cache(opts.model)  # charged to the group that reads it: this one
    with Model(opts.model, extra_bufts=opts.extra_bufts) as model:
        pages = None
        if opts.cold_method and opts.prefill is None:
            from ..llama.evict import ExpertPages

            pages = ExpertPages(opts.model)
            pages.random_access()
        n = opts.prompt + opts.generate if opts.prefill is None else opts.prefill
        toks = run_tokens(opts.text_file, n, model.n_vocab)
        with redirect_stderr(captured):
            ctx = Context(model, context_settings(opts), opts.env)
        with ctx:
            left = None
            if opts.prefill is not None:
                elapsed, clocks, counted = timed_prefill(ctx, opts, toks)
                timed = opts.prefill
            else:
                n = opts.prompt
                decode_at(ctx, toks[:n], 0)
                elapsed = 0.0
                left = 0.0 if pages is not None else None
                clocks = DecodeClocks(opts.threads)
                span = Span(ctx, opts)
                for i in range(opts.generate):
                    if pages is not None:
                        # reads still in flight (madvise readahead) land before the eviction, not after it
                        time.sleep(EVICT_SETTLE_S)
                        pages.evict(opts.cold_method)
                        left = max(left, pages.resident_fraction())
                    t0 = time.perf_counter()
                    clocks.start()
                    decode_at(ctx, [toks[n + i]], n + i)
                    clocks.stop()
                    elapsed += time.perf_counter() - t0
                counted = span.stop()  # the decoded tokens' reads from the drive, all threads
                timed = opts.generate
            if pages is not None:
                pages.close()
    mib = compute_buffer_mib(captured.getvalue())
    out = {
        "tok_s": timed / elapsed,
        "compute_mib": mib,
        "n_layer": model.n_layer,
        "resident_after_evict": left,
        "seconds": elapsed,
        **clocks.as_json(),
        **counted,
        "patched": patched(),
        "libllama": mapped_libllama(),
        "onebit_symbols": onebit_symbols(),
    }
    if opts.prefill is not None:
        out |= {"prompt_tokens": opts.prefill, "ubatch": opts.ubatch or opts.prefill}
    return out
