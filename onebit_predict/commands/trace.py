"""``onebit-trace MODEL.gguf --mode router|block|learned --out TRACE``: record a P/A trace (llama/record.py).

Runs a model on the patched llama.cpp with the predictor's environment set for that one
context: a prefill of the prompt, then ``--generate`` greedy tokens one at a time, and
writes the trace (docs/trace-format.md). ``--stats`` prints ``onebit-stats`` on it.

Exit codes: 0 ok, 1 the consistency control of ``--stats`` failed, 2 usage or input error
(no patched build and a model llama.cpp refuses included; commands/common.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from ..constants import ENV_AHEAD, ENV_DEPTH, ENV_LAYERS, ENV_LEARNED, ENV_MARGIN, ENV_MIN, ENV_NO_ATTN, EXIT_OK
from ..llama.record import PredictorKnobs, Prompt, RecordOptions, record
from . import stats
from .common import EPILOG, UsageError, model_parent, require_file, run_command

logger = logging.getLogger("onebit_predict")
PROG = "onebit-trace"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], epilog=EPILOG, parents=[model_parent()])
    p.add_argument("--mode", required=True, choices=("off", "router", "block", "learned"))
    p.add_argument("--out", required=True, type=Path, help="the trace to write")
    p.add_argument("--depth", help=f"{ENV_DEPTH}")
    p.add_argument("--margin", help=f"{ENV_MARGIN}")
    p.add_argument("--min", help=f"{ENV_MIN}")
    p.add_argument("--layers", help=f"{ENV_LAYERS} (e.g. 1,2,5-9; the predictor's own grammar and warnings)")
    p.add_argument("--no-attn", action="store_true", help=f"{ENV_NO_ATTN}=1 (block without the mixer)")
    p.add_argument("--ahead", help=f"{ENV_AHEAD}: predict layer l+K from layer l, K = 1..3")
    p.add_argument("--learned", type=Path, help=f"{ENV_LEARNED}: the learned predictor's sidecar (--mode learned)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs a model with a tokenizer)")
    src.add_argument("--prompt-file", type=Path, help="read the prompt text from a file")
    src.add_argument("--tokens", type=int, help="N ids of the built-in token stream (models without a tokenizer)")
    p.add_argument(
        "--bytes",
        action="store_true",
        help="feed the prompt's UTF-8 bytes as token ids (byte-level models without a tokenizer)",
    )
    p.add_argument(
        "--prefill",
        type=int,
        help="prefill only the first N prompt tokens in one batch and decode the rest one by one "
        "(teacher-forced: every decode step routes real text); default: the whole prompt",
    )
    p.add_argument(
        "--window",
        type=int,
        help="cut the prompt into windows of N tokens, each run as a fresh sequence from pos 0 "
        "(the memory is cleared between windows; keeps positions inside a model's training context)",
    )
    p.add_argument("--generate", type=int, default=32, help="greedy tokens decoded one by one after the prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in token stream")
    p.add_argument("--ctx", type=int, default=512, help="context size")
    p.add_argument("--ubatch", type=int, default=64, help="ubatch size of the prefill")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stats", action="store_true", help="print the hit-rate table of the trace at the end")
    return p


def _check(args: argparse.Namespace) -> None:
    """UsageError on out-of-range numbers and inputs that do not exist."""
    for name in ("generate", "ctx", "ubatch", "threads"):
        if getattr(args, name) < (0 if name == "generate" else 1):
            raise UsageError(f"--{name} {getattr(args, name)} is out of range")
    if args.bytes and args.prompt is None and args.prompt_file is None:
        raise UsageError("--bytes needs --prompt or --prompt-file")
    for name in ("window", "prefill", "tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1")
    require_file(args.model)
    if args.prompt_file:
        require_file(args.prompt_file)
    if (args.mode == "learned") != (args.learned is not None):
        raise UsageError("--mode learned and --learned SIDECAR go together")
    if args.learned is not None:
        require_file(args.learned)


def _progress(done: int, total: int) -> None:
    sys.stderr.write(f"\r{PROG}: decode {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def options(args: argparse.Namespace) -> RecordOptions:
    """The run the command line asks for."""
    text = args.prompt_file.read_text() if args.prompt_file else args.prompt
    learned = str(args.learned) if args.learned is not None else None
    knobs = PredictorKnobs(args.mode, args.depth, args.margin, args.min, args.layers, args.no_attn, args.ahead, learned)
    return RecordOptions(
        model=args.model,
        out=args.out,
        knobs=knobs,
        prompt=Prompt(text=text, tokens=args.tokens, as_bytes=args.bytes, seed=args.seed),
        prefill=args.prefill,
        window=args.window,
        generate=args.generate,
        ctx=args.ctx,
        ubatch=args.ubatch,
        threads=args.threads,
    )


def _run(args: argparse.Namespace) -> int:
    _check(args)
    n = record(options(args), _progress)
    logger.info("%d tokens, trace %s", n, args.out)
    if args.stats:
        return stats.main([str(args.out)])
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-trace``; return the exit code."""
    return run_command(PROG, _parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
