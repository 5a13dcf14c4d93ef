"""The argument types of the page model's options of ``onebit-stats simulate`` (commands/simulate_pages.py):
each parses one option's text, ValueError (exit 2, through arg_type) on a bad one."""

from __future__ import annotations

from ..constants import ENV_PREFETCH_ROOM, PREFETCH_ROOM_MAX
from ..costmodel.page_settings import CHECK_KINDS
from ..units import parse_size
from .common import nonneg_float, positive_int


def check_kinds(text: str) -> tuple[str, ...]:
    """``--check``: some of CHECK_KINDS, each once."""
    kinds = tuple(dict.fromkeys(s.strip() for s in text.split(",")))
    bad = [k for k in kinds if k not in CHECK_KINDS]
    if bad or not kinds:
        raise ValueError(f"'{text}': give some of {', '.join(CHECK_KINDS)}")
    return kinds


def tolerance(text: str) -> float:
    """``--tolerance``: a percentage in (0, 1000)."""
    v = float(text)
    if not 0 < v < 1000:
        raise ValueError(f"'{text}' is not a percentage in (0, 1000)")
    return v


def room(text: str) -> float:
    """``--prefetch-room``: R >= 0, at most the consumer's clamp."""
    v = nonneg_float(text)
    if v > PREFETCH_ROOM_MAX:
        raise ValueError(f"'{text}' is above {PREFETCH_ROOM_MAX:g} (the consumer clamps {ENV_PREFETCH_ROOM} there)")
    return v


def size_or_zero(text: str) -> float:
    """``--process-bytes``: a size, or 0."""
    return 0.0 if text.strip() == "0" else parse_size(text)


def page_kb(text: str) -> int:
    """``--page-kb``: a power of two multiple of 4."""
    v = positive_int(text)
    if v % 4 or v & (v - 1):
        raise ValueError(f"'{text}' is not a power of two multiple of 4 KiB")
    return v
