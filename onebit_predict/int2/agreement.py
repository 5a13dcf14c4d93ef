"""Does a variant route and generate as the F16 model does? Routing agreement per layer, greedy divergence.

Both run in this process through the patched libllama (llama/runner.py), on a held-out text of
quality.py's (texts.corpus_text: the validation split, or ``--text outside``):

- **routing**: the text's whole 256-token windows, each prefilled as one batch (one ubatch: the
  trace's ``step`` is the window) in a fresh sequence, every row's logits asked for (so the last
  layer routes every row too: llama.cpp computes only output rows there), with the predictor in
  ``router`` mode writing a P/A trace (trace.py). Its records hold the experts each layer
  actually used for each token. Per layer: the fraction of tokens whose set of experts (the
  top-k, as a set) is F16's, and the mean overlap (shared experts / k). Teacher-forced: every
  model reads the same tokens, so a difference is the layer's own (and that of what the layers
  below it computed), not a different text.
- **greedy**: ``n_prompts`` prompts of ``prompt_tokens`` tokens taken at evenly spaced offsets of
  the held-out text; each model greedily generates ``generate`` tokens (argmax, prefill then one
  token at a time); per prompt, the first position where the variant's token differs from F16's
  (None: the same all the way). The mean counts "none" as ``generate``.

A compensator is passed as the runner passes every onebit knob (moe_api.py): the context's
``ONEBIT_MOE_COMPENSATOR`` setting, in a settings map that sets or clears every knob the runner
knows, so nothing is inherited from the caller's environment. A runner without that knob
(moe_api.FIELDS lacking it) is refused, not run without the compensator.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import ENV_COMPENSATOR, ENV_MODE, ENV_OUT
from ..llama.moe_api import FIELDS
from ..llama.runner import Context, ContextSettings, Model
from ..trace import Trace
from ..trace_written import written_problem
from .variants import COMPENSATOR_LOADED, CTX, Int2Error, Store

logger = logging.getLogger("onebit_predict")

N_PROMPTS = 8
PROMPT_TOKENS = 16
GENERATE = 64


def knobs(trace: Path | None = None, compensator: Path | None = None) -> dict[str, str | None]:
    """Every knob the runner passes, cleared; the router predictor writing ``trace``; the compensator."""
    env: dict[str, str | None] = dict.fromkeys(var for _, var in FIELDS)
    if trace is not None:
        env[ENV_MODE] = "router"
        env[ENV_OUT] = str(trace)
    if compensator is not None:
        if ENV_COMPENSATOR not in env:
            raise Int2Error(
                f"this runner has no {ENV_COMPENSATOR} knob (llama/moe_api.py FIELDS): "
                "a compensated row would run without its compensator"
            )
        if not compensator.is_file():
            raise Int2Error(f"{compensator}: no such file")
        env[ENV_COMPENSATOR] = str(compensator.resolve())
    return env


class _Tee(io.StringIO):
    """Keeps what is written and passes it on (libllama's log lines reach sys.stderr through the runner)."""

    def __init__(self, through: Any) -> None:
        super().__init__()
        self.through = through

    def write(self, text: str) -> int:
        self.through.write(text)
        return super().write(text)


def context(model: Model, settings: ContextSettings, env: Mapping[str, str | None]) -> Context:
    """A context with ``env``'s knobs; with a compensator, Int2Error unless libllama logged loading it."""
    comp = env.get(ENV_COMPENSATOR)
    with contextlib.redirect_stderr(_Tee(sys.stderr)) as log:
        ctx = Context(model, settings, env)
    if comp and COMPENSATOR_LOADED + comp not in log.getvalue():
        ctx.close()
        raise Int2Error(f"{model.path}: the context did not log {COMPENSATOR_LOADED}{comp}': the build ignores it")
    return ctx


def windows(tokens: Sequence[int], size: int = CTX) -> list[list[int]]:
    """The whole windows of ``size`` tokens (a shorter tail is left out)."""
    return [list(tokens[i : i + size]) for i in range(0, len(tokens) - size + 1, size)]


@dataclass(frozen=True)
class Routing:
    """The experts each (window, position, layer) used: rows sorted by that key."""

    keys: np.ndarray  # (n, 3) int64: window, pos, layer
    experts: np.ndarray  # (n, k) int32, each row sorted ascending (a set)


def routing(model: Path, wins: Sequence[Sequence[int]], threads: int = 1, compensator: Path | None = None) -> Routing:
    """Teacher-force every window through ``model`` with the router trace on; the experts used."""
    if not wins:
        raise Int2Error(f"no whole window of {CTX} tokens to route")
    n = len(wins[0])
    settings = ContextSettings(n_ctx=CTX, n_batch=n, n_ubatch=n, n_threads=threads)
    with tempfile.TemporaryDirectory(prefix="onebit-int2-") as tmp:
        path = Path(tmp) / "routing.bin"
        with Model(Path(model)) as m, context(m, settings, knobs(path, compensator)) as ctx:
            for i, w in enumerate(wins):
                if i:
                    ctx.clear_memory()
                ctx.decode(w, list(range(len(w))), [0] * len(w), [True] * len(w))
        problem = written_problem(path)
        if problem is not None:
            raise Int2Error(f"{model}: the routing trace was not written whole: {problem}")
        trace = Trace.open(path)
        rows = np.concatenate(list(trace.iter_chunks()) or [np.empty(0, trace.header.dtype)])
    steps = np.unique(rows["step"])
    if len(steps) != len(wins):
        raise Int2Error(f"{model}: the trace has {len(steps)} ubatches for {len(wins)} windows")
    keys = np.stack([rows["step"].astype(np.int64), rows["pos"].astype(np.int64), rows["layer"].astype(np.int64)], 1)
    order = np.lexsort((keys[:, 2], keys[:, 1], keys[:, 0]))
    return Routing(keys[order], np.sort(rows["actual_ids"][order], axis=1))


@dataclass(frozen=True)
class LayerAgreement:
    layer: int
    tokens: int
    set_equal: float  # fraction of tokens whose expert set is F16's
    overlap: float  # mean fraction of the k experts shared with F16's


def agreement(ref: Routing, other: Routing) -> list[LayerAgreement]:
    """Per layer, ``other`` against ``ref`` (the same tokens: the keys must be equal)."""
    if ref.keys.shape != other.keys.shape or not np.array_equal(ref.keys, other.keys):
        raise Int2Error("the two runs routed different (window, position, layer) rows")
    if ref.experts.shape != other.experts.shape:
        raise Int2Error(f"the runs used {ref.experts.shape[1]} and {other.experts.shape[1]} experts per token")
    k = ref.experts.shape[1]
    same = (ref.experts == other.experts).all(axis=1)
    shared = (ref.experts[:, :, None] == other.experts[:, None, :]).any(axis=2).sum(axis=1) / k
    out = []
    for layer in np.unique(ref.keys[:, 2]):
        sel = ref.keys[:, 2] == layer
        out.append(LayerAgreement(int(layer), int(sel.sum()), float(same[sel].mean()), float(shared[sel].mean())))
    return out


def prompts(tokens: Sequence[int], n: int = N_PROMPTS, length: int = PROMPT_TOKENS) -> list[tuple[int, list[int]]]:
    """(offset, tokens) of ``n`` prompts of ``length`` tokens at evenly spaced offsets."""
    if len(tokens) < n * length:
        raise Int2Error(f"{n} prompts of {length} tokens need {n * length} tokens, the text has {len(tokens)}")
    step = (len(tokens) - length) // max(n - 1, 1) if n > 1 else 0
    return [(i * step, list(tokens[i * step : i * step + length])) for i in range(n)]


def greedy(
    model: Path, prompt_list: Sequence[Sequence[int]], generate: int = GENERATE, threads: int = 1,
    compensator: Path | None = None,
) -> list[list[int]]:  # fmt: skip
    """Each prompt's ``generate`` greedy tokens (argmax of the logits), in a fresh sequence."""
    longest = max(len(p) for p in prompt_list)
    if longest + generate > CTX:
        raise Int2Error(f"a prompt of {longest} tokens + {generate} generated exceeds the context of {CTX}")
    settings = ContextSettings(n_ctx=CTX, n_batch=longest, n_ubatch=longest, n_threads=threads)
    out = []
    with Model(Path(model)) as m, context(m, settings, knobs(None, compensator)) as ctx:
        for p in prompt_list:
            ctx.clear_memory()
            rows = ctx.decode(list(p), list(range(len(p))), [0] * len(p), [False] * (len(p) - 1) + [True])
            tokens = [int(np.argmax(np.frombuffer(rows[-1], dtype=np.float32)))]
            for step in range(generate - 1):
                rows = ctx.decode([tokens[-1]], [len(p) + step], [0], [True])
                tokens.append(int(np.argmax(np.frombuffer(rows[0], dtype=np.float32))))
            out.append(tokens)
    return out


def first_divergence(ref: Sequence[int], other: Sequence[int]) -> int | None:
    """The first position where the two generations differ; None when they agree throughout."""
    for i, (a, b) in enumerate(zip(ref, other)):
        if a != b:
            return i
    return None if len(ref) == len(other) else min(len(ref), len(other))


def mean_divergence(firsts: Sequence[int | None], generate: int) -> float:
    """The mean first divergence, "none" counted as ``generate``."""
    return float(np.mean([generate if f is None else f for f in firsts]))


@dataclass(frozen=True)
class Agreement:
    """One variant (with a compensator or not) against F16."""

    variant: str
    compensator: Path | None
    model: Path
    layers: list[LayerAgreement]
    firsts: list[int | None]  # per prompt
    generate: int
    seconds: float

    def to_dict(self, prompt_list: Sequence[tuple[int, Sequence[int]]]) -> dict[str, Any]:
        return {
            "variant": self.variant,
            "compensator": str(self.compensator) if self.compensator else None,
            "model": str(self.model),
            "layers": [vars(x) for x in self.layers],
            "set_equal_mean": float(np.mean([x.set_equal for x in self.layers])),
            "overlap_mean": float(np.mean([x.overlap for x in self.layers])),
            "greedy": [
                {"prompt": i, "offset": off, "first_divergence": f}
                for i, ((off, _), f) in enumerate(zip(prompt_list, self.firsts))
            ],
            "greedy_mean_first_divergence": mean_divergence(self.firsts, self.generate),
            "seconds": round(self.seconds, 2),
        }


def compare(
    store: Store, tokens: Sequence[int], rows: Sequence[tuple[str, Path | None]], n_prompts: int = N_PROMPTS,
    prompt_tokens: int = PROMPT_TOKENS, generate: int = GENERATE,
) -> tuple[list[Agreement], list[tuple[int, list[int]]]]:  # fmt: skip
    """Each row (variant, compensator) against a run of the F16 source: (agreements, the prompts)."""
    wins = windows(tokens)
    plist = prompts(tokens, n_prompts, prompt_tokens)
    ref_routing = routing(store.source, wins, store.threads)
    ref_tokens = greedy(store.source, [p for _, p in plist], generate, store.threads)
    out = []
    for name, comp in rows:
        made = store.variant(name)
        start = time.monotonic()
        logger.info("routing and greedy generation: %s%s", name, f" + {comp.name}" if comp else "")
        layers = agreement(ref_routing, routing(made.path, wins, store.threads, comp))
        gen = greedy(made.path, [p for _, p in plist], generate, store.threads, comp)
        firsts = [first_divergence(a, b) for a, b in zip(ref_tokens, gen)]
        out.append(Agreement(name, comp, made.path, layers, firsts, generate, time.monotonic() - start))
    return out, plist
