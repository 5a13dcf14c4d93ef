"""Copying one GGUF key from a gguf-py reader to a writer, as both model rewriters do (grow.py,
vocab.py): its value types, and the writer's alignment when the key sets it; reading one of
a model's architecture keys (``{arch}.expert_count``); and checking that a GGUF just written
is whole (:func:`check_gguf_whole`: every writer of a model runs it before the file gets its
final name, onebit_predict/atomic.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def copy_key(writer: Any, key: str, field: Any, value: Any, path: Path, error: type[Exception]) -> None:
    """Write ``key`` with ``value`` and ``field``'s types; ``error`` (naming ``path``) for a nested array."""
    import gguf  # a dependency of the package; imported here to keep `import onebit_predict` light

    main, sub = field.types[0], None
    if main == gguf.GGUFValueType.ARRAY:
        if len(field.types) != 2:
            raise error(f"{path}: key {key} is a nested array: not supported")
        sub = field.types[1]
    writer.add_key_value(key, value, main, sub_type=sub)
    if key == "general.alignment":
        writer.data_alignment = int(value)


def write_tensors_as_read(writer: Any, reader: Any) -> None:
    """Finish ``writer`` (its keys already added) with every tensor of ``reader`` as stored: the
    header, the keys, the tensor infos, then each tensor's bytes with gguf-py's padding."""
    import numpy as np

    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, int(t.n_bytes), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    writer.write_padding(fout, fout.tell())
    for t in reader.tensors:
        start = fout.tell()
        fout.write(np.asarray(t.data).tobytes())
        writer.write_padding(fout, fout.tell() - start)
    fout.flush()


def arch_value(path: Path, name: str) -> Any:
    """The value of ``{general.architecture}.{name}`` in the GGUF file ``path`` (KeyError when absent)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.{name}")
    if field is None:
        raise KeyError(f"{path}: has no key {arch}.{name}")
    return field.contents()


def check_gguf_whole(path: Path, error: type[Exception], name: Path | None = None) -> int:
    """The size of the GGUF at ``path``; ``error`` (naming ``name``, the file's final name, or
    ``path``) unless it reads back whole.

    Whole: gguf-py reads its header, keys and tensor list, and the file reaches the end of its
    last tensor's data. A writer cut short (a full disk) fails one or the other.
    """
    import gguf

    shown = path if name is None else name
    size = path.stat().st_size
    try:
        reader = gguf.GGUFReader(path)
        end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=int(reader.data_offset))
    except Exception as e:  # noqa: BLE001 - whatever a cut file makes the reader raise
        raise error(f"{shown}: written short: its {size} bytes do not read back as a GGUF ({e})") from None
    if size < end:
        raise error(f"{shown}: written short: {size} of {end} bytes (is the disk full?)")
    return size
