"""The one check every command that takes a model runs first: is it a MoE GGUF llama.cpp loads?

llama.cpp reads ``{arch}.expert_count`` and ``{arch}.expert_used_count`` with GGML_ASSERTs
(src/llama-model.cpp, ``load_hparams``): a value out of range aborts the process (rc 134)
instead of failing, and a dense model runs, writes no routing, and leaves a command to fail
later on a file that was never written. :func:`require_moe_model` reads the GGUF's header with
gguf-py's GGUFReader (no llama.cpp, no weights read) and raises :class:`ModelError` (exit 2)
naming the file and, where a key is wrong, the key and its value:

- a file that is not a readable GGUF;
- a dense model: no ``blk.N.ffn_gate_inp.weight`` (the router);
- ``{arch}.expert_count`` missing, not an integer, or outside 1..LLAMA_MAX_EXPERTS;
- ``{arch}.expert_used_count`` missing, not an integer, or outside 1..expert_count (an array,
  one value per layer, as llama.cpp also reads it: each within 0..expert_count, one > 0);
- ``{arch}.expert_group_count`` / ``expert_group_used_count`` that llama.cpp would assert on;
- a router or expert tensor whose expert axis is not expert_count, or a MoE layer at or beyond
  ``{arch}.block_count``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .gguf_experts import ModelError

# llama.cpp's src/llama-hparams.h at the pin (patches/PIN)
LLAMA_MAX_EXPERTS = 1024

ROUTER_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_gate_inp\.weight$")
EXPERT_TENSOR = re.compile(r"^blk\.(\d+)\.ffn_(?:gate|up|gate_up|down)_exps\.weight$")


@dataclass(frozen=True)
class MoeKeys:
    """The routing keys of a MoE GGUF, checked as llama.cpp needs them."""

    path: Path
    arch: str
    n_layer: int  # {arch}.block_count
    n_expert: int  # {arch}.expert_count
    n_expert_used: int  # {arch}.expert_used_count (its largest value where it is per layer)
    moe_layers: tuple[int, ...]  # the layers with a router (blk.N.ffn_gate_inp.weight), ascending


def _read(path: Path) -> Any:
    import gguf  # a dependency of the package; imported here to keep `import onebit_predict` light

    if not path.is_file():
        raise ModelError(f"{path}: no such file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - whatever a non-GGUF or truncated file makes the reader raise
        raise ModelError(f"{path}: cannot read it as a GGUF: {type(e).__name__}: {e}") from None


_INT_TYPES: frozenset[str] = frozenset({"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"})


def _int_or_ints(reader: Any, path: Path, key: str, *, array: bool) -> int | list[int] | None:
    field = reader.fields.get(key)
    if field is None:
        return None
    types = [t.name for t in field.types]
    value = field.contents()
    if array and len(types) == 2 and types[0] == "ARRAY" and types[1] in _INT_TYPES:
        return [int(v) for v in value]
    if len(types) != 1 or types[0] not in _INT_TYPES:
        raise ModelError(f"{path}: {key} = {value!r} is not an integer ({'/'.join(types)})")
    return int(value)


def _int_key(reader: Any, path: Path, key: str, *, required: bool = True) -> int | None:
    """An integer key's value; ModelError when it is not an integer, or absent and ``required``."""
    value = _int_or_ints(reader, path, key, array=False)
    if value is None and required:
        raise ModelError(f"{path}: has no key {key}")
    assert value is None or isinstance(value, int)
    return value


def _ints_key(reader: Any, path: Path, key: str) -> int | list[int]:
    """An integer key, or an integer array (one value per layer); ModelError when absent or neither."""
    value = _int_or_ints(reader, path, key, array=True)
    if value is None:
        raise ModelError(f"{path}: has no key {key}")
    return value


def _check_groups(reader: Any, path: Path, arch: str, n_expert: int) -> None:
    """``expert_group_count`` / ``expert_group_used_count``: llama.cpp's asserts on them, as errors."""
    groups_key, used_key = f"{arch}.expert_group_count", f"{arch}.expert_group_used_count"
    groups = _int_key(reader, path, groups_key, required=False)
    if groups is None:
        return
    if not 0 <= groups < n_expert:
        raise ModelError(
            f"{path}: {groups_key} = {groups} is out of range (0..{n_expert - 1}, below {arch}.expert_count)"
        )
    if groups > 1:
        if n_expert % groups:
            raise ModelError(f"{path}: {arch}.expert_count = {n_expert} is not a multiple of {groups_key} = {groups}")
        used = _int_key(reader, path, used_key)
        assert used is not None
        if not 0 < used < groups:
            raise ModelError(f"{path}: {used_key} = {used} is out of range (1..{groups - 1}, below {groups_key})")


