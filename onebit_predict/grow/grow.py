"""Grow a trained MoE GGUF: widen every routed expert's FFN with zeros, same function.

A routed expert computes ``down @ (act(gate @ x) * (up @ x))``. Widening its FFN from
``n_ff`` (``{arch}.expert_feed_forward_length``) to ``width`` adds rows of zeros to
``gate`` and ``up`` (their outputs are 0, and ``act(0) * 0 = 0`` for silu and gelu) and
columns of zeros to ``down`` (they multiply those zeros): the model computes the same
function with experts of any size. In ggml's order (ne0 first) the tensors are

- ``blk.N.ffn_gate_exps.weight``, ``blk.N.ffn_up_exps.weight``: ``[n_embd, n_ff, n_expert]``
  -> ``[n_embd, width, n_expert]`` (zero rows, per expert);
- ``blk.N.ffn_down_exps.weight``: ``[n_ff, n_embd, n_expert]`` -> ``[width, n_embd, n_expert]``
  (each row gets ``width - n_ff`` zeros at its end).

The grown tensors are written in the output type (F32 or F16; their values are the
source's, exactly, when the source is F16 and the output F32). Every other tensor (shared
experts ``*_shexp``, the router, attention, embeddings) and every other key is copied as
is, in the source's order; only ``{arch}.expert_feed_forward_length`` changes. Tensors are
written one at a time, one expert at a time: memory stays at one expert's slice, whatever
the size of the output.

Sizing (:func:`width_for`): the width whose experts, stored as llama.cpp's
``llama-quantize`` stores them at a given type (:func:`expert_tensor_type`, which mirrors
the pinned tree's ``src/llama-quant.cpp`` for the routed expert tensors), are on average
over the layers at least the target bytes, rounded up to a multiple of 256 (the K-quants'
block: ``down``'s rows are ``width`` long). The same mean-over-layers convention as
docs/results.md's 2.72 MiB Qwen3-30B-A3B expert.

The routed experts are read by onebit_predict/gguf_experts.py (the one reader of a GGUF's
experts: each tensor's place, type and shape), for the source as for what llama-quantize made.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import atomic_path
from ..gguf_experts import GgufExperts, ModelError, read_experts
from .gguf_keys import check_gguf_whole, copy_key

QK_K = 256  # the K-quants' block: the grown width is a multiple of it
MIB = 1 << 20

# the output types of the writer, and the types llama-quantize makes from its output
WRITE_TYPES = ("f32", "f16")
QUANT_TYPES = {"q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}  # our name -> llama-quantize's ftype name
TYPES = (*WRITE_TYPES, *QUANT_TYPES)

ANY_EXPERT = re.compile(r"^blk\.\d+\.ffn_\w+_exps(\.|$)")  # routed-expert tensors of any kind, by name
ROLES = ("gate", "up", "down")
_CHUNK = 16 * MIB  # bytes of zeros written at once


class GrowError(ValueError):
    """The model cannot be grown (not a GGUF, no routed experts, a layout this tool does not know)."""


def _gguf() -> Any:
    import gguf  # a dependency of the package; imported here to keep `import onebit_predict` light

    return gguf


def sha256_file(path: Path, block: int = 8 * MIB) -> str:
    """The hex sha256 of a file, read in blocks."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


# --- what the source model is -----------------------------------------------------------------


@dataclass(frozen=True)
class ModelInfo:
    path: Path
    arch: str
    n_layer: int  # {arch}.block_count: the n_layer of llama-quantize's layer rules
    n_embd: int
    n_ff: int  # {arch}.expert_feed_forward_length
    n_expert: int
    layers: tuple[int, ...]  # the layers with routed experts
    expert_type: str  # the routed expert tensors' type name (F16, F32, ...)
    experts: GgufExperts = dataclass_field(repr=False, compare=False)  # its routed-expert tensors (gguf_experts.py)

    @property
    def ff_key(self) -> str:
        return f"{self.arch}.expert_feed_forward_length"


