"""What a context's predictor and consumer did (``struct onebit_moe_stats`` of include/onebit-moe.h,
``onebit_moe_get_stats``), bound with ctypes next to llama-cpp-python's own bindings.

The benchmark's worker (checks/worker.py) reads the route-time counters around its decoded
tokens: ``route_bytes`` is what the routed experts lacked in the page cache when their layer was
routed, the bytes a token had to read (the floor of docs/results.md). tests/test_abi.py holds
the structure to the C layout, field by field.
"""

from __future__ import annotations

import ctypes
from typing import Any

_u64, _i64, _i32 = ctypes.c_uint64, ctypes.c_int64, ctypes.c_int32


class OnebitMoeStats(ctypes.Structure):
    """``struct onebit_moe_stats``."""

    _fields_ = [
        ("predict", _i32),
        ("prefetch", _i32),
        *((name, _u64) for name in ("tokens", "actual", "read", "hits")),
        *((f"prefetch_{name}", _u64) for name in ("experts", "bytes", "resident", "dropped", "failed")),
        ("guard_tokens_off", _u64),
        ("guard_tokens_on", _u64),
        ("oracle_missing", _u64),
        ("room_off_ops", _u64),
        ("room_bytes", _i64),
        ("room_need_bytes", _i64),
        ("speculative", _i32),
        ("route", _i32),
        *((f"route_{name}", _u64) for name in ("experts", "bytes", "resident", "stale", "wait_us", "waits")),
        ("wait", _i32),
        ("keep", _i32),
        ("keep_evicted", _u64),
        ("keep_capacity", _i64),
        ("spec_skipped", _u64),
        ("spec_unused", _u64),
        ("order", _i32),
        ("order_marked", _u64),
        ("order_reordered", _u64),
        ("layers", _i32),
        *((f"layers_{name}", _u64) for name in ("ops", "bytes", "cut")),
        ("order_waiting", _u64),
        ("keep_streamed", _u64),
        ("keep_given_back", _u64),
    ]


def context_stats(lib: Any, ctx: Any) -> dict[str, int] | None:
    """The context's counters now, by field name; None when it has no predictor object (everything off)."""
    fn = lib.llama_cpp._lib.onebit_moe_get_stats  # the CDLL llama-cpp-python loaded
    fn.argtypes = [lib.llama_context_p_ctypes, ctypes.POINTER(OnebitMoeStats)]
    fn.restype = ctypes.c_bool
    out = OnebitMoeStats()
    if not fn(ctx, ctypes.byref(out)):
        return None
    return {name: getattr(out, name) for name, _ in OnebitMoeStats._fields_}
