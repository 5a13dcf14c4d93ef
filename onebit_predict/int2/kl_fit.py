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

A flip pays only through the logits, and a near tie at a router barely moves them. ``router_weight``
adds, per layer, KL(F16's router softmax || the 2-bit model's) to the loss, F16's from this forward
pass on the F16 GGUF itself: the fit then also pulls each layer's router input towards F16's, the
thing routing agreement (agreement.py) counts.

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
TRAIN_WINDOWS = 4096  # 1 Mi training tokens: 64, 256, 1024 and 4096 measured, each more held-out KL gone (docs/int2.md)
HELDOUT_WINDOWS = 16  # held-out windows that choose the step kept
STEPS = 2400  # about 4.7 passes over 4096 windows, as 150 steps over 256; the kept step was 2000
BATCH = 8  # windows per step
LR = 1e-4  # 3e-4 raised the held-out KL within 25 steps
EVAL_EVERY = 25
SETTINGS = (
    "train_windows",
    "steps",
    "batch",
    "lr",
    "router_weight",
    "expert_rank",
    "expert_lr",
)  # fit()'s knobs a report records
ROUTER_WEIGHT = 1.0  # the logits' KL alone lowered routing agreement below the least-squares start's (docs/int2.md)


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

    def logits(
        self,
        tokens: Any,
        comp: Sequence[tuple[Any, Any]] | None = None,
        routers: list[Any] | None = None,
        experts: Sequence[tuple[Any, Any]] | None = None,
        router_fix: Sequence[Any] | None = None,
        inputs: list[Any] | None = None,
    ) -> Any:
        """Logits (B, T, n_vocab) of token windows (B, T), every window from position 0; ``comp``:
        per layer (down (r, n_embd), up (n_embd, r)), the correction ``y + up (down y)``; ``routers``,
        if given, gets each layer's router log-softmax (B T, n_expert) appended; ``experts``: per layer
        (down (n_expert, r, n_embd), up (n_expert, n_embd, r)), each routed expert's own output
        ``q_e`` corrected to ``q_e + up_e (down_e q_e)`` before its gate weighs it (per_expert.py's form);
        ``router_fix``: per layer (n_expert, n_embd), added to the router's weight (scores ``(W + R) x``);
        ``inputs``, if given, gets each layer's MoE input x (B T, n_embd) appended (the routers' input)."""
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
            if inputs is not None:
                inputs.append(x.reshape(-1, hp.n_embd))
            fix = None if experts is None else experts[li]
            y = self._moe(li, x, routers, fix, None if router_fix is None else router_fix[li])
            if comp is not None:
                down, up = comp[li]
                y = y + (y @ down.T) @ up.T
            h = h + y
        return self._norm(h, w["output_norm.weight"]) @ w["output.weight"].T

    def _moe(
        self,
        li: int,
        x: Any,
        routers: list[Any] | None = None,
        fix: tuple[Any, Any] | None = None,
        router_fix: Any = None,
    ) -> Any:
        torch, hp, w = self.torch, self.hp, self.w
        p = f"blk.{li}."
        flat = x.reshape(-1, hp.n_embd)
        gate_inp = w[p + "ffn_gate_inp.weight"]
        scores = flat @ (gate_inp if router_fix is None else gate_inp + router_fix).T
        if routers is not None:
            routers.append(scores.log_softmax(-1))
        probs = scores.softmax(-1)
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
            q = hid @ down[e].T
            if fix is not None:
                q = q + (q @ fix[0][e].T) @ fix[1][e].T
            out = out.index_add(0, rows, weights[rows, slot][:, None] * q)
        return out.view_as(x)


@dataclass(frozen=True)
class FitStep:
    step: int
    train_kl: float  # the step's batch, before the update: the logits' KL
    train_router_kl: float | None  # the same batch's routers' KL, summed over layers (None: no router term)
    heldout_kl: float | None  # the forward pass's held-out KL after EVAL_EVERY steps
    heldout_router_kl: float | None  # the held-out routers' KL, then


