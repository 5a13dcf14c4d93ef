"""``onebit-bench --memory-limit``'s values: each item's form checked at parse time, its bytes once
the model's expert bytes are known (a share of them, a size, or ``resident``: no limit)."""

from __future__ import annotations

from ..units import parse_size
from .bench_memory import RESIDENT


def limit_text(text: str) -> str:
    """One --memory-limit item, its form checked at parse time (limit_bytes turns it into bytes once
    the model's expert bytes are known): a share is of the expert bytes and below all of them (100 %
    is no limit: ``resident`` is the run without one)."""
    if text == "resident":
        return text
    try:
        share = float(text[:-1]) if text.endswith("%") else None
        if share is None:
            parse_size(text)
    except ValueError:
        raise ValueError(f"'{text}' is neither a share (50%), a size (160MiB) nor resident") from None
    if share is not None and not 0 < share < 100:
        raise ValueError(
            f"'{text}': a limit is a share above 0 and below 100 % of the expert bytes (or 'resident', for no limit)"
        )
    return text


def limit_bytes(texts: list[str], expert_bytes: int) -> list[int]:
    """--memory-limit's bytes: ``50%`` of the expert bytes, a size (``160MiB``), or ``resident``
    (RESIDENT: no limit, the model file read into the page cache before each run)."""
    out = []
    for t in texts:
        if t == "resident":
            out.append(RESIDENT)
            continue
        try:
            n = float(t[:-1]) / 100 * expert_bytes if t.endswith("%") else parse_size(t)
        except ValueError:
            raise ValueError(f"--memory-limit: '{t}' is neither a share (50%), a size (160MiB) nor resident") from None
        if not 16 * 2**20 <= n:
            raise ValueError(f"--memory-limit: '{t}' is {n / 2**20:.1f} MiB; at least 16 MiB (the process needs it)")
        if int(n) in out:
            raise ValueError(f"--memory-limit: '{t}' is {int(n)} bytes, given twice (each limit is a run of its own)")
        out.append(int(n))
    return out
