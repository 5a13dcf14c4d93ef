"""What the GGUF sidecars' readers and writers share: the learned predictor's (learned.py) and the
compensator's (int2/compensator.py).

Each sidecar is a small GGUF of F32 tensors and typed keys, written whole or not at all and read
back strictly; a fault is raised as the caller's own error class (``LearnedError``,
``CompensatorError``), with the file and the fault named, so every message stays the module's.

Both readers and writers hold each layer's map to one gain bound (:func:`check_gain`,
:data:`~onebit_predict.constants.SIDECAR_MAX_GAIN`, 65504, F16's largest finite value): a finite
but huge weight would otherwise be used, and overflow the F16 K/V cache and matmul inputs
downstream. The patch series' C++ loaders apply the same rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .constants import SIDECAR_MAX_GAIN

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1
KEY_ARCH = "general.architecture"

Error = type[Exception]


def is_uint(v: Any, top: int) -> bool:
    """Whether ``v`` is an integer (not a bool) in 0..top."""
    return not isinstance(v, bool) and isinstance(v, (int, np.integer)) and 0 <= int(v) <= top


def check_identity(where: str, key_arch: str, model_arch: Any, key_hash: str, h: Any, error: Error) -> None:
    """The model a sidecar names: a non-empty architecture string and a u64 hash; ``error`` otherwise."""
    if not isinstance(model_arch, str) or not model_arch:
        raise error(f"{where}: {key_arch} is empty or not a string (the model's general.architecture)")
    if not is_uint(h, U64_MAX):
        raise error(f"{where}: {key_hash} = {h!r} is not a u64")


def check_f32_array(where: str, name: str, arr: Any, shape: tuple[int, ...], error: Error) -> None:
    """``arr`` is a finite float32 numpy array of ``shape``; ``error`` naming the tensor otherwise."""
    if not isinstance(arr, np.ndarray) or arr.dtype != np.float32:
        raise error(f"{where}: tensor {name} is not float32 ({getattr(arr, 'dtype', type(arr).__name__)})")
    if tuple(arr.shape) != shape:
        raise error(f"{where}: tensor {name} has numpy shape {tuple(arr.shape)}, expected {shape}")
    if not np.all(np.isfinite(arr)):
        raise error(f"{where}: tensor {name} holds a value that is not finite")


def frobenius(arr: np.ndarray) -> float:
    """The Frobenius norm of ``arr``, computed in float64 (a float32 square of 3e38 would be inf)."""
    return float(np.linalg.norm(np.asarray(arr, dtype=np.float64).reshape(-1)))


def check_gain(where: str, layer: int, what: str, gain: float, error: Error) -> None:
    """``gain`` (a layer's gain bound, named ``what``) is at most SIDECAR_MAX_GAIN; ``error`` otherwise."""
    if not gain <= SIDECAR_MAX_GAIN:  # a NaN is refused too
        raise error(
            f"{where}: layer {layer}: {what} = {gain:.2g} exceeds {SIDECAR_MAX_GAIN:g} (F16's largest value): refused"
        )


def write_sidecar(
    path: Path, arch: str, keys: Sequence[tuple[str, str, Any]], tensors: Sequence[tuple[str, np.ndarray]]
) -> None:
    """Write a sidecar GGUF: ``keys`` as (kind u32|u64|string, key, value), then the F32 ``tensors``,
    whole or absent (atomic.py: a full disk is an OSError, never half a sidecar at ``path``)."""
    import gguf

    from .atomic import atomic_path
    from .grow.gguf_keys import check_gguf_whole

    with atomic_path(path) as tmp:
        w = gguf.GGUFWriter(tmp, arch)
        try:
            add = {"u32": w.add_uint32, "u64": w.add_uint64, "string": w.add_string}
            for kind, key, value in keys:
                add[kind](key, value if kind == "string" else int(value))
            for name, arr in tensors:
                w.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        finally:
            w.close()
        check_gguf_whole(tmp, OSError, path)


def open_gguf(path: Path, error: Error) -> Any:
    """A gguf-py reader of any GGUF (a model's too); ``error`` when it cannot be read as one."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError, EOFError) as e:
        raise error(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e


def open_sidecar(path: Path, arch: str, error: Error) -> Any:
    """The gguf-py reader of a sidecar whose ``general.architecture`` is ``arch``; ``error`` otherwise."""
    reader = open_gguf(path, error)
    found = reader.fields.get(KEY_ARCH)
    if found is None:
        raise error(f"{path}: key {KEY_ARCH} is missing")
    if found.contents() != arch:
        raise error(f"{path}: {KEY_ARCH} is {found.contents()!r}, expected {arch!r}")
    return reader


def field_value(path: Path, fields: Any, key: str, kind: str, error: Error) -> Any:
    """A key's value, of ``kind`` u32, u64 or string exactly; ``error`` when missing or of another type."""
    import gguf

    f = fields.get(key)
    if f is None:
        raise error(f"{path}: key {key} is missing")
    want = {"u32": gguf.GGUFValueType.UINT32, "u64": gguf.GGUFValueType.UINT64}.get(kind, gguf.GGUFValueType.STRING)
    if len(f.types) != 1 or f.types[0] != want:
        got = "/".join(t.name for t in f.types) or "?"
        raise error(f"{path}: key {key} is {got}, expected {want.name}")
    return str(f.contents()) if kind == "string" else int(f.contents())


def unknown_keys(fields: Any, arch: str, known: Any) -> list[str]:
    """The keys under ``arch.`` that are not in ``known``, sorted."""
    return sorted(k for k in fields if k.startswith(arch + ".") and k not in known)
