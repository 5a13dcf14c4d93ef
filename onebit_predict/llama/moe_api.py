"""The C API for the predictor's settings (include/onebit-moe.h of the patched tree), bound with
ctypes next to llama-cpp-python's own bindings.

``struct onebit_moe_params`` holds one string per knob, the text of its ONEBIT_* variable;
``onebit_init_from_model(model, params, &moe)`` creates a context with them. Precedence, knob
by knob: a value given here wins (``""`` means the default); a knob left NULL falls back to its
ONEBIT_* environment variable (policy.resolve_knob is the same rule in Python).
tests/test_abi.py holds these structures to the C layout, field by field.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from typing import Any

from ..constants import (
    ENV_AHEAD,
    ENV_COMPENSATOR,
    ENV_DEBUG_LEAK,
    ENV_DEBUG_SELF,
    ENV_DEPTH,
    ENV_LAYERS,
    ENV_LEARNED,
    ENV_MARGIN,
    ENV_MIN,
    ENV_MODE,
    ENV_NO_ATTN,
    ENV_OUT,
    ENV_PREFETCH,
    ENV_PREFETCH_DEBUG_DRAIN,
    ENV_PREFETCH_DEBUG_HANDBACK,
    ENV_PREFETCH_DEBUG_KEEP_CAP,
    ENV_PREFETCH_DEBUG_ORACLE,
    ENV_PREFETCH_GUARD,
    ENV_PREFETCH_KEEP,
    ENV_PREFETCH_LAYERS,
    ENV_PREFETCH_MAX_BYTES,
    ENV_PREFETCH_ORDER,
    ENV_PREFETCH_RANDOM,
    ENV_PREFETCH_ROOM,
    ENV_PREFETCH_ROUTE,
    ENV_PREFETCH_THREADS,
    ENV_PREFETCH_WAIT,
    ENV_STATS,
)

# the struct's fields in C order, each with the variable it stands for
FIELDS: tuple[tuple[str, str], ...] = (
    ("predict", ENV_MODE),
    ("depth", ENV_DEPTH),
    ("margin", ENV_MARGIN),
    ("min", ENV_MIN),
    ("layers", ENV_LAYERS),
    ("no_attn", ENV_NO_ATTN),
    ("out", ENV_OUT),
    ("stats", ENV_STATS),
    ("prefetch", ENV_PREFETCH),
    ("prefetch_max_bytes", ENV_PREFETCH_MAX_BYTES),
    ("prefetch_threads", ENV_PREFETCH_THREADS),
    ("debug_self", ENV_DEBUG_SELF),
    ("debug_leak", ENV_DEBUG_LEAK),
    ("prefetch_debug_drain", ENV_PREFETCH_DEBUG_DRAIN),
    ("predict_ahead", ENV_AHEAD),
    ("prefetch_guard", ENV_PREFETCH_GUARD),
    ("prefetch_debug_oracle", ENV_PREFETCH_DEBUG_ORACLE),
    ("predict_learned", ENV_LEARNED),
    ("prefetch_room", ENV_PREFETCH_ROOM),
    ("prefetch_route", ENV_PREFETCH_ROUTE),
    ("prefetch_random", ENV_PREFETCH_RANDOM),
    ("compensator", ENV_COMPENSATOR),
    ("prefetch_wait", ENV_PREFETCH_WAIT),
    ("prefetch_keep", ENV_PREFETCH_KEEP),
    ("prefetch_debug_keep_cap", ENV_PREFETCH_DEBUG_KEEP_CAP),
    ("prefetch_order", ENV_PREFETCH_ORDER),
    ("prefetch_layers", ENV_PREFETCH_LAYERS),
    ("prefetch_debug_handback", ENV_PREFETCH_DEBUG_HANDBACK),
)


class OnebitMoeParams(ctypes.Structure):
    """``struct onebit_moe_params``."""

    _fields_ = [(name, ctypes.c_char_p) for name, _ in FIELDS]


def moe_params(settings: Mapping[str, str | None]) -> OnebitMoeParams:
    """The struct for ``settings`` keyed by variable name: a value is given as is, None as ``""``
    (the default, whatever the environment says); a variable not in ``settings`` stays NULL and
    so falls back to the environment."""
    p = OnebitMoeParams()
    for name, env in FIELDS:
        if env in settings:
            setattr(p, name, (settings[env] or "").encode())
    return p


def bind(lib: Any) -> Any:
    """``onebit_init_from_model`` of the llama_cpp module's shared library, typed."""
    fn = lib.llama_cpp._lib.onebit_init_from_model  # the CDLL llama-cpp-python loaded
    fn.argtypes = [lib.llama_model_p_ctypes, lib.llama_context_params, ctypes.POINTER(OnebitMoeParams)]
    fn.restype = lib.llama_context_p_ctypes
    return fn
