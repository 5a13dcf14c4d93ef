#!/usr/bin/env python3
"""Benchmark ``onebit-stats`` on a synthetic P/A trace against a plain numpy pass over the same file.

What it measures (issue 5, "Performance"): the wall time and the peak memory of

(a) ``python -m onebit_predict.commands.stats TRACE --json > /dev/null`` -- the real command, and
(b) a plain numpy pass over the same file: the records' ``np.memmap`` (``Trace.open``), iterated in
    the chunk size onebit-stats uses (``TRACE_CHUNK_RECORDS``), summing every field the
    stats touch (step, seq_id, pos, layer, n_read, flags, actual ids and weights, predicted
    ids and logits). That is what "reading the file at all" costs in numpy.
(c) with ``--with-numpy-engine`` only: ``compute_stats(trace, engine="numpy")``, the numpy
    engine onebit-stats used before its compiled kernel, for comparison (not judged).

onebit-stats scores with a C kernel that is compiled once and cached
(``onebit_predict/metrics/stats_kernel.py``); the benchmark builds (or finds) it before the first
round, so that every measured run loads the cached module, as every run after the first
does. What that took is reported (``kernel_build_s``).

Each measurement runs in its own fresh process, (a) and (b) alternating in order round by
round (``--rounds``, default 3), in the same run, so drift on the machine spreads over both.
The result is the median wall time of each, their ratio (a)/(b), and the peak RSS of each.
Goals: ratio <= 3 and onebit-stats' peak RSS < 512 MiB, whatever the trace size.

How:

- each measurement is a fresh, tiny launcher process (``python -I -S -c LAUNCHER_SRC``, no
  numpy) that forks and execs the command, its stdout to /dev/null, waits for it and prints
  what it measured as JSON.
- wall time: ``time.perf_counter`` in the launcher around fork and exit, so interpreter
  start-up and the numpy import are in both numbers; CPU time (user + system) comes along.
- peak RSS: ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` in the launcher, which has
  exactly one child, so it is that command's own peak. Two traps this avoids: in this
  script, ``RUSAGE_CHILDREN`` is the maximum over *every* child waited for so far, so it
  cannot give a per-measurement peak after the first; and Linux carries the forking
  process's RSS over fork + exec into the child's ``ru_maxrss`` (``exec_mmap`` records the
  old mm's high-water mark), so a command spawned straight from this script (numpy, the
  trace generator: ~75 MiB) would report at least that (the launcher's own ``ru_maxrss``
  does, as CPython spawns it with vfork). The launcher's RSS when it forks (its
  ``VmRSS``, a few MiB) is the floor of the command's number and is reported. (``/usr/bin/time -v`` would do the same
  from a small C process, but is not installed everywhere and prints text to parse.)
  ``ru_maxrss`` counts every resident page of the process, file-backed ones included:
  pages of a memory-mapped trace that were touched count. To tell those apart, the
  launcher also samples ``/proc/PID/status`` every 10 ms (Linux only) and reports the peak
  ``RssAnon`` (heap: numpy arrays, Python objects) and ``RssFile`` (mapped file pages, the
  shared libraries included) it saw; being sampled, those two can miss a short spike. The
  goal is judged on ``ru_maxrss``.
- the page cache: dropping it needs root, so it is not dropped. Both passes read the same
  file after it was written (or, with ``--keep``, after a warm-up read of the whole file),
  so both read from the page cache: the numbers are CPU and memory costs, not disk speed.

The synthetic trace is ``onebit_predict.synth``'s (a llama-server-like run of a
Qwen3-30B-A3B-sized model, written in bounded memory; ``--seed`` seeds it, the same seed and
size give the same bytes); the file holds whole steps and is at most ``--size-mib``. This
script is the harness only: the trace, the measured commands, the report.

    python tools/bench_stats.py                        # 1 GiB, 3 rounds, temp dir, deleted after
    python tools/bench_stats.py --size-mib 64 --rounds 5 --json
    python tools/bench_stats.py --trace /tmp/t.trace --keep   # reused next time if the size matches
    python tools/bench_stats.py --size-mib 256 --with-numpy-engine   # and the numpy engine, as (c)

Exit codes: 0 the goals hold; 1 a goal is missed (or a measured command failed), the reason
printed; 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onebit_predict.constants import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, TRACE_CHUNK_RECORDS, TRACE_HEADER_SIZE
from onebit_predict.llama.drive import cpu_model
from onebit_predict.metrics.stats_kernel import StatsKernelError, load_kernel
from onebit_predict.synth import expected_size, plan, synth_header, write_trace
from onebit_predict.trace import TraceHeader

MIB = 1 << 20
GOAL_RATIO = 3.0
GOAL_PEAK_MIB = 512.0
MIN_STEPS = 10  # the smallest trace: the first ubatch (4 prompts) alone is ~3 MiB

# --- the measurements --------------------------------------------------------------------

# (b): a plain numpy pass over the records' memmap, in the package's layout: argv = TRACE CHUNK_RECORDS
BASELINE_SRC = r"""
import sys
import numpy as np
from onebit_predict.trace import Trace
path, chunk = sys.argv[1], int(sys.argv[2])
rec = Trace.open(path).records
n = len(rec)
ints = ("step", "seq_id", "pos", "layer", "n_read", "flags", "distance", "actual_ids", "pred_ids")
isum, fsum = 0, 0.0
for start in range(0, n, chunk):
    c = rec[start : start + chunk]
    for name in ints:
        isum += int(c[name].sum(dtype=np.int64))
    fsum += float(c["actual_w"].sum(dtype=np.float64)) + float(np.nansum(c["pred_logits"], dtype=np.float64))
