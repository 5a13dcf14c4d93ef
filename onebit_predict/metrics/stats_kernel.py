"""The compiled kernel of onebit-stats: ``stats_kernel.c`` through cffi, one call per chunk.

``StatsKernel(header)`` holds the counters by (distance, layer), the control's counters and (inside
the C state) the last record of each (seq_id, layer); ``feed(chunk)`` scores a chunk of
records straight from the bytes read, in one pass. The module is built on first use with
the system C compiler and cached (``onebit_predict.cffi_build``); there is no silent
fallback: if it cannot be built, ``StatsKernelError`` says why, and ``compute_stats(...,
engine="numpy")`` is the explicit alternative.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

from ..constants import MODE_OFF
from ..trace import TRACE_MAX_DISTANCE, TraceError, TraceHeader
from .cffi_build import CffiBuildError, load_cffi_module

MODULE = "_onebit_stats_kernel"
SOURCE = Path(__file__).with_name("stats_kernel.c")
COMPILE_ARGS = ("-std=c99", "-O2")  # no -ffast-math: the gate and the NaN checks need IEEE compares
CDEF = """
#define OBS_N_INT ...
#define OBS_N_FLOAT ...
#define OBS_N_ISSUES ...
#define OBS_N_LAYER_IDS ...
#define OBS_N_DIST ...
typedef struct obs_state obs_state;
obs_state *obs_new(int32_t n_layer, int32_t n_expert, int32_t n_used, int32_t depth, float margin,
                   int32_t min_read, int32_t mode_off, int32_t legacy, const uint8_t *predictable,
                   int64_t *ints, double *floats, int64_t *issues);
int obs_chunk(obs_state *s, const uint8_t *records, int64_t n);
void obs_free(obs_state *s);
"""

N_DISTANCES = TRACE_MAX_DISTANCE + 1  # counters per layer: distance 0 (unpredicted records), 1..3

# the counters' order in the C arrays (OBS_C_*, OBS_F_*): LayerCounts' fields, split by type
INT_COUNTERS = (
    "records",
    "tokens",
    "actual",
    "hits_used",
    "hits_depth",
    "hits_read",
    "read",
    "gated",
    "exact",
    "base_tokens",
    "base_actual",
    "base_hits",
)
FLOAT_COUNTERS = ("mass_hit", "mass")
# the control's counters (OBS_I_*), in stats._ISSUES' order
ISSUE_COUNTERS = (
    "layer_range",
    "actual_range",
    "actual_dup",
    "actual_w",
    "n_read_depth",
    "unpredicted",
    "pred_mode_off",
    "pred_mask",
    "pred_range",
    "pred_dup",
    "pred_unranked",
    "pred_n_read",
)


class StatsKernelError(RuntimeError):
    """The kernel could not be built or run."""


@cache
def load_kernel() -> tuple[Any, Any]:
    """``(ffi, lib)`` of the kernel, compiled once per source into the cache."""
    source = SOURCE.read_text()
    try:
        ffi, lib = load_cffi_module(MODULE, CDEF, source, compile_args=COMPILE_ARGS)
    except CffiBuildError as e:
        raise StatsKernelError(
            f"onebit-stats needs a C compiler (and the Python headers) to build its kernel "
            f"{SOURCE.name} once; {e}. Install one (e.g. gcc), or call "
            f"compute_stats(..., engine='numpy') for the slower numpy engine"
        ) from e
    sizes = (lib.OBS_N_INT, lib.OBS_N_FLOAT, lib.OBS_N_ISSUES, lib.OBS_N_DIST)
    if sizes != (len(INT_COUNTERS), len(FLOAT_COUNTERS), len(ISSUE_COUNTERS), N_DISTANCES):
        raise StatsKernelError(f"{SOURCE.name} counts {sizes}, stats_kernel.py expects other counters")
    return ffi, lib


class StatsKernel:
    """Counters of one trace, fed chunk by chunk in file order.

    ``ints`` and ``floats`` are ``(counter, distance, layer)``: distance 0 the unpredicted
    records, 1..3 the PREDICTED ones by their lookahead distance (always 1 before version 3).
    """

    def __init__(self, header: TraceHeader, predictable: np.ndarray) -> None:
        """``predictable``: bool by layer id (0..65535), the header's layer mask."""
        self._ffi, self._lib = load_kernel()
        h = header
        self.record_size = h.record_size
        self.ints = np.zeros((len(INT_COUNTERS), N_DISTANCES, h.n_layer), dtype=np.int64)
        self.floats = np.zeros((len(FLOAT_COUNTERS), N_DISTANCES, h.n_layer), dtype=np.float64)
        self.issues = np.zeros(len(ISSUE_COUNTERS), dtype=np.int64)
        mask = np.ascontiguousarray(predictable, dtype=np.uint8)
        if mask.shape != (self._lib.OBS_N_LAYER_IDS,):
            raise ValueError(f"predictable has shape {mask.shape}, not ({self._lib.OBS_N_LAYER_IDS},)")
        ffi = self._ffi
        state = self._lib.obs_new(
            h.n_layer,
            h.n_expert,
            h.n_expert_used,
            h.depth,
            h.margin,
            h.min_read,
            int(h.mode == MODE_OFF),
            int(not h.has_distance),
            ffi.from_buffer("uint8_t[]", mask),
            ffi.from_buffer("int64_t[]", self.ints),
            ffi.from_buffer("double[]", self.floats),
            ffi.from_buffer("int64_t[]", self.issues),
        )
        if state == ffi.NULL:
            raise MemoryError("onebit-stats kernel: no memory for its state")
        self._state = ffi.gc(state, self._lib.obs_free)

    def feed(self, chunk: np.ndarray) -> None:
        """Score the records of ``chunk`` (contiguous, in the header's dtype), after every earlier chunk."""
        if chunk.dtype.itemsize != self.record_size or not chunk.flags.c_contiguous:
            raise ValueError("feed() takes a contiguous array of whole records of this trace")
        rc = self._lib.obs_chunk(self._state, self._ffi.from_buffer("uint8_t[]", chunk.view(np.uint8)), len(chunk))
        if rc == -1:
            raise MemoryError("onebit-stats kernel: out of memory")
        if rc == -3:  # iter_chunks refuses these first, with the record named (trace.record_distances)
            raise TraceError(f"a record's distance is out of its bounds (1..{TRACE_MAX_DISTANCE}, at most its layer)")
        if rc != 0:
            raise StatsKernelError(f"onebit-stats kernel: obs_chunk failed ({rc})")