def _open(path: Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise GrowError(f"{path}: no such file")
    try:
        return _gguf().GGUFReader(path)
    except (OSError, ValueError, KeyError) as e:
        raise GrowError(f"{path}: cannot read it as a GGUF: {e}") from None


def _scalar(reader: Any, key: str, path: Path) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise GrowError(f"{path}: has no key {key}")
    return field.contents()


def _experts(reader: Any, path: Path) -> GgufExperts:
    try:
        return read_experts(path, reader)
    except ModelError as e:
        raise GrowError(str(e)) from None


def _info(reader: Any, path: Path) -> ModelInfo:
    arch = _scalar(reader, "general.architecture", path)
    n_layer = int(_scalar(reader, f"{arch}.block_count", path))
    n_embd = int(_scalar(reader, f"{arch}.embedding_length", path))
    n_ff = int(_scalar(reader, f"{arch}.expert_feed_forward_length", path))
    n_expert = int(_scalar(reader, f"{arch}.expert_count", path))
    experts = _experts(reader, path)
    known = {t.name for t in experts.tensors if t.role in ROLES and t.suffix == ".weight"}
    odd = [t.name for t in reader.tensors if ANY_EXPERT.match(t.name) and t.name not in known]
    if odd:
        raise GrowError(f"{path}: {odd[0]}: this tool grows only ffn_gate/up/down_exps.weight")
    roles: dict[int, set[str]] = {}
    for t in experts.tensors:
        want = [n_embd, n_ff, n_expert] if t.role != "down" else [n_ff, n_embd, n_expert]
        if list(t.shape) != want:
            raise GrowError(f"{path}: {t.name} has shape {list(t.shape)}, expected {want}")
        roles.setdefault(t.layer, set()).add(t.role)
    for layer, have in sorted(roles.items()):
        if have != set(ROLES):
            raise GrowError(f"{path}: layer {layer} has expert tensors {sorted(have)}, not gate, up and down")
    types = {t.type_name for t in experts.tensors}
    if not types <= {"F16", "F32"} or len(types) != 1:
        raise GrowError(f"{path}: expert tensors are {sorted(types)}: growing needs one type, F16 or F32")
    return ModelInfo(Path(path), arch, n_layer, n_embd, n_ff, n_expert, tuple(sorted(roles)), types.pop(), experts)


def model_info(path: Path) -> ModelInfo:
    """What :func:`grow` needs to know of a GGUF; GrowError if it cannot be grown."""
    return _info(_open(path), Path(path))


# --- sizes as llama.cpp stores them ---------------------------------------------------------


def use_more_bits(i_layer: int, n_layer: int) -> bool:
    """src/llama-quant.cpp's rule for the layers whose ffn_down gets more bits (Q4_K_M: Q6_K)."""
    return i_layer < n_layer // 8 or i_layer >= 7 * n_layer // 8 or (i_layer - n_layer // 8) % 3 == 2


def _fallback(qtype: Any, ncols: int) -> Any:
    """src/llama-quant.cpp tensor_type_fallback: a type whose block divides the row length."""
    gguf = _gguf()
    t = gguf.GGMLQuantizationType
    if ncols % gguf.GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    out = {t.Q4_K: t.Q5_0, t.Q5_K: t.Q5_1, t.Q6_K: t.Q8_0}.get(qtype, qtype)
    if ncols % gguf.GGML_QUANT_SIZES[out][0] != 0:
        out = t.F16
    return out


def expert_tensor_type(kind: str, role: str, ncols: int, layer: int, n_layer: int) -> Any:
    """The GGMLQuantizationType llama.cpp stores a routed expert tensor in at ``kind`` (TYPES).

    For the two quantized kinds this is llama-quantize's choice for ffn_gate/up/down_exps
    (no imatrix, no overrides): Q8_0 everywhere; Q4_K_M: Q4_K, and Q6_K for ffn_down on the
    layers of :func:`use_more_bits`; then the fallback where ``ncols`` (the row, ggml's ne0)
    is not a multiple of the type's block.
    """
    t = _gguf().GGMLQuantizationType
    if kind == "f32":
        return t.F32
    if kind == "f16":
        return t.F16
    if kind == "q8_0":
        return _fallback(t.Q8_0, ncols)
    if kind == "q4_k_m":
        return _fallback(t.Q6_K if role == "down" and use_more_bits(layer, n_layer) else t.Q4_K, ncols)
    raise GrowError(f"unknown type {kind!r} (known: {', '.join(TYPES)})")


def matrix_bytes(qtype: Any, ncols: int, nrows: int) -> int:
    """Bytes of an ``nrows`` x ``ncols`` matrix (rows of ncols, ggml's ne0) in qtype."""
    block, size = _gguf().GGML_QUANT_SIZES[qtype]
    if ncols % block:
        raise GrowError(f"{qtype.name} needs rows of a multiple of {block}, not {ncols}")
    return nrows * (ncols // block) * size


def expert_bytes(info: ModelInfo, width: int, kind: str) -> dict[int, int]:
    """``{layer: bytes of one routed expert}`` at ``width`` stored as ``kind`` (predicted)."""
    out = {}
    for layer in info.layers:
        total = 0
        for role in ROLES:
            ncols, nrows = (info.n_embd, width) if role != "down" else (width, info.n_embd)
            total += matrix_bytes(expert_tensor_type(kind, role, ncols, layer, info.n_layer), ncols, nrows)
        out[layer] = total
    return out


def mean_bytes(per_layer: dict[int, int]) -> float:
    return sum(per_layer.values()) / len(per_layer)


def width_for(info: ModelInfo, target_bytes: float, kind: str) -> int:
    """The smallest multiple of 256, at least n_ff, whose mean expert bytes at ``kind`` reach the target."""
    if target_bytes <= 0:
        raise GrowError(f"the target size must be positive, not {target_bytes}")
    per_col = mean_bytes(expert_bytes(info, QK_K, kind)) / QK_K  # bytes are linear in the width
    width = max(int(np.ceil(target_bytes / per_col / QK_K)) * QK_K, -(-info.n_ff // QK_K) * QK_K)
    while mean_bytes(expert_bytes(info, width, kind)) < target_bytes:  # rounding of the division above
        width += QK_K
    return width


# --- writing ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Grown:
    path: Path
    width: int
    kind: str  # f32 or f16
    n_bytes: int  # the file's size
    grown_tensors: int


def _copy_keys(reader: Any, writer: Any, info: ModelInfo, width: int) -> None:
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":  # the writer writes these itself
            continue
        value = width if key == info.ff_key else field.contents()
        copy_key(writer, key, field, value, info.path, GrowError)


def _grown_shape(info: ModelInfo, role: str, width: int) -> tuple[int, int, int]:
    """numpy's order (ggml's reversed)."""
    if role == "down":
        return (info.n_expert, info.n_embd, width)
    return (info.n_expert, width, info.n_embd)


def _write_zeros(fout: Any, n: int) -> None:
    zeros = bytes(min(n, _CHUNK))
    while n > 0:
        step = min(n, len(zeros))
        fout.write(zeros[:step] if step < len(zeros) else zeros)
        n -= step


def _write_grown(fout: Any, data: np.ndarray, role: str, width: int, dtype: np.dtype) -> None:
    """One expert at a time: gate/up get zero rows after each expert's; down zero columns."""
    n_ff = data.shape[1] if role != "down" else data.shape[2]
    for e in range(data.shape[0]):
        if role == "down":
            block = np.zeros((data.shape[1], width), dtype=dtype)
            block[:, :n_ff] = data[e]
            fout.write(block.tobytes())
        else:
            fout.write(np.ascontiguousarray(data[e], dtype=dtype).tobytes())
            _write_zeros(fout, (width - n_ff) * data.shape[2] * dtype.itemsize)


def grow(src: Path, dst: Path, width: int, kind: str = "f32") -> Grown:
    """Write ``dst``: ``src`` with every routed expert widened to ``width`` (>= n_ff) in ``kind``."""
    if kind not in WRITE_TYPES:
        raise GrowError(f"the writer writes {' or '.join(WRITE_TYPES)}, not {kind!r}")
    gguf = _gguf()
    reader = _open(src)
    info = _info(reader, Path(src))
    if width < info.n_ff:
        raise GrowError(f"width {width} is below the model's expert_feed_forward_length {info.n_ff}")
    dtype = np.dtype(np.float32 if kind == "f32" else np.float16)
    role_of = {t.name: t.role for t in info.experts.tensors}  # the tensors to widen
    dst = Path(dst)
    # whole or absent (onebit_predict/atomic.py): a full disk is an OSError, never half a model at dst
    with atomic_path(dst) as tmp:
        writer = gguf.GGUFWriter(tmp, info.arch)
        try:
            _copy_keys(reader, writer, info, width)
            for t in reader.tensors:
                if t.name in role_of:
                    shape = _grown_shape(info, role_of[t.name], width)
                    writer.add_tensor_info(t.name, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
                else:
                    writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, int(t.n_bytes), raw_dtype=t.tensor_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            fout = writer.fout[0]
            writer.write_padding(fout, fout.tell())
            grown = 0
            for t in reader.tensors:
                start = fout.tell()
                if t.name in role_of:
                    _write_grown(fout, np.asarray(t.data), role_of[t.name], width, dtype)
                    grown += 1
                else:
                    fout.write(np.asarray(t.data).tobytes())
                writer.write_padding(fout, fout.tell() - start)
            fout.flush()
        finally:
            writer.close()
        size = check_gguf_whole(tmp, OSError, dst)
    return Grown(dst, width, kind, size, grown)


# --- reading back (tests, the manifest) --------------------------------------------------------


def expert_types(path: Path) -> dict[str, list[str]]:
    """``{role: [type name of layer l's ffn_{role}_exps, ...]}`` of a GGUF, in layer order."""
    experts = _experts(_open(path), Path(path))
    out: dict[str, dict[int, str]] = {role: {} for role in ROLES}
    for t in experts.tensors:
        if t.role in out and t.suffix == ".weight":
            out[t.role][t.layer] = t.type_name
    return {role: [v for _, v in sorted(d.items())] for role, d in out.items()}


def measured_expert_bytes(path: Path) -> dict[int, int]:
    """``{layer: bytes of one routed expert}`` as the file stores them (each tensor's nbytes / n_expert)."""
    return _experts(_open(path), Path(path)).expert_bytes()


def describe_sizes(info: ModelInfo, width: int, kinds: Sequence[str] = TYPES) -> dict[str, dict[str, float]]:
    """Predicted bytes per expert (mean, min, max over the layers) at ``width`` for each kind."""
    out = {}
    for kind in kinds:
        per = expert_bytes(info, width, kind)
        out[kind] = {"mean": mean_bytes(per), "min": min(per.values()), "max": max(per.values())}
    return out
