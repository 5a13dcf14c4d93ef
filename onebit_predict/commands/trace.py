"""``onebit-trace MODEL.gguf --mode router|block|learned --out TRACE``: record a P/A trace (llama/record.py).

Runs a model on the patched llama.cpp with the predictor's environment set for that one
context: a prefill of the prompt, then ``--generate`` greedy tokens one at a time, and
writes the trace (docs/trace-format.md). ``--stats`` prints ``onebit-stats`` on it.

The predictor's knobs (``--depth``, ``--margin``, ``--min``, ``--ahead``, ``--layers``) are
read by the policy's own parser (policy.py, the twin of llama.cpp's), each alone as llama.cpp's
``--moe-predict-*`` flags read them: a value the policy would warn about and replace (``--ahead
4``, ``--depth abc``, ``--margin nan``) is a usage error with the policy's words, as it is for
llama.cpp's tools. The trace is written under a temporary name and renamed onto ``--out`` only
when the context has been freed and its header says it is whole (llama/record.py).

Exit codes: 0 ok, 1 no whole trace was written (none at all, an INCOMPLETE one, or one whose
header is still OPEN; nothing is left under ``--out``) or the consistency control of ``--stats``
failed, 2 usage or input error (a bad knob, a dense or malformed model, no patched build and a
model llama.cpp refuses included; commands/common.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from ..constants import (
    ENV_AHEAD,
    ENV_DEPTH,
    ENV_LAYERS,
    ENV_LEARNED,
    ENV_MARGIN,
    ENV_MIN,
    ENV_NO_ATTN,
    EXIT_OK,
    MAX_LAYERS,
)
from ..llama.record import PredictorKnobs, Prompt, RecordOptions, TraceNotWritten, record
from ..moe_check import require_moe_model
from ..policy import Env, parse_policy
from . import stats
from .common import EPILOG, CheckFailed, UsageError, model_parent, require_file, run_command

logger = logging.getLogger("onebit_predict")
PROG = "onebit-trace"
# the knobs read by the policy's parser: option (and args attribute) -> its field of policy.Env
KNOBS = {"depth": "depth", "margin": "margin", "min": "min", "ahead": "ahead", "layers": "layers"}
# dimensions no value can exceed, so that only a value's own problems are reported (the C API's
# onebit_moe_params_check, behind llama.cpp's --moe-predict-* flags, parses with the same; a depth
# above the model's n_expert is clamped with a warning naming it when the context is created)
_ANY_EXPERTS = 2**31 - 1


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__.splitlines()[0], epilog=EPILOG, parents=[model_parent(extra_bufts=True)]
    )
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


def knob_problem(option: str, value: str) -> str | None:
    """Why ``--OPTION VALUE`` is refused, or None: the policy's first warning for that knob alone.

    The same verdict and words as llama.cpp's ``--moe-predict-*`` flag (common/onebit-args.cpp):
    an empty value is refused, and a value the policy would warn about and replace by a default
    or clamp is refused with the warning up to its ``;`` (what the fallback would have done).
    """
    if not value:
        return f"invalid value for --{option}: ''"
    _, warnings = parse_policy(Env(**{KNOBS[option]: value}), MAX_LAYERS, _ANY_EXPERTS, _ANY_EXPERTS)
    if not warnings:
        return None
    why = warnings[0].split(";")[0].split("\n")[0]  # the warning without its fallback, as C++ cuts it
    return f"invalid value for --{option}: '{value}' ({why})"


def _check(args: argparse.Namespace) -> None:
    """UsageError on out-of-range numbers, knobs the policy would not take as given, and inputs
    that do not exist; ModelError (exit 2) for a model that is not MoE."""
    for option in KNOBS:
        value = getattr(args, option)
        problem = None if value is None else knob_problem(option, value)
        if problem is not None:
            raise UsageError(problem)
    for name in ("generate", "ctx", "ubatch", "threads"):
        if getattr(args, name) < (0 if name == "generate" else 1):
            raise UsageError(f"--{name} {getattr(args, name)} is out of range")
    if args.bytes and args.prompt is None and args.prompt_file is None:
        raise UsageError("--bytes needs --prompt or --prompt-file")
    for name in ("window", "prefill", "tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1")
    if args.out.is_dir():
        raise UsageError(f"--out {args.out} is a directory")
    require_file(args.model)
    require_moe_model(args.model)  # a dense model writes no trace; malformed MoE keys abort llama.cpp
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
        extra_bufts=not args.no_extra_bufts,
    )


def _run(args: argparse.Namespace) -> int:
    _check(args)
    try:
        n = record(options(args), _progress)
    except TraceNotWritten as e:
        raise CheckFailed(str(e)) from None
    logger.info("%d tokens, trace %s", n, args.out)
    if args.stats:
        return stats.main([str(args.out)])
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-trace``; return the exit code."""
    return run_command(PROG, _parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
