"""The verdict on a trace just written: is the file llama.cpp wrote whole (docs/trace-format.md)?

A writer that checks its own output (``onebit-trace``, ``onebit-bitident``) asks this once the
context is freed, and fails with the reason instead of reporting a half-written file as a
success: a missing file, a header the reader refuses, the header flags ``INCOMPLETE`` (a write
of records failed) or ``OPEN`` (the context was not freed cleanly), a partial last record.
"""

from __future__ import annotations

import os
from pathlib import Path

from .constants import TRACE_HEADER_SIZE
from .trace import TraceError, TraceHeader


def written_problem(path: str | Path, name: str | Path | None = None) -> str | None:
    """Why the trace llama.cpp was to write at ``path`` is not whole, once its context is freed; None if it is.

    The file must exist, hold a header this reader accepts, with neither ``INCOMPLETE`` (a write
    of records failed) nor ``OPEN`` (the context was not freed cleanly), and end on a whole
    record. A file shorter than its header is a write that failed at its first bytes (a full
    disk: the header is written when the context is created, and the flags that would say so
    cannot be written either). ``name``: what the messages call the file (default ``path``).
    """
    path = Path(path)
    name = path if name is None else name
    try:
        with path.open("rb") as f:
            head = f.read(TRACE_HEADER_SIZE)
            size = os.fstat(f.fileno()).st_size
    except FileNotFoundError:
        return f"no trace written: llama.cpp did not create {name} (its log above says why)"
    except OSError as e:
        return f"writing the trace failed: {name} cannot be read back: {e}"
    if len(head) < TRACE_HEADER_SIZE:
        return (
            f"writing the trace failed: {name} is {len(head)} bytes, shorter than its {TRACE_HEADER_SIZE}-byte"
            " header (a full disk? llama.cpp logs the write error above)"
        )
    try:
        header = TraceHeader.from_bytes(head)
    except TraceError as e:
        return f"writing the trace failed: {name}: {e}"
    if header.incomplete:
        return (
            f"writing the trace failed: {name} is incomplete (header flag INCOMPLETE): some records could not"
            " be written (a full disk? llama.cpp logs the write errors above)"
        )
    if header.open:
        return (
            f"writing the trace failed: {name} was not closed cleanly (its header still has flag OPEN after"
            " the context was freed: the final header write failed)"
        )
    partial = (size - TRACE_HEADER_SIZE) % header.record_size
    if partial:
        return f"writing the trace failed: {name} ends in a partial record ({partial} bytes)"
    return None
