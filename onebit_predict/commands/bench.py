"""``onebit-bench MODEL.gguf [--cold]``: what the predictor costs, side by side (checks/bench.py).

``--cold`` measures the prefetch consumer with the expert pages evicted before every token
(checks/bench_cold.py), ``--memory-limit`` each run confined to a memory cgroup
(checks/bench_memory.py). Each configuration runs in a worker process of its own
(commands/bench_worker.py, started by checks/rounds.py); this parser holds only the user's
options, and every one of them is checked before the build is looked for.

What a run changes on the machine (read_ahead_kb, memory cgroups, temporary directories, the emulated
drive's mounts) is recorded before it is changed (llama/run_state.py), and every run first puts back
what a run killed by SIGKILL left, one line on stderr each; ``--restore`` does only that.

Exit codes: 0 ok, 1 a run failed (``--restore``: something could not be put back), 2 usage or input
error, 130 interrupted (commands/common.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

from ..checks.bench import configs, markdown, measure, require_compensator
from ..checks.bench_cold import cold_configs, detect_eviction, markdown_cold, measure_cold
from ..checks.bench_memory import SCRATCH_PREFIX, drive_value, require_drives, require_learned, rows_value
from ..checks.memory_limits import limit_bytes, limit_text
from ..checks.rounds import BenchOptions
from ..constants import EXIT_CHECK_FAILED, EXIT_OK, PREFILL_UBATCH_DEFAULT
from ..llama import run_state
from ..llama.paths import build_info, pristine_lib_dir
from ..llama.read_ahead import DriveSetting, read_ahead_value
from ..moe_check import require_moe_model
from .common import (
    EPILOG,
    UsageError,
    arg_type,
    layer_list,
    model_parent,
    output_parent,
    positive_int,
    require_file,
    run_command,
    unique_list,
)

logger = logging.getLogger("onebit_predict")
PROG = "onebit-bench"
READ_AHEAD = "--memory-limit: run every configuration at each read_ahead_kb (128,8192) of the model's drive (root)"
DRIVE = (
    "--memory-limit: run every configuration on each drive: native (where the model is), emulated "
    "nvme|nvme-1m|nvme-3g|sata"
)
COMPENSATOR = "a compensator sidecar: warm, one more row with it; --memory-limit: every row with it"
ROWS = "--memory-limit: the configurations, a set (default, drives) or names separated by ';' (default: default)"
PROMPT_TOKENS = "--memory-limit: also time a prompt of each length (512,2048), each in runs of its own"
UBATCH = f"--prompt-tokens: in ubatches of each size (128,512; n_batch = n_ubatch; default {PREFILL_UBATCH_DEFAULT})"
RESTORE = "put back what runs killed by SIGKILL left (read_ahead_kb, cgroups, temporary directories, mounts), and stop"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        parents=[model_parent(optional=True, extra_bufts=True), output_parent(csv=False)],
    )
    p.add_argument("--restore", action="store_true", help=RESTORE)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (odd, for a clean median)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--generate", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", type=_layers_text, default="1-2", help="the _LAYERS subset of the last configuration")
    p.add_argument(
        "--text-file",
        type=Path,
        help="feed this file's bytes as token ids (byte-level models) instead of the built-in stream",
    )
    p.add_argument(
        "--cold",
        action="store_true",
        help="evict the expert pages before every decoded token and compare the prefetch consumer's modes",
    )
    p.add_argument(
        "--memory-limit",
        type=arg_type(unique_list(limit_text)),
        metavar="LIMITS",
        help="confine each run to a memory cgroup of this size, a share of the model's expert bytes (50%%) "
        "or a size (160MiB), comma-separated; the kernel's reclaim evicts the experts (needs root)",
    )
    p.add_argument(
        "--evict-method",
        choices=("auto", "pageout", "dontneed"),
        default="auto",
        help="--cold: how to evict (auto: the first that works on this machine)",
    )
    p.add_argument("--read-ahead-kb", type=arg_type(unique_list(read_ahead_value)), metavar="KB", help=READ_AHEAD)
    p.add_argument(
        "--drive", type=arg_type(unique_list(drive_value)), metavar="DRIVES", help=DRIVE + "; default native"
    )
    p.add_argument("--rows", type=arg_type(rows_value), metavar="ROWS", help=ROWS)
    p.add_argument("--prompt-tokens", type=arg_type(unique_list(positive_int)), metavar="N", help=PROMPT_TOKENS)
    p.add_argument("--ubatch", type=arg_type(unique_list(positive_int)), metavar="U", help=UBATCH)
    p.add_argument(
        "--learned", type=Path, metavar="FILE", help="--memory-limit: the sidecar of the rows' learned predictor"
    )
    p.add_argument("--compensator", type=Path, metavar="FILE", help=COMPENSATOR)
    return p


def _options(args: argparse.Namespace) -> BenchOptions:
    """The run's options from the arguments, every one checked before the build is looked for
    (a usage error is exit 2 with its own message, never "run ./build.sh")."""
    if args.cold and args.memory_limit:
        raise UsageError("--cold and --memory-limit are two settings: give one")
    require_learned(args.rows, args.learned)
    require_compensator(args.compensator, args.cold)
    for flag, given in (("--read-ahead-kb", args.read_ahead_kb), ("--drive", args.drive), ("--rows", args.rows),
                        ("--learned", args.learned), ("--prompt-tokens", args.prompt_tokens),
                        ("--ubatch", args.ubatch)):  # fmt: skip
        if given and not args.memory_limit:
            raise UsageError(f"{flag} is a dimension of --memory-limit runs: give --memory-limit too")
    if args.ubatch and not args.prompt_tokens:
        raise UsageError("--ubatch is the prompt's ubatch: give --prompt-tokens too")
    if args.memory_limit and args.rounds % 2 == 0:
        raise UsageError(f"--memory-limit takes an odd --rounds (not {args.rounds}): each median a measured run")
    if args.rounds < 1 or args.prompt < 1 or args.generate < 1 or args.threads < 1:
        raise UsageError("--rounds, --prompt, --generate and --threads must be at least 1")
    if args.text_file and (not args.text_file.is_file() or args.text_file.stat().st_size < args.prompt + args.generate):
        raise UsageError(
            f"--text-file {args.text_file} must exist and hold at least --prompt + --generate "
            f"({args.prompt + args.generate}) bytes"
        )
    return BenchOptions(
        args.rounds, args.prompt, args.generate, args.threads, args.text_file, extra_bufts=not args.no_extra_bufts
    )


def _cold(args: argparse.Namespace, opts: BenchOptions, lib: Path) -> int:
    from ..llama.drive import measure_drive

    method, notes, expert_bytes = detect_eviction(args.model, lib)
    with run_state.scratch(args.model.resolve().parent, SCRATCH_PREFIX):  # its 256 MiB file, if this run is killed
        drive = measure_drive(args.model.resolve().parent)
    logger.info("drive under %s: %s", drive.directory, drive.words())
    for note in notes:
        logger.info("eviction %s", note)
    if args.evict_method != "auto":
        method = args.evict_method
    opts = replace(opts, cold_method=method)
    with run_state.temp_dir("onebit-bench-") as tmp:
        rows = measure_cold(args.model, cold_configs(tmp), lib, opts)
    if args.json:
        print(
            json.dumps(
                _run_json(args.model, opts, rows)
                | {
                    "cold": True,
                    "evict_method": method,
                    "eviction_notes": notes,
                    "expert_bytes": expert_bytes,
                    "drive": asdict(drive),
                },
                indent=2,
            )
        )
    else:
        print(
            markdown_cold(
                rows,
                f"model {args.model.name}, experts evicted before every token ({method}; "
                f"{expert_bytes / 2**20:.2f} MiB of expert weights), {opts.rounds} alternating "
                f"rounds, prompt {opts.prompt}, {opts.generate} decoded tokens, "
                f"{opts.threads} threads; drive {drive.words()}",
            )
        )
    return EXIT_OK


def _layers_text(text: str) -> str:
    """--layers: a layer list (common.layer_list's grammar), kept as the text ONEBIT_MOE_PREDICT_LAYERS takes."""
    layer_list(text)
    return text


def _memory_limits(
    model: Path, texts: list[str], kb: list[int] | None, drives: list[str] | None
) -> tuple[int, list[int], DriveSetting]:
    """(the model's expert bytes, --memory-limit's bytes, its drive and --read-ahead-kb): read from the GGUF
    and sysfs, no build needed, so that a bad limit, an unwritable read_ahead_kb or an emulated drive that
    cannot run here (no /dev/fuse, no libfuse3: the emulator built now) is exit 2 before the build."""
    from ..llama.evict import expert_spans

    expert_bytes = sum(s.size for s in expert_spans(model))
    limits = limit_bytes(texts, expert_bytes)
    require_drives(drives)
    return expert_bytes, limits, DriveSetting.of(model, kb if not drives or "native" in drives else None)


def _memory(
    args: argparse.Namespace, opts: BenchOptions, lib: Path, expert_bytes: int, limits: list[int], setting: DriveSetting
) -> int:
    from ..checks.bench_memory import markdown_memory, run_memory
    from ..checks.bench_prefill import markdown_prefill

    dims = (args.drive, args.read_ahead_kb, args.rows, args.learned, args.compensator, args.prompt_tokens, args.ubatch)
    rows, prefill, extra, words = run_memory(args.model, opts, lib, limits, setting, *dims, expert_bytes=expert_bytes)
    if args.json:
        print(json.dumps(_run_json(args.model, opts, rows) | {"expert_bytes": expert_bytes} | extra, indent=2))
        return EXIT_OK
    print(
        markdown_memory(
            rows,
            f"model {args.model.name} ({expert_bytes / 2**20:.0f} MiB of expert weights), each run in a memory "
            f"cgroup, {opts.rounds} alternating rounds, prompt {opts.prompt}, {opts.generate} decoded tokens, "
            f"{opts.threads} threads; {words}",
        )
        + ("\n\n" + markdown_prefill(prefill) if prefill else "")
    )
    return EXIT_OK


def _run_json(model: Path, opts: BenchOptions, rows: list) -> dict:
    """What both benchmarks' --json report: the model, the run's options, one object per row."""
    return {
        "model": str(model),
        "rounds": opts.rounds,
        "prompt": opts.prompt,
        "generate": opts.generate,
        "threads": opts.threads,
        "rows": [asdict(r) for r in rows],
    }


def _run(args: argparse.Namespace) -> int:
    # first of all, before any setting is read: what killed runs left (the next original must be the real one)
    left = run_state.recover()
    if args.restore:
        if args.model is not None:
            raise UsageError("--restore takes no MODEL.gguf: it puts back what killed runs left, and stops")
        return EXIT_CHECK_FAILED if left else EXIT_OK
    if args.model is None:
        raise UsageError("the following argument is required: MODEL.gguf (or --restore)")
    with run_state.journal(PROG):
        return _bench(args)


def _bench(args: argparse.Namespace) -> int:
    require_file(args.model)
    opts = _options(args)
    require_moe_model(args.model)
    memory = (
        _memory_limits(args.model, args.memory_limit, args.read_ahead_kb, args.drive) if args.memory_limit else None
    )
    info = build_info()  # every argument checked: only now is a missing build the error
    if args.cold:
        return _cold(args, opts, info.lib_dir)
    if memory is not None:
        return _memory(args, opts, info.lib_dir, *memory)
    pristine = pristine_lib_dir()
    with run_state.temp_dir("onebit-bench-") as tmp:
        cfgs = configs(tmp, args.layers, args.compensator)
        if pristine is None:
            logger.info("no unpatched build (run ./build.sh pristine); its row is left out")
            cfgs = [c for c in cfgs if not c.pristine]
        rows = measure(args.model, cfgs, info.lib_dir, pristine, opts)
    if args.json:
        print(json.dumps(_run_json(args.model, opts, rows), indent=2))
    else:
        print(
            markdown(
                rows,
                f"model {args.model.name}, {opts.rounds} alternating rounds, prompt {opts.prompt}, "
                f"{opts.generate} decoded tokens, {opts.threads} threads",
            )
        )
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-bench``; return the exit code."""
    return run_command(PROG, _parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
