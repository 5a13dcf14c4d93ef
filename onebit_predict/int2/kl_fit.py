"""The compensator fitted to what KL measures: every layer's map at once, against F16's logits (torch).

What it is for. The least-squares fit (compensator.py) makes each layer's MoE output close to
F16's in the plain norm; KL weighs directions by how much the logits care about them. This module
starts from a least-squares sidecar and fits all its layers together, by gradient descent on

    mean over training tokens of KL(F16 || the 2-bit model with the compensator)

with F16's log-probabilities from llama.cpp itself (capture.py's ``logprobs``: the target is what
the user's F16 model computes) and the 2-bit model in a torch forward pass of its own GGUF
(:class:`TorchQwen3Moe`: qwen3moe only, the 2-bit study's architecture; its experts dequantized
by gguf-py, as moe_numpy.py reads them). The map keeps the sidecar's form and rank, ``y + up (down
s)``, and the result is written as a sidecar of the same format: the runtime is still patch 0023,
only the numbers change. Routing is the model's own in the forward pass (top-k of the router's
softmax), so a map that flips a choice pays for it in the loss.

The best of the steps on held-out windows (the validation split; the fit never reads them
otherwise) is kept, so the fit cannot end worse than it started on that measure.

torch is the optional ``fit`` extra (``pip install -e .[fit]``); without it :func:`require_torch`
raises KlFitError naming the extra.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from ..sidecar import open_gguf
from .capture import Capturer, corpus_streams, windows
from .compensator import SOURCE_INPUT, Compensator, CompensatorLayer, check_model, read_compensator
from .moe_numpy import WEIGHT_SUM_MIN, _float32

logger = logging.getLogger("onebit_predict")

EXTRA = "fit"  # pyproject.toml's optional dependency group with torch
TRAIN_WINDOWS = 256  # 65,536 training tokens: 64 overfit by step 25 (docs/int2.md, both runs measured)
HELDOUT_WINDOWS = 16  # held-out windows that choose the step kept
STEPS = 150  # 256 windows: the held-out KL was lowest at step 125
BATCH = 8  # windows per step
LR = 1e-4  # 3e-4 raised the held-out KL within 25 steps
EVAL_EVERY = 25


class KlFitError(ValueError):
    """The fit cannot run: torch absent, a model this forward pass does not compute, a bad sidecar."""


def require_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise KlFitError(f"fitting to the KL needs torch: pip install -e .[{EXTRA}]") from None
    return torch


@dataclass(frozen=True)
class Hparams:
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_expert: int
    n_expert_used: int
    rope_base: float
    eps: float


def _hparams(reader: Any, path: Path) -> Hparams:
    f = reader.fields
    arch = str(f["general.architecture"].contents()) if "general.architecture" in f else "?"
    if arch != "qwen3moe":
        raise KlFitError(f"{path}: architecture {arch!r}: the KL fit's forward pass computes qwen3moe only")

    def key(k: str) -> Any:
        if f"{arch}.{k}" not in f:
            raise KlFitError(f"{path}: has no key {arch}.{k}")
        return f[f"{arch}.{k}"].contents()

    return Hparams(
        int(key("block_count")), int(key("embedding_length")), int(key("attention.head_count")),
        int(key("attention.head_count_kv")), int(key("attention.key_length")), int(key("expert_count")),
        int(key("expert_used_count")), float(key("rope.freq_base")), float(key("attention.layer_norm_rms_epsilon")),
    )  # fmt: skip


class TorchQwen3Moe:
    """A qwen3moe GGUF as float32 torch tensors, and its forward pass as llama.cpp's graph computes it
    (RMSNorm, per-head q/k norms, NEOX RoPE, grouped-query causal attention, softmax top-k routing
    with renormalised weights, SiLU-gated experts), with an optional output-source compensator."""

    def __init__(self, path: Path) -> None:
        torch = require_torch()
        self.torch = torch
        reader = open_gguf(path, KlFitError)
        self.hp = _hparams(reader, path)
        # copies: gguf-py maps the file read-only, and torch wants writable arrays
        self.w = {t.name: torch.from_numpy(np.array(_float32(t), np.float32)) for t in reader.tensors}
        hd = self.hp.head_dim
        inv = 1.0 / (self.hp.rope_base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        self.inv_freq = inv

    def _rope(self, x: Any, pos: Any) -> Any:
        """NEOX RoPE of ``x`` (B, T, heads, hd): the two halves of each head rotate together."""
        torch = self.torch
        ang = pos[:, None].double() * self.inv_freq[None, :]  # (T, hd/2)
        cos, sin = torch.cos(ang).float()[:, None, :], torch.sin(ang).float()[:, None, :]  # (T, 1, hd/2): per head
        half = x.shape[-1] // 2
        a, b = x[..., :half], x[..., half:]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

    def _norm(self, x: Any, w: Any) -> Any:
        return x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.hp.eps) * w

    def logits(self, tokens: Any, comp: Sequence[tuple[Any, Any]] | None = None) -> Any:
        """Logits (B, T, n_vocab) of token windows (B, T), every window from position 0; ``comp``:
        per layer (down (r, n_embd), up (n_embd, r)), the correction ``y + up (down y)``."""
        torch, hp, w = self.torch, self.hp, self.w
        b, t = tokens.shape
        pos = torch.arange(t)
        mask = torch.full((t, t), float("-inf")).triu(1)
        h = w["token_embd.weight"][tokens]
        for li in range(hp.n_layer):
            p = f"blk.{li}."
            x = self._norm(h, w[p + "attn_norm.weight"])
            q = (x @ w[p + "attn_q.weight"].T).view(b, t, hp.n_head, hp.head_dim)
            k = (x @ w[p + "attn_k.weight"].T).view(b, t, hp.n_head_kv, hp.head_dim)
            v = (x @ w[p + "attn_v.weight"].T).view(b, t, hp.n_head_kv, hp.head_dim)
            q = self._rope(self._norm(q, w[p + "attn_q_norm.weight"]), pos).transpose(1, 2)
            k = self._rope(self._norm(k, w[p + "attn_k_norm.weight"]), pos).transpose(1, 2)
            v = v.transpose(1, 2)
            rep = hp.n_head // hp.n_head_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            att = (q @ k.transpose(-1, -2)) / hp.head_dim**0.5 + mask
            o = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, hp.n_head * hp.head_dim)
            h = h + o @ w[p + "attn_output.weight"].T
            x = self._norm(h, w[p + "ffn_norm.weight"])
            y = self._moe(li, x)
            if comp is not None:
                down, up = comp[li]
                y = y + (y @ down.T) @ up.T
            h = h + y
        return self._norm(h, w["output_norm.weight"]) @ w["output.weight"].T

    def _moe(self, li: int, x: Any) -> Any:
        torch, hp, w = self.torch, self.hp, self.w
        p = f"blk.{li}."
        flat = x.reshape(-1, hp.n_embd)
        probs = (flat @ w[p + "ffn_gate_inp.weight"].T).softmax(-1)
        weights, experts = probs.topk(hp.n_expert_used, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(WEIGHT_SUM_MIN)
        out = torch.zeros_like(flat)
        gate, up, down = w[p + "ffn_gate_exps.weight"], w[p + "ffn_up_exps.weight"], w[p + "ffn_down_exps.weight"]
        for e in range(hp.n_expert):
            rows, slot = (experts == e).nonzero(as_tuple=True)
            if not len(rows):
                continue
            xs = flat[rows]
            hid = torch.nn.functional.silu(xs @ gate[e].T) * (xs @ up[e].T)
            out = out.index_add(0, rows, weights[rows, slot][:, None] * (hid @ down[e].T))
        return out.view_as(x)


@dataclass(frozen=True)
class FitStep:
    step: int
    train_kl: float  # the step's batch, before the update
    heldout_kl: float | None  # the forward pass's held-out KL after EVAL_EVERY steps


@dataclass(frozen=True)
class KlFit:
    """What :func:`fit` made: the sidecar, the steps, the held-out KL at the start and of the step kept."""

    compensator: Compensator
    steps: list[FitStep]
    start_heldout_kl: float
    best_heldout_kl: float
    best_step: int
    seconds: float


def _targets(full: Path, sets: Sequence[Sequence[np.ndarray]], threads: int) -> list[np.ndarray]:
    """F16's log-probabilities (n, T, n_vocab) float32 of each set of windows, from llama.cpp (one load)."""
    with Capturer(full, threads) as cap:
        return [np.stack([cap.logprobs(w).astype(np.float32) for w in wins]) for wins in sets]


