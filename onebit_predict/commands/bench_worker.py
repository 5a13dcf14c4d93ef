"""The worker of ``onebit-bench``: one configuration's run in a process of its own (checks/worker.py).

Not a command for people: checks/rounds.py starts it, one process per configuration and
round, as ``python -m onebit_predict.commands.bench_worker MODEL.gguf --env JSON ...`` with
the patched or the unpatched libllama in ``LLAMA_CPP_LIB_PATH``, and reads the JSON object it
prints as its last stdout line. ``--detect MODEL.gguf`` prints instead which page eviction
works here (checks/bench_cold.py); ``--prefill N --ubatch U`` times an N-token prompt in calls of
U tokens instead of the decode (checks/bench_prefill.py); ``--memory-probe`` prints the run's compute
buffer and its anonymous memory after one call, and stops (checks/bench_prefill.py sizes a prefill's
cgroup with it).
Its parser lives here, apart from onebit-bench's, so that the user's command line holds only the user's
options.

Exit codes (commands/common.py): 0 the JSON line was printed; 1 or 2 it was not, the reason on
stderr, which checks/rounds.py reports as a ``WorkerError``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from ..checks.worker import WorkerOptions, detect_eviction, probe_memory, run_worker
from ..constants import EXIT_OK
from .common import EPILOG, arg_type, model_parent, positive_int, require_file, run_command

PROG = "onebit-bench-worker"


def _env(text: str) -> dict[str, str]:
    """--env: the configuration's ONEBIT_* environment, a JSON object of strings."""
    env = json.loads(text)
    if not isinstance(env, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
        raise ValueError(f"--env must be a JSON object of strings, not {text!r}")
    return env


def _drive_stats(text: str) -> tuple[int, Path]:
    """--drive-stats PID:FILE: the emulated drive's emulator and its stats file."""
    pid, sep, path = text.partition(":")
    if not sep or not pid.isdigit() or not path:
        raise ValueError(f"--drive-stats takes PID:FILE, not {text!r}")
    return int(pid), Path(path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.splitlines()[0], epilog=EPILOG, parents=[model_parent(extra_bufts=True)]
    )
    p.add_argument("--detect", action="store_true", help="print the page eviction method that works here, and stop")
    p.add_argument(
        "--memory-probe",
        action="store_true",
        help="print the run's compute buffer and anonymous memory after one call, and stop",
    )
    p.add_argument("--env", type=arg_type(_env), default={}, help="the configuration's ONEBIT_* variables (JSON)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--generate", type=int, default=64)
    p.add_argument("--prefill", type=arg_type(positive_int), metavar="N", help="time a prompt of N tokens instead")
    p.add_argument("--ubatch", type=arg_type(positive_int), metavar="U", help="--prefill: in calls of U tokens")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--text-file", type=Path, help="feed this file's bytes as token ids")
    p.add_argument("--cold-method", help="evict the expert pages this way before every decoded token")
    p.add_argument("--cgroup", type=Path, help="join this memory cgroup first, then drop the model from the page cache")
    p.add_argument("--pristine", action="store_true", help="LLAMA_CPP_LIB_PATH is the unpatched pin: no onebit call")
    p.add_argument(
        "--drive-stats",
        type=arg_type(_drive_stats),
        metavar="PID:FILE",
        help="the model is on an emulated drive: take its emulator's counters around the decode",
    )
    return p


def _run(args: argparse.Namespace) -> int:
    require_file(args.model)
    if args.detect:
        print(json.dumps(detect_eviction(args.model)))
        return EXIT_OK
    opts = WorkerOptions(
        model=args.model,
        env=args.env,
        prompt=args.prompt,
        generate=args.generate,
        threads=args.threads,
        text_file=args.text_file,
        cold_method=args.cold_method,
        cgroup=args.cgroup,
        extra_bufts=not args.no_extra_bufts,
        pristine=args.pristine,
        drive_stats=args.drive_stats,
        prefill=args.prefill,
        ubatch=args.ubatch,
    )
    print(json.dumps(probe_memory(opts) if args.memory_probe else run_worker(opts)))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run one worker; return the exit code."""
    return run_command(PROG, _parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