@dataclass(frozen=True)
class KlFit:
    """What :func:`fit` made: the sidecar, the steps, the held-out KL at the start and of the step kept
    (the logits' KL; with a router weight the step kept is the one whose loss, both terms, was lowest)."""

    compensator: Compensator
    experts: dict[tuple[int, int], CompensatorLayer]  # (layer, expert) -> its map; empty without expert_rank
    steps: list[FitStep]
    start_heldout_kl: float
    start_heldout_router_kl: float
    best_heldout_kl: float
    best_step: int
    seconds: float


def _targets(full: Path, sets: Sequence[Sequence[np.ndarray]], threads: int) -> list[np.ndarray]:
    """F16's log-probabilities (n, T, n_vocab) float32 of each set of windows, from llama.cpp (one load)."""
    with Capturer(full, threads) as cap:
        return [np.stack([cap.logprobs(w).astype(np.float32) for w in wins]) for wins in sets]


def _router_targets(full: Path, tokens: Any, batch: int) -> Any:
    """F16's router log-softmax (n_layer, n, T, n_expert) of the windows ``tokens`` (n, T), from this
    forward pass on the F16 GGUF (no llama.cpp API hands out the routers' probabilities; this pass's
    F16 logits are llama.cpp's, tested)."""
    ref = TorchQwen3Moe(full)
    torch = ref.torch
    out: list[list[Any]] = [[] for _ in range(ref.hp.n_layer)]
    with torch.no_grad():
        for i in range(0, len(tokens), batch):
            got: list[Any] = []
            ref.logits(tokens[i : i + batch], None, got)
            for li, lp in enumerate(got):
                out[li].append(lp.view(len(tokens[i : i + batch]), tokens.shape[1], -1))
    return torch.stack([torch.cat(per, 0) for per in out])  # (n_layer, n, T, n_expert)


def _expert_params(torch: Any, hp: Hparams, rank: int) -> list[tuple[Any, Any]]:
    """Per layer, the experts' maps (down (n_expert, r, n_embd), up (n_expert, n_embd, r)) to fit: up at
    zero, so the fit starts where the sidecar alone is, and down random, so up's gradient is not zero."""
    return [
        (
            (torch.randn(hp.n_expert, rank, hp.n_embd) / hp.n_embd**0.5).requires_grad_(),
            torch.zeros(hp.n_expert, hp.n_embd, rank, requires_grad=True),
        )
        for _ in range(hp.n_layer)
    ]


