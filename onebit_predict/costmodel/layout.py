"""Where the experts are in the file, in pages: the page model's view of a GGUF (costmodel/pages.py).

:class:`ExpertLayout` holds every layer's routed-expert tensors in the order the layer reads
them (``up``, ``gate``, ``down``: llama.cpp's build_moe_ffn, a merged ``gate_up`` first;
experts in ascending id, as ggml's mul_mat_id walks them), the dense tensors each layer reads
before its router and the output head, and turns them into page ranges. It comes from a GGUF
(:func:`layout_from_gguf`, read by onebit_predict/gguf_experts.py, the one reader of a GGUF's
experts) or from one expert size per layer (:func:`synthetic_layout`).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..gguf_experts import ExpertTensor, Span, read_experts

PAGE_SIZE = 4096
# the order in which a layer's routed-expert computation reads its tensors (llama.cpp
# build_moe_ffn: up, then gate, then down; a merged gate_up first)
ACCESS_ORDER = {"gate_up": 0, "up": 1, "gate": 2, "down": 3}


@dataclass(frozen=True)
class ExpertLayout:
    """Every layer's expert tensors in the order the layer reads them; the file's size."""

    file_bytes: int
    layers: dict[int, tuple[ExpertTensor, ...]]
    n_expert: int
    source: str  # "gguf PATH" or "synthetic"
    page_size: int = PAGE_SIZE
    # the dense tensors (attention, norms, router, shared experts) each layer reads before its
    # routed experts, and what a token reads after the last layer (output norm and head), as
    # byte ranges (offset, size); empty in a synthetic layout
    dense: dict[int, tuple[Span, ...]] = field(default_factory=dict)
    head: tuple[Span, ...] = ()

    @property
    def n_pages(self) -> int:
        return -(-self.file_bytes // self.page_size)

    def _slice_pages(self, t: ExpertTensor, expert: int) -> tuple[int, int]:
        """The page range ``[first, end)`` of one expert's slice of tensor ``t``."""
        a = t.offset + expert * t.slice_bytes
        return a // self.page_size, -(-(a + t.slice_bytes) // self.page_size)

    def expert_ranges(self, layer: int, expert: int) -> list[tuple[int, int]]:
        """The page ranges ``[first, end)`` of one expert's slices, in read order."""
        return [self._slice_pages(t, expert) for t in self.layers[layer]]

    def expert_pages(self, layer: int) -> int:
        """The pages one expert's page-rounded slices take in ``layer`` (expert 0's: all are the same size)."""
        return sum(end - first for first, end in self.expert_ranges(layer, 0))

    def demand_pages(self, layer: int, experts: Iterable[int]) -> list[int]:
        """The pages a layer touches for these experts: tensor by tensor, experts ascending, each page once."""
        seen: set[int] = set()
        out: list[int] = []
        for per in self.tensor_ranges(layer, experts):
            for _, first, end in per:
                for p in range(first, end):
                    if p not in seen:
                        seen.add(p)
                        out.append(p)
        return out

    def tensor_ranges(self, layer: int, experts: Iterable[int]) -> list[list[tuple[int, int, int]]]:
        """Per tensor of the layer, in the order it reads them, each expert's ``(expert, first, end)`` page
        range, experts ascending: what a matmul of ``--moe-prefetch-order hits`` orders (pages.py)."""
        ids = sorted(set(int(e) for e in experts if e >= 0))
        return [[(e, *self._slice_pages(t, e)) for e in ids] for t in self.layers[layer]]

    def dense_pages(self, layer: int | None) -> list[int]:
        """The dense pages a layer reads before its router (None: the output head's, after the last layer)."""
        ranges = self.head if layer is None else self.dense.get(layer, ())
        ps = self.page_size
        return list(dict.fromkeys(p for a, n in ranges for p in range(a // ps, -(-(a + n) // ps))))

    def is_expert_page(self) -> np.ndarray:
        """``(n_pages,)`` bool: the pages that hold routed-expert bytes (what ``--cold`` evicts)."""
        out = np.zeros(self.n_pages, dtype=bool)
        for ts in self.layers.values():
            for t in ts:
                a = t.offset
                out[a // self.page_size : -(-(a + t.slice_bytes * self.n_expert) // self.page_size)] = True
        return out

    def expert_bytes(self) -> dict[int, int]:
        return {layer: sum(t.slice_bytes for t in ts) for layer, ts in self.layers.items()}

    def smallest_slice(self) -> int:
        """The smallest expert slice of any tensor (the page model's page may be coarser above 512 KiB)."""
        return min(t.slice_bytes for ts in self.layers.values() for t in ts)

    def token_need_bytes(self, n_expert_used: int) -> int:
        """The mapped bytes one token reads, as the consumer's room rule counts them: every dense
        tensor (token_embd left out; none in a synthetic layout) and, of each layer's routed-expert
        tensors, n_expert_used / n_expert of their bytes."""
        if not 0 < n_expert_used <= self.n_expert:
            raise ValueError(f"n_expert_used must be in [1, {self.n_expert}], not {n_expert_used}")
        dense = sum(n for ranges in self.dense.values() for _, n in ranges) + sum(n for _, n in self.head)
        experts = sum(t.slice_bytes for ts in self.layers.values() for t in ts) * n_expert_used
        return dense + experts


def _read_order(t: ExpertTensor) -> tuple[int, str]:
    return ACCESS_ORDER[t.role], t.suffix


def layout_from_gguf(path: str | Path) -> tuple[ExpertLayout, int]:
    """The real layout of a GGUF's routed experts, and its expert count (ModelError if it has none)."""
    experts = read_experts(path)
    ordered = {layer: tuple(sorted(ts, key=_read_order)) for layer, ts in experts.layers.items()}
    layout = ExpertLayout(
        experts.file_bytes, ordered, experts.n_expert, f"gguf {path}", PAGE_SIZE, experts.dense, experts.head
    )
    return layout, experts.n_expert


def hits_first(ranges: Sequence[tuple[int, int, int]], cached: Container[int]) -> list[tuple[int, int, int]]:
    """One tensor's ``(expert, first, end)`` page ranges in the order a hits-first matmul takes them (patch
    0026): by the share of the slice's pages in ``cached`` when it starts (pages under I/O count, as mincore
    sees them), most first, so the wholly resident lead; ties by index."""

    def held(r: tuple[int, int, int]) -> float:
        return sum(1 for p in range(r[1], r[2]) if p in cached) / max(1, r[2] - r[1])

    return sorted(ranges, key=lambda r: (-held(r), r[0]))


def synthetic_layout(expert_bytes: dict[int, float], n_expert: int) -> ExpertLayout:
    """A GGUF-like layout from one size per layer: layer after layer, each ``down``, ``gate``, ``up``
    (the order llama.cpp's writer puts them in, by name), each ``n_expert`` slices of a third of
    an expert, contiguous from offset 0 (non-expert tensors, small, are left out)."""
    layers: dict[int, tuple[ExpertTensor, ...]] = {}
    offset = 0
    for layer in sorted(expert_bytes):
        size = int(round(expert_bytes[layer]))
        third = size // 3
        parts = {"down": size - 2 * third, "gate": third, "up": third}
        placed = []
        for role in ("down", "gate", "up"):
            name = f"blk.{layer}.ffn_{role}_exps.weight"
            nbytes = parts[role] * n_expert
            placed.append(ExpertTensor(name, layer, role, ".weight", offset, nbytes, n_expert, "synthetic", ()))
            offset += nbytes
        layers[layer] = tuple(sorted(placed, key=_read_order))
    return ExpertLayout(offset, layers, n_expert, "synthetic")
