"""Copying one GGUF key from a gguf-py reader to a writer, as both model rewriters do (grow.py,
vocab.py): its value types, and the writer's alignment when the key sets it; and reading one of
a model's architecture keys (``{arch}.expert_count``)."""

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


def arch_value(path: Path, name: str) -> Any:
    """The value of ``{general.architecture}.{name}`` in the GGUF file ``path`` (KeyError when absent)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.{name}")
    if field is None:
        raise KeyError(f"{path}: has no key {arch}.{name}")
    return field.contents()
