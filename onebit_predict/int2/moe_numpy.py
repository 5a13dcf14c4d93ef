"""A MoE block in numpy, from a GGUF's tensors: the reference the compensator is fitted against.

What it is for. The compensator's target is what the full-precision experts would have computed
on the 2-bit run's input (compensator.py). This module computes a MoE layer's output from a
model GGUF's own tensors, dequantized to float32 with ``gguf.quants.dequantize`` (any type
gguf-py reads: F16, Q2_K, IQ2_XXS, ...), as llama.cpp's ``build_moe_ffn`` does for the
architectures in :data:`GATING`:

    probs = softmax(W_router x)                     (ffn_gate_inp, numpy (n_expert, n_embd))
    top-k experts by probs, k = {arch}.expert_used_count; weights = their probs, divided by their
    sum where the architecture normalises them (qwen3moe always does; olmoe never)
    y = sum_e weight_e * down_e(SiLU(gate_e x) * up_e x)

(ffn_gate_exps, ffn_up_exps numpy (n_expert, n_ff, n_embd); ffn_down_exps (n_expert, n_embd, n_ff)).
:func:`moe_forward` takes the routing (experts, weights) from outside when given, e.g. llama.cpp's
own (``ffn_moe_topk``, ``ffn_moe_weights_norm``, captured by capture.py), so that a near-tie in the
router that float32 and llama.cpp resolve differently does not make the two outputs differ.
Arithmetic is float32 on float32 weights; llama.cpp rounds the activations to F16 (for F16
weights) or Q8_K (k-quants) before its matrix products, so it agrees to about 1e-3, not exactly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..sidecar import open_gguf

# architecture -> whether llama.cpp renormalises the top-k weights (softmax gating in both)
GATING: dict[str, bool] = {"qwen3moe": True, "olmoe": False}
_EXPERT_RE = re.compile(r"blk\.(0|[1-9][0-9]*)\.(ffn_gate_inp|ffn_gate_exps|ffn_up_exps|ffn_down_exps)\.weight")
WEIGHT_SUM_MIN = 6.103515625e-5  # llama.cpp clamps the weights' sum to the smallest normal F16


class MoeError(ValueError):
    """A GGUF whose MoE blocks this module cannot compute."""


@dataclass(frozen=True)
class MoeLayer:
    """One layer's router and experts, float32 (numpy shapes as the module docstring)."""

    router: np.ndarray
    gate: np.ndarray
    up: np.ndarray
    down: np.ndarray
    expert_type: str  # ggml type name of ffn_down_exps, for messages


@dataclass(frozen=True)
class MoeModel:
    """The MoE blocks of a model GGUF."""

    path: Path
    arch: str
    n_embd: int
    n_expert: int
    n_expert_used: int
    norm_topk: bool
    layers: Mapping[int, MoeLayer] = field(default_factory=dict)


def _float32(t) -> np.ndarray:
    """A gguf-py ReaderTensor as float32, numpy shape = ggml ne reversed."""
    import gguf
    from gguf import quants

    shape = tuple(int(n) for n in reversed(t.shape))
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return np.asarray(t.data, dtype=np.float32).reshape(shape)
    try:
        return np.asarray(quants.dequantize(np.asarray(t.data), t.tensor_type), dtype=np.float32).reshape(shape)
    except (NotImplementedError, ValueError, quants.QuantError) as e:
        raise MoeError(f"{t.name} is {t.tensor_type.name}, which gguf-py cannot dequantize ({e})") from e


def load_moe(path: str | Path) -> MoeModel:
    """Read every MoE layer of a model GGUF (float32 copies of its router and experts)."""
    path = Path(path)
    reader = open_gguf(path, MoeError)
    fields = reader.fields
    arch = str(fields["general.architecture"].contents()) if "general.architecture" in fields else "?"
    if arch not in GATING:
        raise MoeError(f"{path}: architecture {arch!r}: the numpy MoE block knows {', '.join(GATING)}")

    def key(k: str) -> int:
        if k not in fields:
            raise MoeError(f"{path}: has no key {k}")
        return int(fields[k].contents())

    n_embd, n_expert, k = key(f"{arch}.embedding_length"), key(f"{arch}.expert_count"), key(f"{arch}.expert_used_count")
    parts: dict[int, dict[str, object]] = {}
    for t in reader.tensors:
        m = _EXPERT_RE.fullmatch(t.name)
        if m is not None:
            parts.setdefault(int(m.group(1)), {})[m.group(2)] = t
    layers = {}
    for li, p in sorted(parts.items()):
        missing = {"ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"} - set(p)
        if missing:
            raise MoeError(f"{path}: layer {li} has no {', '.join(sorted(missing))}")
        layers[li] = MoeLayer(
            router=_float32(p["ffn_gate_inp"]),
            gate=_float32(p["ffn_gate_exps"]),
            up=_float32(p["ffn_up_exps"]),
            down=_float32(p["ffn_down_exps"]),
            expert_type=p["ffn_down_exps"].tensor_type.name,
        )
        if layers[li].router.shape != (n_expert, n_embd) or layers[li].down.shape[:2] != (n_expert, n_embd):
            raise MoeError(f"{path}: layer {li}'s router or experts do not have n_expert={n_expert}, n_embd={n_embd}")
    if not layers:
        raise MoeError(f"{path}: no MoE layer (blk.{{l}}.ffn_gate_inp.weight and the expert tensors)")
    return MoeModel(path, arch, n_embd, n_expert, k, GATING[arch], layers)


def route(model: MoeModel, layer: int, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(experts (N, k) int32 in descending probability, weights (N, k) float32) for inputs ``x`` (N, n_embd)."""
    logits = np.asarray(x, np.float32) @ model.layers[layer].router.T
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    experts = np.argsort(-probs, axis=1, kind="stable")[:, : model.n_expert_used].astype(np.int32)
    weights = np.take_along_axis(probs, experts, axis=1)
    if model.norm_topk:
        weights = weights / np.maximum(weights.sum(axis=1, keepdims=True), WEIGHT_SUM_MIN)
    return experts, weights.astype(np.float32)


def _silu(v: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return v / (1.0 + np.exp(-v))


def moe_forward(
    model: MoeModel,
    layer: int,
    x: np.ndarray,
    experts: np.ndarray | None = None,
    weights: np.ndarray | None = None,
) -> np.ndarray:
    """The layer's MoE output (N, n_embd) float32 for inputs ``x`` (N, n_embd): routed by its own
    router (:func:`route`) unless ``experts`` and ``weights`` (N, k) are given."""
    x = np.asarray(x, np.float32)
    if experts is None or weights is None:
        experts, weights = route(model, layer, x)
    experts = np.asarray(experts)
    weights = np.asarray(weights, np.float32)
    if x.ndim != 2 or x.shape[1] != model.n_embd or experts.shape != weights.shape or len(experts) != len(x):
        raise ValueError(f"moe_forward: x {x.shape}, experts {experts.shape}, weights {weights.shape} do not fit")
    ly = model.layers[layer]
    y = np.zeros_like(x)
    for e in range(model.n_expert):
        rows, slot = np.nonzero(experts == e)  # an expert is chosen at most once per token
        if len(rows) == 0:
            continue
        xs = x[rows]
        h = _silu(xs @ ly.gate[e].T) * (xs @ ly.up[e].T)
        y[rows] += weights[rows, slot][:, None] * (h @ ly.down[e].T)
    return y


def relative_error(a: np.ndarray, b: np.ndarray) -> float:
    """``||a - b|| / ||b||`` over all values (Frobenius)."""
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / max(np.linalg.norm(b), 1e-30))
