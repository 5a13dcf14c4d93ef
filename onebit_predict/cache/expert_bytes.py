"""Bytes one expert occupies in each layer of a GGUF: what a streamed expert read costs.

For layer l, the routed experts' tensors are ``blk.l.ffn_gate_exps``, ``blk.l.ffn_up_exps``
(or the merged ``blk.l.ffn_gate_up_exps``) and ``blk.l.ffn_down_exps``, each with every
suffix the file has (``.weight``, and ``.bias`` or ``.scale`` where an architecture has
them). Each is one tensor holding all ``n_expert`` experts along its last axis (the 3-D
weights give ``n_expert``), in one type, so one expert's slice of it is
``nbytes / n_expert`` bytes, whatever the quantisation. The
expert's bytes are the sum over its tensors. Shared experts (``*_shexp``), attention and
the router are not counted: the model keeps them resident (docs/cost-model.md).

``--expert-bytes`` replaces all this with one size for every layer.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|gate_up|down)_exps(\..+)?$")


class ModelError(ValueError):
    """The GGUF cannot be read, or has no routed-expert tensors."""


def expert_bytes_from_gguf(path: str | Path) -> tuple[dict[int, int], int]:
    """``({layer: bytes of one expert}, n_expert)`` of a GGUF; ModelError when it has no experts."""
    import gguf  # a dependency of the package; imported here to keep `import onebit_predict` light

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot read it as a GGUF: {e}") from None
    found = [(t, m) for t in reader.tensors if (m := EXPERT_TENSOR.match(t.name))]
    # the experts' count: the last axis of the 3-D weights (scales and biases follow it)
    counts = {int(np.asarray(t.shape).tolist()[-1]) for t, _ in found if len(np.asarray(t.shape).tolist()) >= 3}
    if len(counts) > 1:
        raise ModelError(f"{path}: expert tensors disagree on the number of experts ({sorted(counts)})")
    n_expert = counts.pop() if counts else None
    per_layer: dict[int, int] = {}
    for t, m in found:
        shape = [int(x) for x in np.asarray(t.shape).tolist()]
        if n_expert is None or shape[-1] != n_expert:
            raise ModelError(f"{path}: {t.name} has shape {shape}, not one slice per expert ({n_expert} experts)")
        nbytes = int(t.n_bytes)
        if nbytes % n_expert:
            raise ModelError(f"{path}: {t.name} is {nbytes} bytes, not a multiple of its {n_expert} experts")
        layer = int(m.group(1))
        per_layer[layer] = per_layer.get(layer, 0) + nbytes // n_expert
    if not per_layer or n_expert is None:
        raise ModelError(
            f"{path}: no routed-expert tensors (blk.N.ffn_gate_exps / ffn_up_exps / ffn_down_exps): not a MoE model"
        )
    return per_layer, n_expert
