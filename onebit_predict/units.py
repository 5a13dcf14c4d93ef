"""Byte sizes and bandwidths as people write them: ``6.75MiB``, ``3GB/s``, ``500 MiB/s``.

Decimal prefixes are powers of 1000 (kB, MB, GB, TB; ``K``, ``M``, ``G``, ``T`` alone mean
the same), binary ones powers of 1024 (KiB, MiB, GiB, TiB). A bare number is bytes (or bytes
per second). Prefixes are case-insensitive, but the byte must be a capital ``B``: a lower-case
``b`` means bits and is refused (``3Gb/s`` is an error, not 3 GB/s). Anything unparsable, zero,
negative or not finite raises ``ValueError``
with the text in the message.
"""

from __future__ import annotations

import math
import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str) -> float:
    """``6.75MiB`` -> 7077888.0 bytes; ValueError on anything else."""
    m = _SIZE.match(text)
    if not m:
        raise ValueError(f"'{text}' is not a size (a number with an optional unit: B, kB, MB, GB, KiB, MiB, GiB)")
    number, unit = m.groups()
    if unit.endswith("b"):
        raise ValueError(f"'{text}': a lower-case b is bits; write bytes with B (e.g. {unit[:-1]}B)")
    if unit.lower() not in _UNITS:
        raise ValueError(f"'{text}': unknown unit '{unit}' (B, kB, MB, GB, TB, KiB, MiB, GiB, TiB)")
    value = float(number) * _UNITS[unit.lower()]
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"'{text}' is not a positive size")
    return value


def parse_bandwidth(text: str) -> float:
    """``3GB/s`` -> 3e9 bytes per second (the ``/s`` is optional); ValueError on anything else."""
    body = text.strip()
    if body.lower().endswith("/s"):
        body = body[:-2]
    try:
        return parse_size(body)
    except ValueError as e:
        raise ValueError(f"'{text}' is not a bandwidth (e.g. 3GB/s, 500MiB/s): {e}") from None


def fmt_bandwidth(bytes_per_s: float) -> str:
    """3e9 -> ``3 GB/s`` (decimal, at most 3 significant digits)."""
    for unit, scale in (("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bytes_per_s >= scale:
            return f"{bytes_per_s / scale:.3g} {unit}"
    return f"{bytes_per_s:.3g} B/s"
