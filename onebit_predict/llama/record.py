"""Record a P/A trace: a prefill and greedy decodes with the predictor on (``onebit-trace``).

The predictor's environment is set for the one context the run uses (llama/runner.py): a
prefill of the prompt (or of its first ``prefill`` tokens, the rest decoded one by one,
teacher-forced), then ``generate`` greedy tokens one at a time; with ``window``, the prompt
is cut into windows each run as a fresh sequence from position 0. The trace format is
docs/trace-format.md.

The trace is written under a temporary name next to ``out`` and renamed onto it only once
the context is freed and the file is whole (``trace_written.written_problem``): a run that fails,
is interrupted or writes an incomplete trace leaves no file, and no old one replaced, under
the final name.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import fsync_file, temp_name
from ..constants import (
    ENV_AHEAD,
    ENV_DEPTH,
    ENV_LAYERS,
    ENV_LEARNED,
    ENV_MARGIN,
    ENV_MIN,
    ENV_MODE,
    ENV_NO_ATTN,
    ENV_OUT,
    ENV_STATS,
)
from ..trace_written import written_problem
from .runner import Context, ContextSettings, Model, builtin_tokens

Progress = Callable[[int, int], None]  # (tokens decoded one by one so far, their total)
DEFAULT_PROMPT_TOKENS = 64  # the built-in stream's length when no prompt is given


class TraceNotWritten(RuntimeError):
    """The run ended but its trace is missing or not whole (``trace_written.written_problem``); nothing was
    left under the final name."""


@dataclass(frozen=True)
class PredictorKnobs:
    """The ONEBIT_MOE_PREDICT* values of the run, as strings (None: unset)."""

    mode: str
    depth: str | None = None
    margin: str | None = None
    min: str | None = None
    layers: str | None = None
    no_attn: bool = False
    ahead: str | None = None  # ONEBIT_MOE_PREDICT_AHEAD
    learned: str | None = None  # ONEBIT_MOE_PREDICT_LEARNED: the sidecar of --mode learned

    def env(self, out: Path) -> dict[str, str | None]:
        return {
            ENV_MODE: self.mode,
            ENV_DEPTH: self.depth,
            ENV_MARGIN: self.margin,
            ENV_MIN: self.min,
            ENV_LAYERS: self.layers,
            ENV_NO_ATTN: "1" if self.no_attn else None,
            ENV_AHEAD: self.ahead,
            ENV_LEARNED: self.learned,
            ENV_OUT: str(out),
            ENV_STATS: None,
        }


@dataclass(frozen=True)
class Prompt:
    """Where the prompt comes from: ``tokens`` ids of the built-in stream, or ``text``."""

    text: str | None = None
    tokens: int | None = None
    as_bytes: bool = False  # the text's UTF-8 bytes are the token ids (byte-level models)
    seed: int = 0  # of the built-in stream


@dataclass(frozen=True)
class RecordOptions:
    model: Path
    out: Path
    knobs: PredictorKnobs
    prompt: Prompt = Prompt()
    prefill: int | None = None  # prefill only the first N prompt tokens of each window
    window: int | None = None
    generate: int = 32
    ctx: int = 512
    ubatch: int = 64
    threads: int = 2
    extra_bufts: bool = True  # llama.cpp's extra buffer types (AMX, repacking); False: the plain CPU kernels


def prompt_tokens(prompt: Prompt, model: Model) -> list[int]:
    if prompt.tokens is not None:
        return builtin_tokens(prompt.tokens, model.n_vocab, prompt.seed)
    if prompt.text is None:
        return builtin_tokens(DEFAULT_PROMPT_TOKENS, model.n_vocab, prompt.seed)
    if prompt.as_bytes:
        if model.n_vocab < 256:
            raise ValueError(f"--bytes needs a vocabulary of at least 256 ids, the model has {model.n_vocab}")
        return list(prompt.text.encode("utf-8"))
    return model.tokenize(prompt.text)


def _run_window(
    ctx: Context, prompt: list[int], n_pre: int, generate: int, done: int, total: int, progress: Progress
) -> int:
    """Prefill n_pre tokens, decode the rest of the prompt one by one, then generate greedily."""
    rows = ctx.decode(prompt[:n_pre], list(range(n_pre)), [0] * n_pre, [i == n_pre - 1 for i in range(n_pre)])
    for pos in range(n_pre, len(prompt)):
        rows = ctx.decode([prompt[pos]], [pos], [0], [True])
        done += 1
        progress(done, total)
    token = int(np.argmax(np.frombuffer(rows[-1], dtype=np.float32)))
    for step in range(generate):
        rows = ctx.decode([token], [len(prompt) + step], [0], [True])
        token = int(np.argmax(np.frombuffer(rows[0], dtype=np.float32)))
        done += 1
        progress(done, total)
    return done


def record(opts: RecordOptions, progress: Progress = lambda done, total: None) -> int:
    """Run the prefill and the decodes with the trace switched on; return the tokens run.

    The trace goes to a temporary name and is renamed onto ``opts.out`` when it is whole.
    ValueError when the prompt does not fit (no tokens, longer than ``ctx``); TraceNotWritten
    when the trace is missing, incomplete or not closed cleanly (the temporary file removed).
    """
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    # not created here (atomic.atomic_path would): a file libllama never created is "no trace written"
    tmp = temp_name(opts.out)
    try:
        n = _record(opts, tmp, progress)
        problem = written_problem(tmp, opts.out)  # the context is freed: its header says whether it is whole
        if problem is not None:
            raise TraceNotWritten(problem)
        try:
            fsync_file(tmp)  # a full disk can still refuse the data here
        except OSError as e:
            raise TraceNotWritten(f"writing the trace failed: {opts.out}: {e}") from None
        os.replace(tmp, opts.out)
    finally:
        tmp.unlink(missing_ok=True)  # a failure of any kind (an interrupt too) leaves no half file
    return n


def _record(opts: RecordOptions, trace: Path, progress: Progress) -> int:
    """record(), the trace written to ``trace``."""
    with Model(opts.model, extra_bufts=opts.extra_bufts) as model:
        prompt = prompt_tokens(opts.prompt, model)
        if not prompt:
            raise ValueError("the prompt has no tokens")
        size = opts.window or len(prompt)
        windows = [prompt[i : i + size] for i in range(0, len(prompt), size)]
        n_longest = max(len(w) for w in windows) + opts.generate
        if n_longest > opts.ctx:
            raise ValueError(
                f"prompt or window ({n_longest - opts.generate}) + --generate ({opts.generate}) "
                f"exceeds --ctx {opts.ctx}"
            )
        settings = ContextSettings(
            n_ctx=opts.ctx, n_batch=max(len(w) for w in windows), n_ubatch=opts.ubatch, n_threads=opts.threads
        )
        pre = [len(w) if opts.prefill is None else min(opts.prefill, len(w)) for w in windows]
        total = sum(len(w) - p + opts.generate for w, p in zip(windows, pre))
        done = 0
        with Context(model, settings, opts.knobs.env(trace)) as ctx:
            for i, (window, n_pre) in enumerate(zip(windows, pre)):
                if i > 0:
                    ctx.clear_memory()
                done = _run_window(ctx, window, n_pre, opts.generate, done, total, progress)
        return len(prompt) + opts.generate * len(windows)
