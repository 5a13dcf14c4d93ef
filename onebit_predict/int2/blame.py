"""Where a 2-bit model's KL divergence against F16 lives, layer by layer (``onebit-int2 blame``).

What it is for: before fitting a compensator to the KL, find which layers carry it and why. For
one row (a variant, with its compensator or not) on held-out windows of the corpus's validation
split (capture.py's text: evenly spaced 256-token windows, every row scored):

- **KL removed per layer**: the row run again with layer l's MoE output replaced, in llama.cpp's
  graph, by the full-precision experts' output on that run's own input and routing (numpy,
  moe_numpy.py; written in by the capture's ``replace`` hook, capture.py). The KL that removes is
  the share of the row's KL that layer l's own 2-bit error causes, the layers after it included.
  Every layer replaced at once is the method's control: it must come back to about F16's logits
  (numpy's float32 experts against llama.cpp's F16 ones: about 1e-6 nats), or the replacement did
  not reach the graph.
- **Routing flips per layer**: the share of tokens whose top-k expert set at layer l differs from
  the F16 model's (both runs teacher-forced on the same tokens), and the mean KL of the tokens
  whose routing flipped there against those whose routing did not.
- **Residual energy, held-out against in-sample**: per layer, ``||moe_f16(x) - y||^2 /
  ||moe_f16(x)||^2`` over the captured rows, on the held-out windows and on as many training
  windows: with a compensator, ``y`` is its corrected output, so a fit that learned its training
  text shows a larger held-out figure.

KL is KL(F16 || row) per token in nats, from both runs' log-probabilities in float64 (capture.py's
``logprobs``): every row of every window, so its mean is close to, not the same as,
llama-perplexity's (quality.py scores the second half of each window, from a 16-bit base).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .capture import Capture, Capturer, LayerActivations, Replace, corpus_streams, reference_output, windows
from .moe_numpy import MoeModel, load_moe

HELDOUT_WINDOWS = 128  # 32,768 held-out tokens
TRAIN_WINDOWS = 32  # training windows for the in-sample residual energy
CONTROL_KL_MAX = 1e-4  # every layer replaced: at most this mean KL, or the replacement did not take


class BlameError(RuntimeError):
    """The method's control failed: a replaced layer did not change the graph's output."""


@dataclass(frozen=True)
class LayerBlame:
    """One layer's part in a row's KL."""

    layer: int
    kl_replaced: float  # the row's mean KL with this layer's MoE output replaced by F16's
    kl_removed: float  # the row's mean KL less kl_replaced
    share: float  # kl_removed / the row's mean KL
    flip: float  # share of tokens whose expert set at this layer is not F16's
    kl_flipped: float | None  # mean KL of those tokens (None: none flipped)
    kl_kept: float  # mean KL of the others
    energy_heldout: float  # ||moe_f16(x) - y||^2 / ||moe_f16(x)||^2, held-out rows
    energy_train: float  # the same on training rows


@dataclass(frozen=True)
class RowBlame:
    """A row's KL and its layers' parts."""

    variant: str
    compensator: str | None
    model: str
    tokens: int
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1: float  # share of tokens whose most likely next token is F16's
    kl_all_replaced: float  # the control: every layer's output replaced at once
    any_flip: float  # share of tokens whose routing flipped in some layer
    kl_any_flip_share: float  # the share of the row's summed KL those tokens carry
    layers: list[LayerBlame]
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "layers": [asdict(x) for x in self.layers]}


def token_kl(base: np.ndarray, other: np.ndarray) -> np.ndarray:
    """KL(base || other) per row of two (T, n_vocab) log-probability arrays."""
    return np.sum(np.exp(base) * (base - other), axis=1)


def full_precision(ref: MoeModel, layers: Sequence[int] | None) -> Replace:
    """A ``replace`` hook putting ``ref``'s MoE output (on the run's input and routing) in ``layers`` (None: all)."""

    def replace(layer: int, act: LayerActivations) -> np.ndarray | None:
        if layers is not None and layer not in layers:
            return None
        return reference_output(ref, layer, act)

    return replace


def _sets(experts: np.ndarray) -> np.ndarray:
    return np.sort(np.asarray(experts), axis=1)


class _Energy:
    """Per layer, ``||moe_f16(x) - y||^2`` and ``||moe_f16(x)||^2`` summed over the captures added."""

    def __init__(self, ref: MoeModel) -> None:
        self.ref = ref
        self.err: dict[int, float] = {}
        self.tot: dict[int, float] = {}

    def add(self, cap: Capture) -> None:
        for li, act in cap.layers.items():
            want = reference_output(self.ref, li, act).astype(np.float64)
            self.err[li] = self.err.get(li, 0.0) + float(np.sum((want - act.y) ** 2))
            self.tot[li] = self.tot.get(li, 0.0) + float(np.sum(want**2))

    def share(self) -> dict[int, float]:
        return {li: self.err[li] / max(self.tot[li], 1e-30) for li in self.err}


def blame(
    full: Path,
    quantized: Path,
    variant: str,
    compensator: Path | None = None,
    *,
    heldout_windows: int = HELDOUT_WINDOWS,
    train_windows: int = TRAIN_WINDOWS,
    threads: int = 1,
    log: Callable[[str], None] = lambda _: None,
) -> RowBlame:
    """The blame of one row (``quantized``, with ``compensator`` or not) against ``full``."""
    start = time.monotonic()
    ref = load_moe(full)
    n_layer = len(ref.layers)
    train, val = corpus_streams()
    held = windows(val, heldout_windows)
    kl_parts: list[np.ndarray] = []
    replaced_kl = np.zeros(n_layer)
    all_kl = 0.0
    top1 = 0
    flips: list[np.ndarray] = []  # per window: (T, n_layer) bool
    layer_ids = sorted(ref.layers)
    e_held, e_train = _Energy(ref), _Energy(ref)
    with Capturer(full, threads) as cap_full, Capturer(quantized, threads, compensator) as cap_q:
        per_layer = [Capturer(quantized, threads, compensator, full_precision(ref, [li])) for li in layer_ids]
        every = Capturer(quantized, threads, compensator, full_precision(ref, None))
        try:
            for i, w in enumerate(held):
                f_cap = cap_full.run([w])
                f_lp = cap_full.last_logprobs
                q_cap = cap_q.run([w])
                q_lp = cap_q.last_logprobs
                e_held.add(q_cap)
                kl = token_kl(f_lp, q_lp)
                kl_parts.append(kl)
                top1 += int(np.sum(f_lp.argmax(axis=1) == q_lp.argmax(axis=1)))
                flips.append(
                    np.stack(
                        [
                            np.any(_sets(f_cap.layers[li].experts) != _sets(q_cap.layers[li].experts), axis=1)
                            for li in layer_ids
                        ],
                        axis=1,
                    )
                )
                for j, c in enumerate(per_layer):
                    replaced_kl[j] += float(np.sum(token_kl(f_lp, c.logprobs(w))))
                all_kl += float(np.sum(token_kl(f_lp, every.logprobs(w))))
                if (i + 1) % 16 == 0:
                    log(f"blame {variant}: {i + 1} of {len(held)} held-out windows")
            if every.replaced != len(held) * n_layer or any(c.replaced != len(held) for c in per_layer):
                raise BlameError(f"{quantized}: a replacement was not written for every layer of every window")
        finally:
            for c in [*per_layer, every]:
                c.close()
        for w in windows(train, train_windows):
            e_train.add(cap_q.run([w]))
    kl_all = np.concatenate(kl_parts)
    flip = np.concatenate(flips)
    n = len(kl_all)
    mean = float(kl_all.mean())
    control = all_kl / n
    if control > CONTROL_KL_MAX or control > 0.1 * mean:
        raise BlameError(
            f"{quantized}: with every layer's MoE output replaced by F16's the KL is {control:.3g} nats "
            f"(the row's {mean:.3g}): the replacement did not reach the graph"
        )
    held_share, train_share = e_held.share(), e_train.share()
    layers = []
    for j, li in enumerate(layer_ids):
        sel = flip[:, j]
        kl_rep = replaced_kl[j] / n
        layers.append(
            LayerBlame(
                li,
                kl_rep,
                mean - kl_rep,
                (mean - kl_rep) / mean if mean > 0 else 0.0,
                float(sel.mean()),
                float(kl_all[sel].mean()) if sel.any() else None,
                float(kl_all[~sel].mean()) if (~sel).any() else 0.0,
                held_share[li],
                train_share[li],
            )
        )
    any_flip = flip.any(axis=1)
    total = float(kl_all.sum())
    return RowBlame(
        variant,
        str(compensator) if compensator else None,
        str(quantized),
        n,
        mean,
        float(np.percentile(kl_all, 99)),
        float(kl_all.max()),
        top1 / n,
        control,
        float(any_flip.mean()),
        float(kl_all[any_flip].sum() / total) if total > 0 else 0.0,
        layers,
        time.monotonic() - start,
    )
