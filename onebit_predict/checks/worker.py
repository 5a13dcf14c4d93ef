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
"""

from __future__ import annotations

import io
import os
import re
import resource
import time
from contextlib import redirect_stderr
from dataclasses import dataclass
from pathlib import Path

from ..llama.cgroup import io_read_bytes

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


def _route_missing(before: dict[str, int] | None, after: dict[str, int] | None) -> int | None:
    """The bytes the routed experts lacked in the page cache when routed, between two counts (None without
    route time)."""
    if not (before and after and before["route"]):
        return None
    return after["route_bytes"] - before["route_bytes"]


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


def run_worker(opts: WorkerOptions) -> dict:
    """``{"tok_s", "compute_mib", "n_layer", "resident_after_evict", ..., "patched", "libllama",
    "onebit_symbols"}`` of one run in this process."""
    os.environ["ONEBIT_VERBOSE"] = "1"  # the compute-buffer line is an info log
    from ..llama.runner import Context, ContextSettings, Model, builtin_tokens, onebit_symbols, patched, use_unpatched

    if opts.pristine:
        use_unpatched()

    captured = io.StringIO()
    if opts.cgroup is not None:
        from ..llama.cgroup import drop_from_page_cache, join

        join(opts.cgroup)
        drop_from_page_cache(opts.model)  # charged to the group that reads it: this one
    with Model(opts.model, extra_bufts=opts.extra_bufts) as model:
        pages = None
        if opts.cold_method:
            from ..llama.evict import ExpertPages

            pages = ExpertPages(opts.model)
            pages.random_access()
        n_toks = opts.prompt + opts.generate
        if opts.text_file:  # byte-level models: a byte is its own token id
            toks = list(opts.text_file.read_bytes()[:n_toks])
        else:
            toks = builtin_tokens(n_toks, model.n_vocab, 0)
        settings = ContextSettings(
            n_ctx=opts.prompt + opts.generate + 8, n_batch=opts.prompt, n_ubatch=opts.prompt, n_threads=opts.threads
        )
        with redirect_stderr(captured):
            ctx = Context(model, settings, opts.env)
        with ctx:
            n = opts.prompt
            ctx.decode(toks[:n], range(n), [0] * n, [False] * (n - 1) + [True])
            elapsed = 0.0
            left = 0.0 if pages is not None else None
            drive0 = _drive_snapshot(opts.drive_stats)
            stats0 = _stats(ctx, opts)
            read0, faults0 = io_read_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_majflt
            for i in range(opts.generate):
                if pages is not None:
                    # reads still in flight (madvise readahead) land before the eviction, not after it
                    time.sleep(EVICT_SETTLE_S)
                    pages.evict(opts.cold_method)
                    left = max(left, pages.resident_fraction())
                t0 = time.perf_counter()
                ctx.decode([toks[n + i]], [n + i], [0], [True])
                elapsed += time.perf_counter() - t0
            read_bytes = io_read_bytes() - read0  # the decoded tokens' reads from the drive, all threads
            major_faults = resource.getrusage(resource.RUSAGE_SELF).ru_majflt - faults0
            drive = None if drive0 is None else _drive_snapshot(opts.drive_stats).minus(drive0)
            stats1 = _stats(ctx, opts)
            if pages is not None:
                pages.close()
    mib = sum(float(m.group(2)) for m in COMPUTE_BUFFER.finditer(captured.getvalue()))
    return {
        "tok_s": opts.generate / elapsed,
        "compute_mib": mib,
        "n_layer": model.n_layer,
        "resident_after_evict": left,
        "read_bytes": read_bytes,
        "major_faults": major_faults,
        "seconds": elapsed,
        "drive_read_bytes": None if drive is None else drive.bytes,
        "drive_cpu_s": None if drive is None else drive.serve_cpu_s,
        # route time (the consumer's route-time op): what the decoded tokens' routed experts lacked when routed
        "route_missing_bytes": _route_missing(stats0, stats1),
        "patched": patched(),
        "libllama": mapped_libllama(),
        "onebit_symbols": onebit_symbols(),
    }
