"""Bytes one expert occupies in each layer of a GGUF: what a streamed expert read costs.

For layer l, the routed experts' tensors are ``blk.l.ffn_gate_exps``, ``blk.l.ffn_up_exps``
(or the merged ``blk.l.ffn_gate_up_exps``) and ``blk.l.ffn_down_exps``, each with every
suffix the file has (``.weight``, and ``.bias`` or ``.scale`` where an architecture has
them). Each is one tensor holding all ``n_expert`` experts along its last axis, in one type,
so one expert's slice of it is ``nbytes / n_expert`` bytes, whatever the quantisation. The
expert's bytes are the sum over its tensors (read by onebit_predict/gguf_experts.py, the one
reader of a GGUF's experts). Shared experts (``*_shexp``), attention and the router are not
counted: the model keeps them resident (docs/cost-model.md).

``--expert-bytes`` replaces all this with one size for every layer.
"""

from __future__ import annotations

from pathlib import Path

from ..gguf_experts import EXPERT_TENSOR, ModelError, read_experts

__all__ = ["EXPERT_TENSOR", "ModelError", "expert_bytes_from_gguf", "mean_expert_bytes"]


def expert_bytes_from_gguf(path: str | Path) -> tuple[dict[int, int], int]:
    """``({layer: bytes of one expert}, n_expert)`` of a GGUF; ModelError when it has no experts."""
    experts = read_experts(path)
    return experts.expert_bytes(), experts.n_expert


def mean_expert_bytes(path: str | Path) -> float | None:
    """The mean bytes of one expert over a GGUF's MoE layers; None when the file is not here or not
    readable as an MoE model (a report's model, read where it was measured: the caller labels it by
    its name instead)."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        per_layer, _ = expert_bytes_from_gguf(path)
    except (ModelError, OSError, ValueError):
        return None
    return sum(per_layer.values()) / len(per_layer)