def _expert_maps(flat: Sequence[Any], hp: Hparams) -> dict[tuple[int, int], CompensatorLayer]:
    """The fitted experts' maps, (layer, expert) -> map, from their tensors in :func:`_expert_params`' order."""
    out = {}
    for li in range(hp.n_layer):
        down, up = flat[2 * li].numpy(), flat[2 * li + 1].numpy()
        for e in range(hp.n_expert):
            out[(li, e)] = CompensatorLayer(
                np.ascontiguousarray(down[e], np.float32), np.ascontiguousarray(up[e], np.float32)
            )
    return out


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
    router_weight: float = ROUTER_WEIGHT,
    expert_rank: int = 0,
    expert_lr: float = LR,
    threads: int = 1,
    seed: int = 0,
    log: Callable[[str], None] = lambda _: None,
) -> KlFit:
    """Fit ``start`` (a least-squares sidecar of ``quantized``, output source) to the KL against ``full``,
    plus ``router_weight`` times the routers' KL summed over layers (0: the logits alone); with
    ``expert_rank`` r > 0, a rank-r map per (layer, expert) of the expert's own output is fitted with it
    (per_expert.py's form, output source), starting at zero, at its own learning rate ``expert_lr``."""
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
    log("F16 router targets through the forward pass on the F16 GGUF")  # held-out: reported whatever the weight
    r_held = _router_targets(full, x_held, batch)
    r_train = _router_targets(full, x_train, batch) if router_weight > 0 else None
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
    experts = _expert_params(torch, model.hp, expert_rank) if expert_rank > 0 else None
    mapped = [p for pair in experts or [] for p in pair]
    opt = torch.optim.Adam([{"params": flat, "lr": lr}] + ([{"params": mapped, "lr": expert_lr}] if mapped else []))
    flat = flat + mapped  # every fitted tensor: the kept step copies them all

    def losses(x: Any, target: Any, r_target: Any) -> tuple[Any, Any]:
        """The logits' KL and the routers' KL summed over layers (0 without router targets)."""
        got: list[Any] | None = [] if r_target is not None else None
        lp = model.logits(x, params, got, experts).log_softmax(-1)
        logits_kl = (target.exp() * (target - lp)).sum(-1).mean()
        if got is None:
            return logits_kl, torch.zeros(())
        router_kl = torch.zeros(())
        for li, lp_r in enumerate(got):
            ref = r_target[li].reshape(lp_r.shape)
            router_kl = router_kl + (ref.exp() * (ref - lp_r)).sum(-1).mean()
        return logits_kl, router_kl

    def part(r: Any, idx: Any) -> Any:
        return None if r is None else r[:, idx]

    def heldout() -> tuple[float, float]:
        """The held-out (logits KL, router KL), means over the windows."""
        total = np.zeros(2)
        with torch.no_grad():
            for i in range(0, len(x_held), batch):
                idx = torch.arange(i, min(i + batch, len(x_held)))
                a, b = losses(x_held[idx], tgt_held[idx], part(r_held, idx))
                total += np.array([float(a), float(b)]) * len(idx)
        return total[0] / len(x_held), total[1] / len(x_held)

    first, first_router = heldout()
    best_logits, best = first, first + router_weight * first_router
    best_step, best_params = 0, [p.detach().clone() for p in flat]
    log(f"held-out KL (torch) at the least-squares start: {first:.5f}, routers {first_router:.5f}")
    history = []
    order = torch.randperm(len(x_train))
    for step in range(1, steps + 1):
        at = ((step - 1) * batch) % len(x_train)
        if at < batch and step > 1:
            order = torch.randperm(len(x_train))
        idx = order[at : at + batch]
        logits_kl, router_kl = losses(x_train[idx], tgt_train[idx], part(r_train, idx))
        loss = logits_kl + router_weight * router_kl
        opt.zero_grad()
        loss.backward()
        opt.step()
        batch_kl, held, held_router = float(logits_kl.detach()), None, None
        if step % EVAL_EVERY == 0 or step == steps:
            held, held_router = heldout()
            if held + router_weight * held_router < best:
                best, best_logits, best_step = held + router_weight * held_router, held, step
                best_params = [p.detach().clone() for p in flat]
            log(f"step {step}: batch KL {batch_kl:.5f}, held-out {held:.5f}, routers {held_router:.5f} "
                f"(best {best_logits:.5f} at {best_step})")  # fmt: skip
        batch_router = float(router_kl.detach()) if r_train is not None else None
        history.append(FitStep(step, batch_kl, batch_router, held, held_router))
    layers = {
        li: CompensatorLayer(
            down=np.ascontiguousarray(best_params[2 * li].numpy(), np.float32),
            up=np.ascontiguousarray(best_params[2 * li + 1].numpy(), np.float32),
        )
        for li in range(model.hp.n_layer)
    }
    routers = f" + {router_weight:g} x the routers' KL" if router_weight > 0 else ""
    fitted_on = (f"{comp.fitted_on}; then KL against F16{routers}, {steps} steps of {batch} windows, "
                 f"kept step {best_step}")  # fmt: skip
    out = replace(comp, layers=layers, fitted_on=fitted_on)
    out.validate(str(start))
    per_expert = _expert_maps(best_params[2 * model.hp.n_layer :], model.hp) if experts is not None else {}
    return KlFit(out, per_expert, history, first, first_router, best_logits, best_step, time.monotonic() - began)