def _check_tensors(reader: Any, path: Path, arch: str, n_layer: int, n_expert: int, moe_layers: list[int]) -> None:
    """Every router and expert weight has expert_count along its expert axis, in a layer that exists."""
    beyond = sorted({x for x in moe_layers if x >= n_layer})
    if beyond:
        raise ModelError(f"{path}: routers in layers {beyond}, beyond {arch}.block_count = {n_layer}")
    shapes = [(t.name, [int(x) for x in np.asarray(t.shape).tolist()]) for t in reader.tensors]
    # the routers first: their shape is what llama.cpp checks against expert_count when it loads
    for name, shape in shapes:
        # ggml order: ne0 = n_embd, ne1 = n_expert
        if ROUTER_TENSOR.match(name) and (len(shape) != 2 or shape[1] != n_expert):
            raise ModelError(
                f"{path}: {name} has shape {shape}, not [n_embd, {n_expert}] ({arch}.expert_count = {n_expert})"
            )
    with_experts: set[int] = set()
    for name, shape in shapes:
        if m := EXPERT_TENSOR.match(name):
            if len(shape) != 3 or shape[2] != n_expert:
                raise ModelError(
                    f"{path}: {name} has shape {shape}, not one slice per expert ({arch}.expert_count = {n_expert})"
                )
            with_experts.add(int(m.group(1)))
    bare = [x for x in moe_layers if x not in with_experts]
    if bare:
        raise ModelError(f"{path}: layers {bare} have a router (ffn_gate_inp) but no expert tensors (ffn_*_exps)")


def require_moe_model(path: str | Path) -> MoeKeys:
    """The MoE keys of the GGUF at ``path``; ModelError (exit 2) where llama.cpp would fail or abort on them."""
    path = Path(path)
    reader = _read(path)
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise ModelError(f"{path}: has no key general.architecture")
    arch = str(arch_field.contents())

    moe_layers = sorted(int(m.group(1)) for t in reader.tensors if (m := ROUTER_TENSOR.match(t.name)))
    if not moe_layers:
        raise ModelError(
            f"{path} has no routed experts (architecture {arch}, no ffn_gate_inp; no routed-expert tensors):"
            " not a MoE model"
        )

    n_layer_key = f"{arch}.block_count"
    n_layer = _int_key(reader, path, n_layer_key)
    assert n_layer is not None
    if n_layer < 1:
        raise ModelError(f"{path}: {n_layer_key} = {n_layer} is out of range (at least 1)")

    count_key, used_key = f"{arch}.expert_count", f"{arch}.expert_used_count"
    n_expert = _int_key(reader, path, count_key)
    assert n_expert is not None
    if not 1 <= n_expert <= LLAMA_MAX_EXPERTS:
        raise ModelError(
            f"{path}: {count_key} = {n_expert} is out of range (1..{LLAMA_MAX_EXPERTS}, llama.cpp's LLAMA_MAX_EXPERTS)"
        )

    used = _ints_key(reader, path, used_key)
    if isinstance(used, list):
        # one value per layer: llama.cpp takes exactly block_count of them, asserts on the largest
        if len(used) != n_layer:
            raise ModelError(
                f"{path}: {used_key} has {len(used)} values, not one per layer ({n_layer_key} = {n_layer})"
            )
        bad = [(i, u) for i, u in enumerate(used) if not 0 <= u <= n_expert]
        if bad or max(used) < 1:
            layer, u = bad[0] if bad else (0, max(used))
            raise ModelError(
                f"{path}: {used_key}[{layer}] = {u} is out of range (1..{n_expert} = {count_key}; 0 for a dense layer)"
            )
        n_expert_used = max(used)
    else:
        if not 1 <= used <= n_expert:
            raise ModelError(f"{path}: {used_key} = {used} is out of range (1..{n_expert} = {count_key})")
        n_expert_used = used

    _check_groups(reader, path, arch, n_expert)
    _check_tensors(reader, path, arch, n_layer, n_expert, moe_layers)
    return MoeKeys(
        path=path,
        arch=arch,
        n_layer=n_layer,
        n_expert=n_expert,
        n_expert_used=n_expert_used,
        moe_layers=tuple(moe_layers),
    )


def require_trace_model(path: str | Path, n_expert: int, layers: Iterable[int]) -> MoeKeys:
    """:func:`require_moe_model`, and the model is one a trace with ``n_expert`` experts routed in
    ``layers`` can have come from: its expert count and a router in each of those layers."""
    keys = require_moe_model(path)
    if keys.n_expert != n_expert:
        raise ModelError(f"{keys.path} has {keys.n_expert} experts per layer, the trace {n_expert}: not its model")
    missing = sorted(set(layers) - set(keys.moe_layers))
    if missing:
        raise ModelError(f"{keys.path} has no expert tensors for layers {missing}, which the trace routes")
    return keys