print(n, isum, fsum)
"""


# (c): the numpy engine of onebit-stats, on the same trace: argv = TRACE
NUMPY_ENGINE_SRC = r"""
import sys
from onebit_predict.metrics.stats import compute_stats
from onebit_predict.trace import Trace
compute_stats(Trace.open(sys.argv[1]), engine="numpy")
"""


# Runs one measured command and reports it (JSON on stdout): a fresh, small process per
# measurement, so that its RUSAGE_CHILDREN covers exactly that one command, and so that the
# RSS the kernel carries over fork + exec into the child's ru_maxrss (the forking process's
# own) is the launcher's few MiB, not this script's. argv = the command; its stdout -> /dev/null.
LAUNCHER_SRC = r"""
import json, os, resource, sys, threading, time
cmd, peaks, done = sys.argv[1:], {}, threading.Event()
def sample(pid):
    path = "/proc/%d/status" % pid
    while not done.is_set():
        try:
            with open(path) as f:
                text = f.read()
        except OSError:
            return
        for line in text.splitlines():
            key, _, value = line.partition(":")
            if key in ("RssAnon", "RssFile"):
                peaks[key] = max(peaks.get(key, 0), int(value.split()[0]))
        done.wait(0.01)
floor = None  # VmRSS now: what a real fork's child starts with (this launcher's own ru_maxrss
try:          # holds the RSS of whoever spawned it, through vfork + exec)
    with open("/proc/self/status") as f:
        floor = next(int(l.split()[1]) for l in f if l.startswith("VmRSS:"))
except (OSError, StopIteration):
    pass
t0 = time.perf_counter()
pid = os.fork()
if pid == 0:
    try:
        fd = os.open(os.devnull, os.O_RDWR)
        os.dup2(fd, 0)
        os.dup2(fd, 1)
        os.execv(cmd[0], cmd)
    finally:
        os._exit(127)
sampler = threading.Thread(target=sample, args=(pid,), daemon=True)
sampler.start()
_, status = os.waitpid(pid, 0)
wall = time.perf_counter() - t0
done.set()
sampler.join()
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"rc": os.waitstatus_to_exitcode(status), "wall_s": wall, "maxrss": usage.ru_maxrss,
                  "launcher_rss_kb": floor, "anon_kb": peaks.get("RssAnon"), "file_kb": peaks.get("RssFile"),
                  "user_s": usage.ru_utime, "sys_s": usage.ru_stime}))
