"""The one reader of a GGUF's routed experts: where each expert tensor lies in the file and what one
expert of it weighs.

For layer l the routed experts' tensors are ``blk.l.ffn_gate_exps``, ``blk.l.ffn_up_exps`` (or the
merged ``blk.l.ffn_gate_up_exps``) and ``blk.l.ffn_down_exps``, each with every suffix the file has
(``.weight``, and ``.bias`` or ``.scale`` where an architecture has them). Each holds all
``n_expert`` experts along its last axis (ggml's order, ne0 first), in one type, so expert e's
slice of it is ``[offset + e * slice_bytes, + slice_bytes)`` with ``slice_bytes = nbytes /
n_expert``, whatever the quantisation. :func:`read_experts` returns them as a typed
:class:`GgufExperts`, with the byte ranges of the dense tensors each layer reads (attention,
norms, router, shared experts) and of the output head, which the page model needs too.

Its users: the expert model's bytes per expert (costmodel/expert_bytes.py), the page model's layout
(costmodel/layout.py), the eviction of the expert pages (llama/evict.py) and the grown models
(grow/grow.py). Whether the model is one llama.cpp loads, and one a trace can have come from,
is moe_check.py's (require_moe_model, require_trace_model); this reader only refuses what
it cannot lay out: a file that is not a GGUF, no routed-expert tensors, expert tensors that
disagree on the expert count or do not split into whole experts (:class:`ModelError`, exit 2).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(gate|up|gate_up|down)_exps(\..+)?$")
DENSE_TENSOR = re.compile(r"^blk\.(\d+)\.")  # a layer's tensor that is not a routed expert's
HEAD_TENSORS = ("output.", "output_norm.")  # read once per token after the last layer; token_embd: one row


class ModelError(ValueError):
    """The GGUF cannot be read, or has no routed-expert tensors it can lay out."""


@dataclass(frozen=True)
class ExpertTensor:
    """One routed-expert tensor: expert e's slice is ``[offset + e * slice_bytes, + slice_bytes)``."""

    name: str
    layer: int
    role: str  # gate, up, gate_up or down
    suffix: str  # ".weight", ".bias", ".scale" (or "" for a bare name)
    offset: int  # of its data in the file
    nbytes: int  # all its experts
    n_expert: int
    type_name: str  # ggml's type (F32, F16, Q4_K, ...)
    shape: tuple[int, ...]  # ggml's order: ne0 first, the experts last

    @property
    def slice_bytes(self) -> int:
        """The bytes of one expert."""
        return self.nbytes // self.n_expert


Span = tuple[int, int]  # (offset, size) in bytes


@dataclass(frozen=True)
class GgufExperts:
    """Every routed-expert tensor of a GGUF (file order), the dense tensors' byte ranges per layer
    and the output head's."""

    path: Path
    file_bytes: int
    n_expert: int
    tensors: tuple[ExpertTensor, ...]
    dense: dict[int, tuple[Span, ...]]  # per layer, ascending offsets
    head: tuple[Span, ...]  # output, output_norm

    @property
    def layers(self) -> dict[int, tuple[ExpertTensor, ...]]:
        """The expert tensors of each layer (ascending layers, file order within)."""
        out: dict[int, list[ExpertTensor]] = {}
        for t in self.tensors:
            out.setdefault(t.layer, []).append(t)
        return {layer: tuple(ts) for layer, ts in sorted(out.items())}

    def expert_bytes(self) -> dict[int, int]:
        """``{layer: bytes of one expert}``: the sum of its slices over the layer's expert tensors."""
        out: dict[int, int] = {}
        for t in self.tensors:
            out[t.layer] = out.get(t.layer, 0) + t.slice_bytes
        return dict(sorted(out.items()))

    def spans(self) -> list[Span]:
        """Every expert tensor's byte range, ascending."""
        return sorted((t.offset, t.nbytes) for t in self.tensors)


def _open(path: Path) -> Any:
    import gguf  # a dependency of the package; imported here to keep `import onebit_predict` light

    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError) as e:
        raise ModelError(f"{path}: cannot read it as a GGUF: {e}") from None


def read_experts(path: str | Path, reader: Any = None) -> GgufExperts:
    """The routed experts of the GGUF at ``path`` (``reader``: its gguf.GGUFReader, when open already)."""
    path = Path(path)
    reader = _open(path) if reader is None else reader
    found = []
    dense: dict[int, list[Span]] = {}
    head: list[Span] = []
    for t in reader.tensors:
        span = (int(t.data_offset), int(t.n_bytes))
        m = EXPERT_TENSOR.match(t.name)
        if m:
            found.append((t, m, tuple(int(x) for x in t.shape)))
        elif block := DENSE_TENSOR.match(t.name):
            dense.setdefault(int(block.group(1)), []).append(span)
        elif t.name.startswith(HEAD_TENSORS):
            head.append(span)
    if not found:
        raise ModelError(f"{path}: no routed-expert tensors (blk.N.ffn_*_exps): not a MoE model")
    # the experts' count: the last axis of the 3-D weights (scales and biases follow it)
    counts = {shape[-1] for _, _, shape in found if len(shape) >= 3} or {shape[-1] for _, _, shape in found}
    if len(counts) > 1:
        raise ModelError(f"{path}: expert tensors disagree on the number of experts ({sorted(counts)})")
    n_expert = counts.pop()
    tensors = []
    for t, m, shape in found:
        nbytes = int(t.n_bytes)
        if shape[-1] != n_expert:
            raise ModelError(f"{path}: {t.name} has shape {list(shape)}, not one slice per expert ({n_expert} experts)")
        if nbytes % n_expert:
            raise ModelError(f"{path}: {t.name} is {nbytes} bytes, not a multiple of its {n_expert} experts")
        layer, role, suffix = int(m.group(1)), m.group(2), m.group(3) or ""
        offset = int(t.data_offset)
        tensors.append(ExpertTensor(t.name, layer, role, suffix, offset, nbytes, n_expert, t.tensor_type.name, shape))
    return GgufExperts(
        path,
        os.path.getsize(path),
        n_expert,
        tuple(tensors),
        {layer: tuple(sorted(spans)) for layer, spans in sorted(dense.items())},
        tuple(sorted(head)),
    )