def fit(
    full: Path,
    quantized: Path,
    start: Path,
    *,
    train_windows: int = TRAIN_WINDOWS,
    heldout_windows: int = HELDOUT_WINDOWS,
    steps: int = STEPS,
    batch: int = BATCH,
    lr: float = LR,
    threads: int = 1,
    seed: int = 0,
    log: Callable[[str], None] = lambda _: None,
) -> KlFit:
    """Fit ``start`` (a least-squares sidecar of ``quantized``, output source) to the KL against ``full``."""
    torch = require_torch()
    began = time.monotonic()
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    comp = read_compensator(start)
    check_model(comp, quantized)
    if comp.source == SOURCE_INPUT:
        raise KlFitError(f"{start}: an input-source sidecar; the KL fit starts from an output-source one")
    model = TorchQwen3Moe(quantized)
    if sorted(comp.layers) != list(range(model.hp.n_layer)):
        raise KlFitError(f"{start}: maps layers {sorted(comp.layers)}, the model has {model.hp.n_layer}")
    train, val = corpus_streams()
    train_w, held_w = windows(train, train_windows), windows(val, heldout_windows)
    log(f"F16 targets: {len(train_w)} training and {len(held_w)} held-out windows through llama.cpp")
    tgt_train, tgt_held = (torch.from_numpy(t) for t in _targets(full, [train_w, held_w], threads))
    x_train = torch.from_numpy(np.stack(train_w).astype(np.int64))
    x_held = torch.from_numpy(np.stack(held_w).astype(np.int64))
    params = []
    for li in range(model.hp.n_layer):
        ly = comp.layers[li]
        params.append(
            (
                torch.tensor(ly.down, requires_grad=True),
                torch.tensor(ly.up, requires_grad=True),
            )
        )
    flat = [p for pair in params for p in pair]
    opt = torch.optim.Adam(flat, lr=lr)

    def kl(x: Any, target: Any) -> Any:
        lp = model.logits(x, params).log_softmax(-1)
        return (target.exp() * (target - lp)).sum(-1).mean()

    def heldout() -> float:
        with torch.no_grad():
            return float(sum(kl(x_held[i : i + batch], tgt_held[i : i + batch]) * len(x_held[i : i + batch])
                             for i in range(0, len(x_held), batch)) / len(x_held))  # fmt: skip

    first = best = heldout()
    best_step, best_params = 0, [p.detach().clone() for p in flat]
    log(f"held-out KL (torch) at the least-squares start: {first:.5f}")
    history = []
    order = torch.randperm(len(x_train))
    for step in range(1, steps + 1):
        at = ((step - 1) * batch) % len(x_train)
        if at < batch and step > 1:
            order = torch.randperm(len(x_train))
        idx = order[at : at + batch]
        loss = kl(x_train[idx], tgt_train[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        batch_kl, held = float(loss.detach()), None
        if step % EVAL_EVERY == 0 or step == steps:
            held = heldout()
            if held < best:
                best, best_step, best_params = held, step, [p.detach().clone() for p in flat]
            log(f"step {step}: batch KL {batch_kl:.5f}, held-out {held:.5f} (best {best:.5f} at {best_step})")
        history.append(FitStep(step, batch_kl, held))
    layers = {
        li: CompensatorLayer(
            down=np.ascontiguousarray(best_params[2 * li].numpy(), np.float32),
            up=np.ascontiguousarray(best_params[2 * li + 1].numpy(), np.float32),
        )
        for li in range(model.hp.n_layer)
    }
    fitted_on = f"{comp.fitted_on}; then KL against F16, {steps} steps of {batch} windows, kept step {best_step}"
    out = replace(comp, layers=layers, fitted_on=fitted_on)
    out.validate(str(start))
    return KlFit(out, history, first, best, best_step, time.monotonic() - began)