"""


@dataclass
class Measurement:
    wall_s: float
    maxrss_mib: float  # ru_maxrss of the command (RUSAGE_CHILDREN of its launcher)
    launcher_mib: float | None  # the launcher's RSS when it forks: the floor of maxrss_mib
    cpu_s: float  # user + system CPU time of the command
    anon_mib: float | None  # peak RssAnon sampled from /proc (None where not available)
    file_mib: float | None  # peak RssFile sampled from /proc


def measure(cmd: Sequence[str]) -> Measurement:
    """Run ``cmd`` (stdout to /dev/null) in a fresh launcher; raise RuntimeError if it fails."""
    with tempfile.TemporaryFile() as err:
        p = subprocess.run(
            [sys.executable, "-I", "-S", "-c", LAUNCHER_SRC, *cmd],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=err,
            check=False,
        )
        err.seek(0)
        tail = err.read().decode(errors="replace")[-2000:]
    try:
        r = json.loads(p.stdout)
    except ValueError:
        raise RuntimeError(f"the launcher failed (exit {p.returncode}):\n{tail}") from None
    if r["rc"] != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {r['rc']}:\n{tail}")
    unit = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: bytes on macOS, KiB on Linux
    return Measurement(
        wall_s=r["wall_s"],
        maxrss_mib=r["maxrss"] * unit / MIB,
        launcher_mib=None if r["launcher_rss_kb"] is None else r["launcher_rss_kb"] / 1024,
        cpu_s=r["user_s"] + r["sys_s"],
        anon_mib=None if r["anon_kb"] is None else r["anon_kb"] / 1024,
        file_mib=None if r["file_kb"] is None else r["file_kb"] / 1024,
    )


def _warm(path: Path) -> None:
    """Read the whole file once so that both passes find it in the page cache."""
    buf = bytearray(8 * MIB)
    with path.open("rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def machine() -> dict[str, object]:
    cpu = cpu_model(platform.processor() or "?")
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = round(int(line.split()[1]) / MIB, 1)  # kB -> GiB
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "mem_total_gib": mem,
        "python": platform.python_version(),
        "numpy": np.__version__,
        "platform": platform.platform(),
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# --- the command -------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="bench_stats.py",
        description=__doc__.splitlines()[0],
        epilog="exit codes: 0 goals hold, 1 a goal missed or a measured command failed, 2 usage error",
    )
    p.add_argument("--size-mib", type=float, default=1024.0, help="synthetic trace size in MiB (default 1024)")
    p.add_argument("--trace", type=Path, help="trace path (default: a temporary directory)")
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the trace afterwards, and reuse an existing one whose size (and seed) match",
    )
    p.add_argument("--rounds", type=int, default=3, help="rounds, each measuring both passes (default 3)")
    p.add_argument("--seed", type=int, default=0, help="RNG seed of the synthetic trace (default 0)")
    p.add_argument("--json", action="store_true", help="write the report as JSON to stdout instead of Markdown")
    p.add_argument(
        "--with-numpy-engine",
        action="store_true",
        help="also measure compute_stats(engine='numpy'), as (c) (slow: several times (a))",
    )
    return p


def _row(name: str, cmd: list[str], ms: list[Measurement]) -> dict[str, object]:
    anon = [m.anon_mib for m in ms if m.anon_mib is not None]
    files = [m.file_mib for m in ms if m.file_mib is not None]
    return {
        "name": name,
        "command": cmd,
        "wall_s": [round(m.wall_s, 4) for m in ms],
        "median_wall_s": round(statistics.median(m.wall_s for m in ms), 4),
        "min_wall_s": round(min(m.wall_s for m in ms), 4),
        "max_wall_s": round(max(m.wall_s for m in ms), 4),
        "median_cpu_s": round(statistics.median(m.cpu_s for m in ms), 4),
        "peak_rss_mib": round(max(m.maxrss_mib for m in ms), 1),
        "peak_rss_mib_per_round": [round(m.maxrss_mib, 1) for m in ms],
        "launcher_rss_mib": max((round(m.launcher_mib, 1) for m in ms if m.launcher_mib is not None), default=None),
        "peak_anon_mib_sampled": round(max(anon), 1) if anon else None,
        "peak_file_mib_sampled": round(max(files), 1) if files else None,
    }


def _markdown(report: dict) -> str:
    t, g = report["trace"], report["goals"]
    mc = report["machine"]
    how = "reused" if t["reused"] else f"written in {t['write_s']:.1f} s"
    lines = [
        f"trace: {t['path']} ({t['bytes'] / MIB:.1f} MiB, {t['records']} records, {t['steps']} steps, "
        f"{how}, seed {t['seed']})",
        f"machine: {mc['nproc']} CPUs, {mc['cpu']}, {mc['mem_total_gib']} GiB; "
        f"Python {mc['python']}, numpy {mc['numpy']}",
        f"load average (1, 5, 15 min): before {report['load_before']}, after {report['load_after']}",
        f"rounds: {report['rounds']}, each a fresh process per pass, order alternating; "
        f"the stats kernel built or found in the cache beforehand in {report['kernel_build_s']:.2f} s",
        "",
        "| pass | median wall s | min-max wall s | median CPU s | peak RSS MiB | peak anon MiB (sampled) "
        "| peak file MiB (sampled) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]

    def f(v):
        return "-" if v is None else f"{v:.1f}"

    for r in report["rows"]:
        lines.append(
            f"| {r['name']} | {r['median_wall_s']:.2f} | {r['min_wall_s']:.2f}-{r['max_wall_s']:.2f} "
            f"| {r['median_cpu_s']:.2f} | {r['peak_rss_mib']:.1f} | {f(r['peak_anon_mib_sampled'])} "
            f"| {f(r['peak_file_mib_sampled'])} |"
        )
    lines += [
        "",
        f"ratio (a)/(b), median wall: {report['ratio']:.2f} "
        f"(goal <= {g['ratio_max']:g}: {'ok' if g['ratio_ok'] else 'MISSED'})",
        f"peak RSS of (a): {report['rows'][0]['peak_rss_mib']:.1f} MiB "
        f"(goal < {g['peak_rss_max_mib']:g} MiB: {'ok' if g['rss_ok'] else 'MISSED'}); "
        f"the launcher's RSS when it forks, the floor of that number: {f(report['rows'][0]['launcher_rss_mib'])} MiB",
        "",
        "(a) " + " ".join(report["rows"][0]["command"]) + " > /dev/null",
        "(b) python -c BASELINE_SRC TRACE CHUNK: the records' np.memmap (Trace.open), summing every field per chunk "
        f"of {report['chunk_records']} records",
        *(
            ["(c) python -c NUMPY_ENGINE_SRC TRACE: compute_stats(trace, engine='numpy')"]
            if len(report["rows"]) > 2
            else []
        ),
        "",
        "note: " + report["note"],
    ]
    return "\n".join(lines)


NOTE = (
    "the page cache was not dropped (that needs root): both passes read the same file after it was written "
    "(or read once to warm it), so both read it from the page cache. Peak RSS is the command's ru_maxrss "
    "(RUSAGE_CHILDREN of a fresh launcher per measurement), which counts the touched pages of a memory-mapped "
    "trace; anon (heap) and file (mapped file pages) are /proc samples every 10 ms."
)


def _args_problem(args: argparse.Namespace) -> str | None:
    """Why the arguments cannot be run, or None."""
    if not (math.isfinite(args.size_mib) and args.size_mib > 0):
        return f"--size-mib must be a positive number, not {args.size_mib:g}"
    if args.rounds < 1:
        return "--rounds must be >= 1"
    if args.seed < 0:
        return "--seed must be >= 0"
    n_steps, _ = plan(int(args.size_mib * MIB), args.seed)
    if n_steps < MIN_STEPS:
        return (
            f"--size-mib {args.size_mib:g} holds {n_steps} whole ubatches of the synthetic "
            f"schedule; give at least {MIN_STEPS} (try 4 MiB or more)"
        )
    return None


def _trace_path(args: argparse.Namespace) -> tuple[tempfile.TemporaryDirectory | None, Path]:
    """(the temporary directory to clean up or None, the trace's path)."""
    if args.trace is not None:
        return None, args.trace
    if args.keep:
        return None, Path(tempfile.gettempdir()) / f"onebit-bench-stats-{args.size_mib:g}MiB-seed{args.seed}.trace"
    tmp = tempfile.TemporaryDirectory(prefix="onebit-bench-stats-")
    return tmp, Path(tmp.name) / "synthetic.trace"


def _path_problem(args: argparse.Namespace, path: Path, seed_header: TraceHeader) -> str | None:
    """Why the trace path cannot be written or reused, or None."""
    if not path.parent.is_dir():
        return f"{path.parent} is not a directory"
    if not path.exists():
        return None
    if not args.keep:
        return f"{path} exists; pass --keep to reuse it, or choose another --trace"
    with path.open("rb") as fh:
        if fh.read(TRACE_HEADER_SIZE) != seed_header.to_bytes():
            return f"{path} is not a synthetic trace of seed {args.seed}; refusing to overwrite it"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:
        return EXIT_OK if e.code in (0, None) else EXIT_USAGE
    problem = _args_problem(args)
    if problem:
        print(f"bench_stats: {problem}", file=sys.stderr)
        return EXIT_USAGE
    size = int(args.size_mib * MIB)
    seed_header = synth_header(args.seed)
    n_steps, n_records = plan(size, args.seed)
    want = expected_size(size, args.seed)
    tmp, path = _trace_path(args)
    problem = _path_problem(args, path, seed_header)
    if problem:
        print(f"bench_stats: {problem}", file=sys.stderr)
        return EXIT_USAGE
    reuse = path.exists() and path.stat().st_size == want

    try:
        load_before = _loadavg()
        write_s = 0.0
        if reuse:
            print(f"bench_stats: reusing {path} ({want / MIB:.1f} MiB); warming the page cache", file=sys.stderr)
            _warm(path)
        else:
            print(f"bench_stats: writing {want / MIB:.1f} MiB to {path}", file=sys.stderr)
            t0 = time.perf_counter()
            write_trace(path, size, args.seed)
            write_s = time.perf_counter() - t0
        assert path.stat().st_size == want

        t0 = time.perf_counter()
        try:
            load_kernel()  # compiled once into the cache: the measured runs load it from there
        except StatsKernelError as e:
            print(f"bench_stats: FAILED: {e}", file=sys.stderr)
            return EXIT_CHECK_FAILED
        kernel_build_s = time.perf_counter() - t0

        cmds = {
            "(a) onebit-stats --json": [sys.executable, "-m", "onebit_predict.commands.stats", str(path), "--json"],
            "(b) numpy memmap pass": [sys.executable, "-c", BASELINE_SRC, str(path), str(TRACE_CHUNK_RECORDS)],
        }
        shown = {  # the commands as reported: the inline sources by name
            **cmds,
            "(b) numpy memmap pass": [sys.executable, "-c", "BASELINE_SRC", str(path), str(TRACE_CHUNK_RECORDS)],
        }
        if args.with_numpy_engine:
            cmds["(c) numpy engine"] = [sys.executable, "-c", NUMPY_ENGINE_SRC, str(path)]
            shown["(c) numpy engine"] = [sys.executable, "-c", "NUMPY_ENGINE_SRC", str(path)]
        names = list(cmds)
        results: dict[str, list[Measurement]] = {n: [] for n in names}
        for rnd in range(args.rounds):
            for name in names if rnd % 2 == 0 else names[::-1]:
                print(f"bench_stats: round {rnd + 1}/{args.rounds}: {name}", file=sys.stderr)
                try:
                    results[name].append(measure(cmds[name]))
                except RuntimeError as e:
                    print(f"bench_stats: FAILED: {e}", file=sys.stderr)
                    return EXIT_CHECK_FAILED
        load_after = _loadavg()

        rows = [_row(n, shown[n], results[n]) for n in names]
        ratio = rows[0]["median_wall_s"] / rows[1]["median_wall_s"]
        ratio_ok, rss_ok = ratio <= GOAL_RATIO, rows[0]["peak_rss_mib"] < GOAL_PEAK_MIB
        report = {
            "trace": {
                "path": str(path),
                "bytes": want,
                "records": n_records,
                "steps": n_steps,
                "seed": args.seed,
                "reused": reuse,
                "write_s": round(write_s, 2),
                "kept": args.keep,
            },
            "rounds": args.rounds,
            "chunk_records": TRACE_CHUNK_RECORDS,
            "kernel_build_s": round(kernel_build_s, 3),
            "rows": rows,
            "ratio": round(ratio, 3),
            "goals": {
                "ratio_max": GOAL_RATIO,
                "peak_rss_max_mib": GOAL_PEAK_MIB,
                "ratio_ok": ratio_ok,
                "rss_ok": rss_ok,
                "ok": ratio_ok and rss_ok,
            },
            "machine": machine(),
            "load_before": load_before,
            "load_after": load_after,
            "baseline_src": BASELINE_SRC,
            "note": NOTE,
        }
        print(json.dumps(report, indent=2) if args.json else _markdown(report))
        if not ratio_ok:
            print(
                f"bench_stats: goal missed: onebit-stats takes {ratio:.2f}x the numpy pass (goal <= {GOAL_RATIO:g}x)",
                file=sys.stderr,
            )
        if not rss_ok:
            print(
                f"bench_stats: goal missed: onebit-stats peak RSS {rows[0]['peak_rss_mib']:.1f} MiB "
                f"(goal < {GOAL_PEAK_MIB:g} MiB)",
                file=sys.stderr,
            )
        return EXIT_OK if ratio_ok and rss_ok else EXIT_CHECK_FAILED
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
