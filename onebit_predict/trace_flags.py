"""The P/A trace header's flags word, decoded (docs/trace-format.md, header offset 52).

``HeaderFlags`` is a mixin of ``trace.TraceHeader``: one property per bit or field of
``flags``. The bounds of those bits and fields are checked by the header's reader
(``TraceHeader.from_bytes``), not here.
"""

from __future__ import annotations

from .constants import (
    TRACE_HDR_AHEAD_MASK,
    TRACE_HDR_AHEAD_SHIFT,
    TRACE_HDR_FLAG_DEBUG_LEAK,
    TRACE_HDR_FLAG_DEBUG_SELF,
    TRACE_HDR_FLAG_INCOMPLETE,
    TRACE_HDR_FLAG_NO_ATTN,
    TRACE_HDR_FLAG_OPEN,
    TRACE_HDR_FLAG_RANDOM,
    TRACE_HDR_FLAG_ROUTE,
    TRACE_HDR_FLAG_SPECULATIVE,
    TRACE_HDR_FLAG_STATS,
    TRACE_HDR_FLAG_UNCHECKED,
    TRACE_HDR_FLAG_WAIT,
    TRACE_HDR_GUARD_MASK,
    TRACE_HDR_GUARD_SHIFT,
)


class HeaderFlags:
    """The header's flags word as properties (the dataclass that mixes this in holds ``flags``)."""

    flags: int  # a field of the dataclass, not of this mixin

    @property
    def no_attn(self) -> bool:
        return bool(self.flags & TRACE_HDR_FLAG_NO_ATTN)

    @property
    def stats(self) -> bool:
        return bool(self.flags & TRACE_HDR_FLAG_STATS)

    @property
    def debug_self(self) -> bool:
        """A control trace: each layer ranked by its own router."""
        return bool(self.flags & TRACE_HDR_FLAG_DEBUG_SELF)

    @property
    def debug_leak(self) -> bool:
        """The negative control was built into the context's graphs."""
        return bool(self.flags & TRACE_HDR_FLAG_DEBUG_LEAK)

    @property
    def graph_check_off(self) -> bool:
        """The negative control ran with the graph check off (``_DEBUG_LEAK=1``)."""
        return bool(self.flags & TRACE_HDR_FLAG_UNCHECKED)

    @property
    def open(self) -> bool:
        """The writer never freed its context (it died, or is still writing): not closed cleanly."""
        return bool(self.flags & TRACE_HDR_FLAG_OPEN)

    @property
    def incomplete(self) -> bool:
        """A write of records failed (e.g. a full disk): the file lacks records."""
        return bool(self.flags & TRACE_HDR_FLAG_INCOMPLETE)

    @property
    def ahead(self) -> int:
        """ONEBIT_MOE_PREDICT_AHEAD of the run: layer l predicted layer l+ahead (1 before version 3)."""
        return (self.flags & TRACE_HDR_AHEAD_MASK) >> TRACE_HDR_AHEAD_SHIFT or 1

    @property
    def route(self) -> bool:
        """The consumer read each MoE layer's routed experts at route time (``ONEBIT_MOE_PREFETCH_ROUTE``)."""
        return bool(self.flags & TRACE_HDR_FLAG_ROUTE)

    @property
    def random(self) -> bool:
        """The kernel's readahead was off on the expert tensors (``ONEBIT_MOE_PREFETCH_RANDOM``, MADV_RANDOM)."""
        return bool(self.flags & TRACE_HDR_FLAG_RANDOM)

    @property
    def speculative(self) -> bool:
        """The consumer read the predicted experts ahead of their layer (a call and a predictor)."""
        return bool(self.flags & TRACE_HDR_FLAG_SPECULATIVE)

    @property
    def wait(self) -> bool:
        """The route-time op waited for its layer's reads (``ONEBIT_MOE_PREFETCH_WAIT``)."""
        return bool(self.flags & TRACE_HDR_FLAG_WAIT)

    @property
    def prefetch_guard(self) -> int:
        """The consumer's guard window, tokens per probe (0: none, or a trace before version 3)."""
        return (self.flags & TRACE_HDR_GUARD_MASK) >> TRACE_HDR_GUARD_SHIFT
