"""Write P/A traces (docs/trace-format.md) from Python: hand-made traces for tests and tools.

The layout comes from ``onebit_predict.trace`` (``TraceHeader.to_bytes``, ``record_dtype``),
so what this writes is exactly what the reader reads. The trace is written to a temporary
name next to ``path`` and gets its name at :meth:`TraceWriter.close` once every byte is on
the drive (onebit_predict/atomic.py): a full disk is an OSError naming the file, and a
writer left by an exception (``with``) leaves nothing behind.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np

from .atomic import check_size, create_temp, fsync_file
from .constants import TRACE_FLAG_DECODE, TRACE_FLAG_PREDICTED
from .trace import TraceHeader


class TraceWriter:
    """Write ``header`` to ``path``, then records one by one (``add``) or in bulk (``write``)."""

    def __init__(self, path: str | Path, header: TraceHeader) -> None:
        self.header = header
        self.path = Path(path)
        self._tmp = create_temp(self.path)
        self._file: BinaryIO | None = self._tmp.open("wb")
        self._bytes = 0
        try:
            self._put(header.to_bytes())
        except BaseException:
            self.abort()
            raise

    def _put(self, data: bytes) -> None:
        if self._file is None:
            raise ValueError(f"{self.path}: the trace writer is closed")
        self._file.write(data)
        self._bytes += len(data)

    def add(
        self,
        *,
        step: int,
        seq_id: int,
        pos: int,
        layer: int,
        actual: Sequence[int],
        weights: Sequence[float] | None = None,
        pred: Sequence[int] | None = None,
        logits: Sequence[float] | None = None,
        n_read: int | None = None,
        decode: bool = True,
        distance: int = 1,
    ) -> None:
        """Append one record.

        ``pred`` (``depth`` ids, best first) marks the row PREDICTED; without it the row holds
        -1 ids, NaN logits and n_read 0. Defaults: equal weights ``1/n_expert_used``, logits
        0, -1, -2, ... and n_read = depth (what llama.cpp writes with no margin gate); a prediction's
        lookahead ``distance`` 1 (a version-3 header records it; an unpredicted row has 0).
        """
        h = self.header
        rec = np.zeros(1, dtype=h.dtype)[0]
        rec["step"], rec["seq_id"], rec["pos"], rec["layer"] = step, seq_id, pos, layer
        rec["actual_ids"] = actual
        rec["actual_w"] = np.full(h.n_expert_used, 1.0 / h.n_expert_used) if weights is None else weights
        flags = TRACE_FLAG_DECODE if decode else 0
        if pred is None:
            rec["pred_ids"], rec["pred_logits"] = -1, np.nan
            rec["n_read"] = 0 if n_read is None else n_read
        else:
            if len(pred) != h.depth:
                raise ValueError(f"pred has {len(pred)} ids, the trace's depth is {h.depth}")
            rec["pred_ids"] = pred
            rec["pred_logits"] = -np.arange(h.depth, dtype=np.float32) if logits is None else logits
            rec["n_read"] = h.depth if n_read is None else n_read
            flags |= TRACE_FLAG_PREDICTED
            if h.has_distance:
                rec["distance"] = distance
        rec["flags"] = flags
        self._put(rec.tobytes())

    def write(self, records: np.ndarray) -> None:
        """Append records already laid out in ``header.dtype``."""
        self._put(np.ascontiguousarray(records, dtype=self.header.dtype).tobytes())

    def close(self) -> None:
        """Flush, fsync and check the temporary file, then rename it onto ``path`` (OSError on a short write)."""
        if self._file is None:
            return
        f, self._file = self._file, None
        try:
            f.close()
            check_size(self._tmp, self._bytes)
            fsync_file(self._tmp)
            os.replace(self._tmp, self.path)
        except BaseException:
            self._tmp.unlink(missing_ok=True)
            raise

    def abort(self) -> None:
        """Drop what was written: ``path`` is left as it was."""
        f, self._file = self._file, None
        try:
            if f is not None:
                f.close()
        except OSError:
            pass
        finally:
            self._tmp.unlink(missing_ok=True)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
