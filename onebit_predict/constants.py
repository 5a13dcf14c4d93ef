"""Constants shared by the sidecar: environment names, trace layout, exit codes.

Every number that must match the C++ side (docs/trace-format.md, docs/policy.md) is
defined here once.
"""

from __future__ import annotations

# --- environment (docs/policy.md) -------------------------------------------------------
ENV_MODE = "ONEBIT_MOE_PREDICT"
ENV_DEPTH = "ONEBIT_MOE_PREDICT_DEPTH"
ENV_MARGIN = "ONEBIT_MOE_PREDICT_MARGIN"
ENV_MIN = "ONEBIT_MOE_PREDICT_MIN"
ENV_LAYERS = "ONEBIT_MOE_PREDICT_LAYERS"
ENV_NO_ATTN = "ONEBIT_MOE_PREDICT_NO_ATTN"
ENV_OUT = "ONEBIT_MOE_PREDICT_OUT"
ENV_STATS = "ONEBIT_MOE_PREDICT_STATS"

MODE_OFF = 0
MODE_ROUTER = 1
MODE_BLOCK = 2
MODE_NAMES = {MODE_OFF: "off", MODE_ROUTER: "router", MODE_BLOCK: "block"}

MAX_LAYERS = 512  # LLAMA_MAX_LAYERS, and the width of the trace's layer mask

# --- trace (docs/trace-format.md) -------------------------------------------------------
TRACE_MAGIC = b"OBMPTRC\x00"
TRACE_VERSION = 1
TRACE_HEADER_SIZE = 512
TRACE_RECORD_FIXED = 20  # bytes before the per-expert arrays
TRACE_FLAG_PREDICTED = 1 << 0
TRACE_FLAG_DECODE = 1 << 1
TRACE_HDR_FLAG_NO_ATTN = 1 << 0
TRACE_HDR_FLAG_STATS = 1 << 1
TRACE_HDR_FLAG_DEBUG_SELF = 1 << 2
TRACE_ARCH_BYTES = 32  # NUL-padded
TRACE_MODEL_BYTES = 256  # NUL-padded, at most 255 bytes of text
TRACE_CHUNK_RECORDS = 1 << 14  # records a reader holds at once (bounded memory)

# --- command exit codes (as llama.cpp tools) --------------------------------------------
EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_USAGE = 2
