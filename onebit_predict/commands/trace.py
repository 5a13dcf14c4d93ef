"""``onebit-trace MODEL.gguf --mode router|block --out TRACE``: record a P/A trace.

Runs a model on the patched llama.cpp with the predictor's environment set for that one
context: a prefill of the prompt, then ``--generate`` greedy tokens one at a time, and
writes the trace (docs/trace-format.md). ``--stats`` prints ``onebit-stats`` on it.

Exit codes: 0 ok, 1 the run failed, 2 usage or input error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from . import cli_stats
from .constants import (
    ENV_DEPTH,
    ENV_LAYERS,
    ENV_MARGIN,
    ENV_MIN,
    ENV_MODE,
    ENV_NO_ATTN,
    ENV_OUT,
    ENV_STATS,
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
)
from .paths import NotBuiltError
from .runner import Context, ContextSettings, Model, RunError, builtin_tokens


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onebit-trace", description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="the GGUF to run")
    p.add_argument("--mode", required=True, choices=("off", "router", "block"))
    p.add_argument("--out", required=True, type=Path, help="the trace to write")
    p.add_argument("--depth", help=f"{ENV_DEPTH}")
    p.add_argument("--margin", help=f"{ENV_MARGIN}")
    p.add_argument("--min", help=f"{ENV_MIN}")
    p.add_argument("--layers", help=f"{ENV_LAYERS} (e.g. 1,2,5-9)")
    p.add_argument("--no-attn", action="store_true", help=f"{ENV_NO_ATTN}=1 (block without the mixer)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs a model with a tokenizer)")
    src.add_argument("--prompt-file", type=Path, help="read the prompt text from a file")
    src.add_argument("--tokens", type=int, help="N ids of the built-in token stream (models without a tokenizer)")
    p.add_argument("--bytes", action="store_true",
                   help="feed the prompt's UTF-8 bytes as token ids (byte-level models without a tokenizer)")
    p.add_argument("--prefill", type=int,
                   help="prefill only the first N prompt tokens in one batch and decode the rest one by one "
                        "(teacher-forced: every decode step routes real text); default: the whole prompt")
    p.add_argument("--window", type=int,
                   help="cut the prompt into windows of N tokens, each run as a fresh sequence from pos 0 "
                        "(the memory is cleared between windows; keeps positions inside a model's training context)")
    p.add_argument("--generate", type=int, default=32, help="greedy tokens decoded one by one after the prompt")
    p.add_argument("--seed", type=int, default=0, help="seed of the built-in token stream")
    p.add_argument("--ctx", type=int, default=512, help="context size")
    p.add_argument("--ubatch", type=int, default=64, help="ubatch size of the prefill")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--stats", action="store_true", help="print the hit-rate table of the trace at the end")
    return p


def _prompt_tokens(args: argparse.Namespace, model: Model) -> list[int]:
    if args.tokens is not None:
        return builtin_tokens(args.tokens, model.n_vocab, args.seed)
    text = args.prompt_file.read_text() if args.prompt_file else args.prompt
    if text is None:
        return builtin_tokens(64, model.n_vocab, args.seed)
    if args.bytes:
        if model.n_vocab < 256:
            raise ValueError(f"--bytes needs a vocabulary of at least 256 ids, the model has {model.n_vocab}")
        return list(text.encode("utf-8"))
    return model.tokenize(text)


def _env(args: argparse.Namespace) -> dict[str, str | None]:
    return {
        ENV_MODE: args.mode,
        ENV_DEPTH: args.depth,
        ENV_MARGIN: args.margin,
        ENV_MIN: args.min,
        ENV_LAYERS: args.layers,
        ENV_NO_ATTN: "1" if args.no_attn else None,
        ENV_OUT: str(args.out),
        ENV_STATS: None,
    }


def _progress(done: int, total: int) -> None:
    sys.stderr.write(f"\ronebit-trace: decode {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def _run_window(ctx: Context, prompt: list[int], n_pre: int, generate: int, done: int, total: int) -> int:
    """Prefill n_pre tokens, decode the rest of the prompt one by one, then generate greedily."""
    rows = ctx.decode(prompt[:n_pre], list(range(n_pre)), [0] * n_pre, [i == n_pre - 1 for i in range(n_pre)])
    for pos in range(n_pre, len(prompt)):
        rows = ctx.decode([prompt[pos]], [pos], [0], [True])
        done += 1
        _progress(done, total)
    token = int(np.argmax(np.frombuffer(rows[-1], dtype=np.float32)))
    for step in range(generate):
        rows = ctx.decode([token], [len(prompt) + step], [0], [True])
        token = int(np.argmax(np.frombuffer(rows[0], dtype=np.float32)))
        done += 1
        _progress(done, total)
    return done


def record(args: argparse.Namespace) -> int:
    """Run the prefill and the decodes with the trace switched on; return the tokens run."""
    with Model(args.model) as model:
        prompt = _prompt_tokens(args, model)
        if not prompt:
            raise ValueError("the prompt has no tokens")
        size = args.window or len(prompt)
        windows = [prompt[i:i + size] for i in range(0, len(prompt), size)]
        n_longest = max(len(w) for w in windows) + args.generate
        if n_longest > args.ctx:
            raise ValueError(f"prompt or window ({n_longest - args.generate}) + --generate ({args.generate}) "
                             f"exceeds --ctx {args.ctx}")
        settings = ContextSettings(n_ctx=args.ctx, n_batch=max(len(w) for w in windows), n_ubatch=args.ubatch,
                                   n_threads=args.threads)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        pre = [len(w) if args.prefill is None else min(args.prefill, len(w)) for w in windows]
        total = sum(len(w) - p + args.generate for w, p in zip(windows, pre))
        done = 0
        with Context(model, settings, _env(args)) as ctx:
            for i, (window, n_pre) in enumerate(zip(windows, pre)):
                if i > 0:
                    ctx.clear_memory()
                done = _run_window(ctx, window, n_pre, args.generate, done, total)
        return len(prompt) + args.generate * len(windows)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for name in ("generate", "ctx", "ubatch", "threads"):
        if getattr(args, name) < (0 if name == "generate" else 1):
            print(f"onebit-trace: --{name} {getattr(args, name)} is out of range", file=sys.stderr)
            return EXIT_USAGE
    if args.bytes and args.prompt is None and args.prompt_file is None:
        print("onebit-trace: --bytes needs --prompt or --prompt-file", file=sys.stderr)
        return EXIT_USAGE
    if args.window is not None and args.window < 1:
        print("onebit-trace: --window must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    if args.prefill is not None and args.prefill < 1:
        print("onebit-trace: --prefill must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    if args.tokens is not None and args.tokens < 1:
        print("onebit-trace: --tokens must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    if not args.model.is_file():
        print(f"onebit-trace: {args.model}: no such file", file=sys.stderr)
        return EXIT_USAGE
    if args.prompt_file and not args.prompt_file.is_file():
        print(f"onebit-trace: {args.prompt_file}: no such file", file=sys.stderr)
        return EXIT_USAGE
    try:
        n = record(args)
    except ValueError as exc:
        print(f"onebit-trace: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (NotBuiltError, RunError) as exc:
        print(f"onebit-trace: {exc}", file=sys.stderr)
        return EXIT_CHECK_FAILED
    print(f"onebit-trace: {n} tokens, trace {args.out}", file=sys.stderr)
    if args.stats:
        return cli_stats.main([str(args.out)])
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
