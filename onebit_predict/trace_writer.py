"""Write P/A traces (docs/trace-format.md) from Python: hand-made traces for tests and tools.

The layout comes from ``onebit_predict.trace`` (``TraceHeader.to_bytes``, ``record_dtype``),
so what this writes is exactly what the reader reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

import numpy as np

from .constants import TRACE_FLAG_DECODE, TRACE_FLAG_PREDICTED
from .trace import TraceHeader


class TraceWriter:
    """Write ``header`` to ``path``, then records one by one (``add``) or in bulk (``write``)."""

    def __init__(self, path: str | Path, header: TraceHeader) -> None:
        self.header = header
        self._file = Path(path).open("wb")
        self._file.write(header.to_bytes())

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
        self._file.write(rec.tobytes())

    def write(self, records: np.ndarray) -> None:
        """Append records already laid out in ``header.dtype``."""
        self._file.write(np.ascontiguousarray(records, dtype=self.header.dtype).tobytes())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
