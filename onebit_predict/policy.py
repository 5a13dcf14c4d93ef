"""The ONEBIT_MOE_PREDICT environment policy, the exact twin of llama.cpp's C++ one.

It covers the predictor (``parse_policy``) and the prefetch consumer (``parse_prefetch``,
ONEBIT_MOE_PREFETCH*), as ``onebit_policy_parse`` and ``onebit_prefetch_parse`` do in C.

``src/onebit-moe-policy.cpp`` in the patched tree parses the environment when a context is
created; this module makes the same decisions and the same warnings, byte for byte, so
the sidecar can tell what a run did from its environment alone. The grammar, resolution
and warning texts are specified in docs/policy.md; tests/test_policy_parity.py and
tests/test_prefetch_policy.py hold the two implementations to the same answers through cffi.

Only ASCII counts: whitespace is `` \\t\\n\\r\\f\\v``, digits are ``0-9``, letters are
lower-cased ASCII only (``str.strip``, ``str.isdigit`` and ``str.lower`` are all wider).
Floats are binary32, as in C.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .constants import (
    AHEAD_MAX,
    ENV_AHEAD,
    ENV_DEPTH,
    ENV_LAYERS,
    ENV_MARGIN,
    ENV_MIN,
    ENV_MODE,
    ENV_NO_ATTN,
    ENV_PREFETCH,
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
    KEEP_ANON,
    KEEP_KERNEL,
    KEEP_LRU,
    KEEP_NAMES,
    MAX_LAYERS,
    MODE_NAMES,
    MODE_OFF,
    ORDER_HITS,
    ORDER_INDEX,
    ORDER_NAMES,
    PREFETCH_ADVISE,
    PREFETCH_GUARD_DEFAULT,
    PREFETCH_GUARD_MAX,
    PREFETCH_LAYERS_MAX,
    PREFETCH_MAX_BYTES_LIMIT,
    PREFETCH_NAMES,
    PREFETCH_OFF,
    PREFETCH_PREAD,
    PREFETCH_ROOM_DEFAULT,
    PREFETCH_ROOM_MAX,
    PREFETCH_ROUTE_CALL,
    PREFETCH_THREADS_DEFAULT,
    PREFETCH_THREADS_MAX,
)

ASCII_SPACE = " \t\n\r\f\v"
ASCII_DIGITS = "0123456789"
MAX_DIGITS = 9  # 1..9 digits always fit an int32
BOOL_TRUE = ("1", "true", "yes", "on")
BOOL_FALSE = ("0", "false", "no", "off")
MODES = {name: mode for mode, name in MODE_NAMES.items()}
PREFETCH_MODES = {name: mode for mode, name in PREFETCH_NAMES.items()}
KEEP_MODES = {name: keep for keep, name in KEEP_NAMES.items()}
ORDER_MODES = {name: order for order, name in ORDER_NAMES.items()}
MAX_BYTE_DIGITS = 12  # 12 digits times 2^30 still fits an int64 in C
BYTE_UNITS = {"": 1, "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gib": 1 << 30}


class Env(NamedTuple):
    """The raw environment, one string per knob; None when the variable is unset."""

    mode: str | None = None  # ONEBIT_MOE_PREDICT
    depth: str | None = None  # ONEBIT_MOE_PREDICT_DEPTH
    margin: str | None = None  # ONEBIT_MOE_PREDICT_MARGIN
    min: str | None = None  # ONEBIT_MOE_PREDICT_MIN
    layers: str | None = None  # ONEBIT_MOE_PREDICT_LAYERS
    no_attn: str | None = None  # ONEBIT_MOE_PREDICT_NO_ATTN
    stats: str | None = None  # ONEBIT_MOE_PREDICT_STATS
    ahead: str | None = None  # ONEBIT_MOE_PREDICT_AHEAD

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> Env:
        names = (ENV_MODE, ENV_DEPTH, ENV_MARGIN, ENV_MIN, ENV_LAYERS, ENV_NO_ATTN, ENV_STATS, ENV_AHEAD)
        return cls(*(environ.get(name) for name in names))


@dataclass(frozen=True)
class Policy:
    """The policy as parsed and resolved against one model (C ``struct onebit_policy``)."""

    mode: int  # MODE_OFF, MODE_ROUTER or MODE_BLOCK
    depth_requested: int  # _DEPTH as parsed, 0 when unset or ignored
    depth: int  # effective depth, in [1, n_expert]
    margin: float  # a binary32 value; math.inf when there is no gate
    min_requested: int  # _MIN as parsed, -1 when unset or ignored
    min_read: int  # effective floor, in [0, depth]
    no_attn: bool
    stats: bool
    n_layer_predicted: int  # len(layer_mask)
    layer_mask: frozenset[int]  # the layers l predicted (from layer l-ahead)
    ahead: int = 1  # layers between the predicting layer and the predicted one, in [1, AHEAD_MAX]

    @property
    def predicted_layers(self) -> tuple[int, ...]:
        return tuple(sorted(self.layer_mask))


def _trim(s: str | None) -> str:
    return (s or "").strip(ASCII_SPACE)


def _lower_ascii(s: str) -> str:
    return "".join(chr(ord(c) + 32) if "A" <= c <= "Z" else c for c in s)


def _count_digits(s: str, i: int) -> int:
    n = 0
    while i + n < len(s) and s[i + n] in ASCII_DIGITS:
        n += 1
    return n


def _parse_digits(s: str) -> int | None:
    if not 1 <= len(s) <= MAX_DIGITS or _count_digits(s, 0) != len(s):
        return None
    return int(s)


def _parse_uint(t: str) -> int | None:
    return _parse_digits(t[1:] if t.startswith("+") else t)


def _parse_nonneg_float(t: str) -> float | None:
    i = 1 if t.startswith("+") else 0
    n_int = _count_digits(t, i)
    i += n_int
    n_frac = 0
    if t[i : i + 1] == ".":
        n_frac = _count_digits(t, i + 1)
        i += 1 + n_frac
    if n_int == 0 and n_frac == 0:
        return None
    if t[i : i + 1] in ("e", "E"):
        i += 1
        if t[i : i + 1] in ("+", "-"):
            i += 1
        n_exp = _count_digits(t, i)
        if n_exp == 0:
            return None
        i += n_exp
    if i != len(t):
        return None
    with np.errstate(over="ignore"):
        value = np.float32(float(t))  # through a double, like (float) strtod
    return float(value) if math.isfinite(value) else None


def _parse_bool(name: str, raw: str | None, warnings: list[str]) -> bool:
    t = _lower_ascii(_trim(raw))
    if t in BOOL_TRUE:
        return True
    if t and t not in BOOL_FALSE:
        warnings.append(f"{name}='{raw}' is not one of 1|0|true|false|yes|no|on|off; using 0")
    return False


def _parse_choice(name: str, raw: str | None, choices: Mapping[str, int], warnings: list[str]) -> int:
    """One of choices (by name, the default first: "off", "kernel", "index"), blank for the default; anything
    else warns and is the default."""
    t = _lower_ascii(_trim(raw))
    if t in choices:
        return choices[t]
    default = next(iter(choices))
    if t:
        warnings.append(f"{name}='{raw}' is not one of {'|'.join(choices)}; using {default}")
    return choices[default]


def _parse_mode(raw: str | None, warnings: list[str]) -> int:
    return _parse_choice(ENV_MODE, raw, MODES, warnings)


def layer_range(item: str) -> tuple[int, int] | None:
    """One item of a layer list, ``N`` or ``A-B`` (ASCII digits, at most MAX_DIGITS each), as
    (first, last), a reversed range as given; None when it is neither (the grammar of the
    layer lists in docs/policy.md, shared with the commands' ``--layers``)."""
    lo, dash, hi = item.partition("-")
    a = _parse_digits(lo)
    b = _parse_digits(hi) if dash else a
    if a is None or b is None:
        return None
    return a, b


def _parse_layer_item(item: str, n_layer: int, first: int, mask: set[int], warnings: list[str]) -> None:
    if not item:
        warnings.append(f"{ENV_LAYERS} has an empty item; ignored")
        return
    bounds = layer_range(item)
    if bounds is None:
        warnings.append(f"{ENV_LAYERS} item '{item}' is not N or A-B; ignored")
        return
    a, b = bounds
    if a > b:
        warnings.append(f"{ENV_LAYERS} item '{item}' is a reversed range; ignored")
        return
    if b >= n_layer:
        warnings.append(f"{ENV_LAYERS} item '{item}' is out of range (the model has layers 0..{n_layer - 1}); ignored")
        return
    if a == 0 and first == 1:
        warnings.append(f"{ENV_LAYERS} item '{item}' includes layer 0, which has no layer before it; layer 0 ignored")
        a = 1
    elif a < first:
        warnings.append(
            f"{ENV_LAYERS} item '{item}' includes layers below {first}, which have no layer {first} before them "
            f"({ENV_AHEAD}={first}); those ignored"
        )
        a = first
    mask.update(range(a, b + 1))


def parse_layers(spec: str | None, n_layer: int, first: int = 1) -> tuple[frozenset[int], list[str]]:
    """The layers a layer list predicts ("1,2,5-9,47"); None or blank predicts every layer from
    ``first`` (the lookahead K: layers below it have no layer K before them)."""
    n_layer = min(n_layer, MAX_LAYERS)
    t = _trim(spec)
    if not t:
        return frozenset(range(first, n_layer)), []
    mask: set[int] = set()
    warnings: list[str] = []
    for item in t.split(","):
        _parse_layer_item(_trim(item), n_layer, first, mask, warnings)
    if not mask:
        warnings.append(f"{ENV_LAYERS}='{spec}' leaves no layer to predict; predicting none")
    return frozenset(mask), warnings


def resolve_knob(api: str | None, environ: str | None) -> str | None:
    """The text one knob takes when a context is created (include/onebit-moe.h): the C API's
    value when it gives one (``""`` is the default, whatever the environment says), else the
    ONEBIT_* variable's (None: unset, the default)."""
    return api if api is not None else environ


def effective_depth(depth_requested: int, n_expert: int, n_expert_used: int) -> int:
    """The depth actually ranked: the request (0 = n_expert_used), clamped to [1, n_expert]."""
    if n_expert < 1:
        return 0
    depth = depth_requested if depth_requested > 0 else n_expert_used
    return max(1, min(depth, n_expert))


def effective_min(min_requested: int, depth: int, n_expert_used: int) -> int:
    """The floor: the request (-1 = n_expert_used), clamped to [0, depth]."""
    floor = min_requested if min_requested >= 0 else n_expert_used
    return max(0, min(floor, depth))


def n_read_rows(logits: np.ndarray, margin: float, min_read: int) -> np.ndarray:
    """Candidates read of each ranked row of a [rows, depth] array (best first): the leading
    run with ``logits[0] - logits[i] <= margin`` (all of them with no margin), raised to
    min_read, never above the depth; binary32 arithmetic, as in C."""
    rows, depth = logits.shape
    if math.isinf(margin) and margin > 0:
        run = np.full(rows, depth)
    else:
        logits = logits.astype(np.float32, copy=False)
        with np.errstate(over="ignore", invalid="ignore"):
            ok = (logits[:, :1] - logits) <= np.float32(margin)
        run = np.where(ok.all(axis=1), depth, ok.argmin(axis=1))
    return np.clip(run, min_read, depth)


def n_read(logits: Sequence[float], depth: int, margin: float, min_read: int) -> int:
    """n_read_rows of one row, cut to depth (onebit_n_read in C)."""
    if depth <= 0:
        return 0
    row = np.asarray(logits[:depth], dtype=np.float32).reshape(1, depth)
    return int(n_read_rows(row, margin, min_read)[0])


def parse_policy(env: Env, n_layer: int, n_expert: int, n_expert_used: int) -> tuple[Policy, list[str]]:
    """Parse every knob and resolve it against the model; the warnings come in C's order."""
    warnings: list[str] = []
    mode = _parse_mode(env.mode, warnings)

    depth_requested = 0
    t = _trim(env.depth)
    if t:
        v = _parse_uint(t)
        if v is None:
            warnings.append(f"{ENV_DEPTH}='{env.depth}' is not a non-negative integer; ignored")
        elif v == 0:
            warnings.append(f"{ENV_DEPTH}=0 must be at least 1; ignored")
        else:
            depth_requested = v
    depth = effective_depth(depth_requested, n_expert, n_expert_used)
    if depth_requested > n_expert:
        warnings.append(f"{ENV_DEPTH}={depth_requested} exceeds n_expert={n_expert}; clamped to {depth}")

    margin = math.inf
    t = _trim(env.margin)
    if t:
        v = _parse_nonneg_float(t)
        if v is None:
            warnings.append(f"{ENV_MARGIN}='{env.margin}' is not a finite non-negative number; ignored (no gate)")
        else:
            margin = v

    min_requested = -1
    t = _trim(env.min)
    if t:
        v = _parse_uint(t)
        if v is None:
            warnings.append(f"{ENV_MIN}='{env.min}' is not a non-negative integer; ignored")
        else:
            min_requested = v
    min_read = effective_min(min_requested, depth, n_expert_used)
    if min_requested > depth:
        warnings.append(f"{ENV_MIN}={min_requested} exceeds the depth {depth}; clamped to {min_read}")

    ahead = 1
    t = _trim(env.ahead)
    if t:
        v = _parse_uint(t)
        if v is None:
            warnings.append(f"{ENV_AHEAD}='{env.ahead}' is not a positive integer; using 1")
        elif v == 0:
            warnings.append(f"{ENV_AHEAD}=0 must be at least 1; using 1")
        elif v > AHEAD_MAX:
            warnings.append(f"{ENV_AHEAD}={v} exceeds {AHEAD_MAX}; clamped to {AHEAD_MAX}")
            ahead = AHEAD_MAX
        else:
            ahead = v

    layer_mask, layer_warnings = parse_layers(env.layers, n_layer, ahead)
    warnings += layer_warnings
    no_attn = _parse_bool(ENV_NO_ATTN, env.no_attn, warnings)
    stats = _parse_bool(ENV_STATS, env.stats, warnings)

    policy = Policy(
        mode=mode,
        depth_requested=depth_requested,
        depth=depth,
        margin=margin,
        min_requested=min_requested,
        min_read=min_read,
        no_attn=no_attn,
        stats=stats,
        n_layer_predicted=len(layer_mask),
        layer_mask=layer_mask,
        ahead=ahead,
    )
    return policy, warnings


class PrefetchEnv(NamedTuple):
    """The prefetch consumer's raw environment, one string per knob; None when unset."""

    mode: str | None = None  # ONEBIT_MOE_PREFETCH
    max_bytes: str | None = None  # ONEBIT_MOE_PREFETCH_MAX_BYTES
    threads: str | None = None  # ONEBIT_MOE_PREFETCH_THREADS
    guard: str | None = None  # ONEBIT_MOE_PREFETCH_GUARD
    room: str | None = None  # ONEBIT_MOE_PREFETCH_ROOM
    route: str | None = None  # ONEBIT_MOE_PREFETCH_ROUTE
    random: str | None = None  # ONEBIT_MOE_PREFETCH_RANDOM
    wait: str | None = None  # ONEBIT_MOE_PREFETCH_WAIT
    keep: str | None = None  # ONEBIT_MOE_PREFETCH_KEEP
    order: str | None = None  # ONEBIT_MOE_PREFETCH_ORDER
    layers: str | None = None  # ONEBIT_MOE_PREFETCH_LAYERS

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> PrefetchEnv:
        names = (
            ENV_PREFETCH,
            ENV_PREFETCH_MAX_BYTES,
            ENV_PREFETCH_THREADS,
            ENV_PREFETCH_GUARD,
            ENV_PREFETCH_ROOM,
            ENV_PREFETCH_ROUTE,
            ENV_PREFETCH_RANDOM,
            ENV_PREFETCH_WAIT,
            ENV_PREFETCH_KEEP,
            ENV_PREFETCH_ORDER,
            ENV_PREFETCH_LAYERS,
        )
        return cls(*(environ.get(name) for name in names))


@dataclass(frozen=True)
class PrefetchPolicy:
    """The prefetch consumer as parsed (C ``struct onebit_prefetch_policy``)."""

    mode: int  # the workers' call: PREFETCH_OFF, PREFETCH_ADVISE, PREFETCH_READ, PREFETCH_POPULATE or PREFETCH_PREAD
    n_threads: int  # read-mode workers, in [1, PREFETCH_THREADS_MAX]
    max_bytes: int  # cap on speculative bytes per token of a ubatch, 0 = no cap
    guard: int = PREFETCH_GUARD_DEFAULT  # tokens per probe of the guard, 0 = no guard
    room: float = PREFETCH_ROOM_DEFAULT  # a binary32 value: the room rule's ratio, 0 = no rule
    speculative: bool = False  # read the predicted experts ahead of their layer (a call and a predictor)
    route: bool = False  # read each layer's routed experts as soon as its router ran (route time)
    random: bool = False  # readahead off on the expert tensors (MADV_RANDOM): faults read single pages
    wait: bool = False  # the route-time op waits for its layer's reads: the matmuls never fault on a routed expert
    keep: int = KEEP_KERNEL  # what decides which experts stay cached (KEEP_NAMES)
    order: int = ORDER_INDEX  # the order of a layer's route-time reads and expert matmuls (ORDER_NAMES)
    layers: int = 0  # whole layers a batch's route-time op reads ahead, 0 = off


def prefetch_mode_name(mode: int) -> str:
    """The name of a consumer mode, "off" for any value that is not one (onebit_prefetch_mode_name in C)."""
    return PREFETCH_NAMES.get(mode, PREFETCH_NAMES[PREFETCH_OFF])


def _parse_prefetch_mode(raw: str | None, warnings: list[str]) -> int:
    return _parse_choice(ENV_PREFETCH, raw, PREFETCH_MODES, warnings)


def _parse_byte_count(t: str) -> int | None:
    """1..12 ASCII digits, then an optional k|m|g|kib|mib|gib (t is already lower-cased); at most 1 TiB."""
    n = _count_digits(t, 0)
    if not 1 <= n <= MAX_BYTE_DIGITS:
        return None
    unit = BYTE_UNITS.get(t[n:])
    if unit is None:
        return None
    v = int(t[:n])
    if v > PREFETCH_MAX_BYTES_LIMIT // unit:
        return None
    return v * unit


def _parse_capped(name: str, raw: str | None, default: int, cap: int, warnings: list[str]) -> int:
    """A non-negative integer knob clamped to cap (C's parse of _GUARD and _LAYERS): unset or blank is
    the default, as is a value that is not such an integer (warned); above cap it is clamped (warned)."""
    t = _trim(raw)
    if not t:
        return default
    v = _parse_uint(t)
    if v is None:
        warnings.append(f"{name}='{raw}' is not a non-negative integer; using {default}")
        return default
    if v > cap:
        warnings.append(f"{name}={v} exceeds {cap}; clamped to {cap}")
        return cap
    return v


class _Reads(NamedTuple):
    """What the consumer reads and with which call (the first fields onebit_prefetch_parse sets)."""

    mode: int  # the workers' call
    speculative: bool  # predicted experts, ahead of their layer
    route: bool  # each layer's routed experts, at route time
    random: bool  # readahead off on the expert tensors
    wait: bool  # the route-time op waits for its layer's reads
    keep: int  # what decides which experts stay cached
    order: int  # the order of a layer's route-time reads and expert matmuls
    layers: int  # whole layers a batch's route-time op reads ahead


def _parse_reads(env: PrefetchEnv, predict_mode: int, warnings: list[str]) -> _Reads:
    """ONEBIT_MOE_PREFETCH, _ROUTE, _RANDOM, _WAIT, _KEEP, _ORDER and _LAYERS: speculative reads need
    a call and a predictor; route-time reads need neither and use PREFETCH_ROUTE_CALL when no call is
    named; readahead off needs the consumer on; the wait needs route-time reads by a call that
    finishes them; keep=lru, order=hits and layers need route-time reads (any call); keep=anon needs them
    by pread, and implies the wait unless order=hits."""
    mode = _parse_prefetch_mode(env.mode, warnings)
    route = _parse_bool(ENV_PREFETCH_ROUTE, env.route, warnings)
    random = _parse_bool(ENV_PREFETCH_RANDOM, env.random, warnings)
    if mode != PREFETCH_OFF and predict_mode == MODE_OFF and not route:
        warnings.append(
            f"{ENV_PREFETCH}={prefetch_mode_name(mode)} needs {ENV_MODE}=router, block or learned, "
            f"or {ENV_PREFETCH_ROUTE}=1; using off"
        )
        mode = PREFETCH_OFF
    speculative = mode != PREFETCH_OFF and predict_mode != MODE_OFF
    if route and mode == PREFETCH_OFF:
        mode = PREFETCH_ROUTE_CALL  # route-time reads without a named call
    if random and mode == PREFETCH_OFF:
        warnings.append(
            f"{ENV_PREFETCH_RANDOM}=1 needs the consumer on ({ENV_PREFETCH} or {ENV_PREFETCH_ROUTE}); ignored"
        )
        random = False
    wait = _parse_bool(ENV_PREFETCH_WAIT, env.wait, warnings)
    if wait and (not route or mode == PREFETCH_ADVISE):
        warnings.append(
            f"{ENV_PREFETCH_WAIT}=1 needs route-time reads ({ENV_PREFETCH_ROUTE}=1) by a call that "
            "finishes them (read, populate or pread, not advise); ignored"
        )
        wait = False
    keep = _parse_choice(ENV_PREFETCH_KEEP, env.keep, KEEP_MODES, warnings)
    if keep != KEEP_KERNEL and not route:
        warnings.append(
            f"{ENV_PREFETCH_KEEP}={KEEP_NAMES[keep]} needs route-time reads ({ENV_PREFETCH_ROUTE}=1); ignored"
        )
        keep = KEEP_KERNEL
    if keep == KEEP_ANON and mode != PREFETCH_PREAD:
        warnings.append(f"{ENV_PREFETCH_KEEP}=anon reads with pread ({ENV_PREFETCH}=pread); using lru")
        keep = KEEP_LRU
    order = _parse_choice(ENV_PREFETCH_ORDER, env.order, ORDER_MODES, warnings)
    if order != ORDER_INDEX and not route:
        warnings.append(f"{ENV_PREFETCH_ORDER}=hits needs route-time reads ({ENV_PREFETCH_ROUTE}=1); ignored")
        order = ORDER_INDEX
    if keep == KEEP_ANON and order != ORDER_HITS:
        # the matmuls must not fault in, through the page cache, a slice a worker reads into memory of its
        # own: the layer waits for its reads, or (order=hits) each expert's matmul for its own
        wait = True
    layers = _parse_capped(ENV_PREFETCH_LAYERS, env.layers, 0, PREFETCH_LAYERS_MAX, warnings)
    if layers > 0 and not route:
        warnings.append(f"{ENV_PREFETCH_LAYERS}={layers} needs route-time reads ({ENV_PREFETCH_ROUTE}=1); ignored")
        layers = 0
    return _Reads(mode, speculative, route, random, wait, keep, order, layers)


def parse_prefetch(env: PrefetchEnv, predict_mode: int) -> tuple[PrefetchPolicy, list[str]]:
    """Parse the prefetch consumer's knobs (onebit_prefetch_parse in C); predict_mode is the parsed
    ONEBIT_MOE_PREDICT: speculative reads need a predictor, route-time reads do not. The warnings
    come in C's order."""
    warnings: list[str] = []
    reads = _parse_reads(env, predict_mode, warnings)

    max_bytes = 0
    t = _lower_ascii(_trim(env.max_bytes))
    if t:
        v = _parse_byte_count(t)
        if v is None:
            warnings.append(
                f"{ENV_PREFETCH_MAX_BYTES}='{env.max_bytes}' is not a byte count "
                "(N, Nk, Nm or Ng, at most 1 TiB); no cap"
            )
        else:
            max_bytes = v

    n_threads = PREFETCH_THREADS_DEFAULT
    t = _trim(env.threads)
    if t:
        v = _parse_uint(t)
        if v is None:
            warnings.append(
                f"{ENV_PREFETCH_THREADS}='{env.threads}' is not a non-negative integer; "
                f"using {PREFETCH_THREADS_DEFAULT}"
            )
        elif v == 0:
            warnings.append(f"{ENV_PREFETCH_THREADS}=0 must be at least 1; using {PREFETCH_THREADS_DEFAULT}")
        elif v > PREFETCH_THREADS_MAX:
            warnings.append(
                f"{ENV_PREFETCH_THREADS}={v} exceeds {PREFETCH_THREADS_MAX}; clamped to {PREFETCH_THREADS_MAX}"
            )
            n_threads = PREFETCH_THREADS_MAX
        else:
            n_threads = v

    guard = _parse_capped(ENV_PREFETCH_GUARD, env.guard, PREFETCH_GUARD_DEFAULT, PREFETCH_GUARD_MAX, warnings)

    room = PREFETCH_ROOM_DEFAULT
    t = _trim(env.room)
    if t:
        v = _parse_nonneg_float(t)
        if v is None:
            warnings.append(
                f"{ENV_PREFETCH_ROOM}='{env.room}' is not a finite non-negative number; using {PREFETCH_ROOM_DEFAULT:g}"
            )
        elif v > PREFETCH_ROOM_MAX:
            warnings.append(
                f"{ENV_PREFETCH_ROOM}='{env.room}' exceeds {PREFETCH_ROOM_MAX:g}; clamped to {PREFETCH_ROOM_MAX:g}"
            )
            room = PREFETCH_ROOM_MAX
        else:
            room = v
    policy = PrefetchPolicy(
        mode=reads.mode,
        n_threads=n_threads,
        max_bytes=max_bytes,
        guard=guard,
        room=room,
        speculative=reads.speculative,
        route=reads.route,
        random=reads.random,
        wait=reads.wait,
        keep=reads.keep,
        order=reads.order,
        layers=reads.layers,
    )
    return policy, warnings
