"""The prefetch consumer's policy (ONEBIT_MOE_PREFETCH*): onebit_predict.policy.parse_prefetch
against every `prefetch` case of ctest_port/cases.tsv and its exact warning texts; then the C++
onebit_prefetch_parse (through cffi) against the same cases, and against the Python policy on
random and malformed environments: same fields, same warnings.

The C half needs the patched tree (ONEBIT_LLAMA_TREE, or the tree build.sh recorded; the
``c_policy`` fixture marks it needs_build), which one pin makes the tree of the series: its
src/onebit-moe-policy.h declares onebit_prefetch_parse, and a tree that does not fails to build
the module, never skips. The Python half needs no tree."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctest_port.cases import GuardCase, PrefetchCase, RoomCase, read_cases
from onebit_predict import constants as k
from onebit_predict.policy import PrefetchEnv, PrefetchPolicy, parse_prefetch

CASES = [c for c in read_cases() if isinstance(c, PrefetchCase)]
WARN_CAP = 1 << 16
LIMIT = k.PREFETCH_MAX_BYTES_LIMIT


def prefetch_cases() -> pytest.MarkDecorator:
    return pytest.mark.parametrize("case", CASES, ids=lambda c: f"line{c.line}")


# --- the Python policy ---------------------------------------------------------------------


def test_there_are_prefetch_cases() -> None:
    assert len(CASES) >= 40


@prefetch_cases()
def test_parse_prefetch(case: PrefetchCase) -> None:
    p, warnings = parse_prefetch(case.env, case.predict_mode)
    assert (p.mode, p.max_bytes, p.n_threads, len(warnings)) == case[3:]


def test_from_environ() -> None:
    environ = {
        "ONEBIT_MOE_PREFETCH": "read",
        "ONEBIT_MOE_PREFETCH_MAX_BYTES": "64m",
        "ONEBIT_MOE_PREFETCH_THREADS": "4",
        "ONEBIT_MOE_PREDICT": "router",
    }
    assert PrefetchEnv.from_environ(environ) == PrefetchEnv("read", "64m", "4")
    assert PrefetchEnv.from_environ({}) == PrefetchEnv()
    assert parse_prefetch(PrefetchEnv.from_environ(environ), k.MODE_ROUTER) == (
        PrefetchPolicy(mode=k.PREFETCH_READ, n_threads=4, max_bytes=64 << 20),
        [],
    )


def test_defaults() -> None:
    assert parse_prefetch(PrefetchEnv(), k.MODE_OFF) == (
        PrefetchPolicy(mode=k.PREFETCH_OFF, n_threads=k.PREFETCH_THREADS_DEFAULT, max_bytes=0),
        [],
    )


def test_warning_texts() -> None:
    _, warnings = parse_prefetch(PrefetchEnv(mode=" Turbo ", max_bytes=" 1.5M", threads="two "), k.MODE_ROUTER)
    assert warnings == [
        "ONEBIT_MOE_PREFETCH=' Turbo ' is not one of off|advise|read; using off",
        "ONEBIT_MOE_PREFETCH_MAX_BYTES=' 1.5M' is not a byte count (N, Nk, Nm or Ng, at most 1 TiB); no cap",
        "ONEBIT_MOE_PREFETCH_THREADS='two ' is not a non-negative integer; using 2",
    ]
    _, warnings = parse_prefetch(PrefetchEnv(mode="\tAdvise", max_bytes="1025G", threads="0"), k.MODE_OFF)
    assert warnings == [
        "ONEBIT_MOE_PREFETCH=advise needs ONEBIT_MOE_PREDICT=router or block; using off",
        "ONEBIT_MOE_PREFETCH_MAX_BYTES='1025G' is not a byte count (N, Nk, Nm or Ng, at most 1 TiB); no cap",
        "ONEBIT_MOE_PREFETCH_THREADS=0 must be at least 1; using 2",
    ]
    _, warnings = parse_prefetch(PrefetchEnv(mode="READ", max_bytes="\u0661", threads=" +0017 "), k.MODE_OFF)
    assert warnings == [
        "ONEBIT_MOE_PREFETCH=read needs ONEBIT_MOE_PREDICT=router or block; using off",
        "ONEBIT_MOE_PREFETCH_MAX_BYTES='\u0661' is not a byte count (N, Nk, Nm or Ng, at most 1 TiB); no cap",
        "ONEBIT_MOE_PREFETCH_THREADS=17 exceeds 16; clamped to 16",
    ]


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("1024g", LIMIT),
        ("1024GiB", LIMIT),
        ("1048576m", LIMIT),
        ("1073741824k", LIMIT),
        ("1099511627776", None),
        ("1048577m", None),
        ("1073741825K", None),
        ("999999999999", 999999999999),
        ("000000000012", 12),
        ("0000000000012", None),
        ("0", 0),
        ("0g", 0),
        ("12 ", 12),
        ("12\u00a0", None),
        ("12\u212a", None),
        ("12ki", None),
        ("12ib", None),
        ("12kb", None),
        ("12t", None),
        ("1_000", None),
        ("0x10", None),
    ],
)
def test_byte_count_grammar(raw: str, expected: int | None) -> None:
    p, warnings = parse_prefetch(PrefetchEnv(max_bytes=raw), k.MODE_ROUTER)
    assert (p.max_bytes, len(warnings)) == ((0, 1) if expected is None else (expected, 0))


# --- the C policy through cffi -------------------------------------------------------------


def c_parse_prefetch(c_policy, env: PrefetchEnv, predict_mode: int) -> tuple[PrefetchPolicy, int, str]:
    """onebit_prefetch_parse as a PrefetchPolicy, the warning count and the warning buffer."""
    ffi, lib = c_policy
    strings = {f: ffi.NULL if v is None else ffi.new("char[]", v.encode()) for f, v in env._asdict().items()}
    out = ffi.new("struct onebit_prefetch_policy *")
    warn = ffi.new("char[]", WARN_CAP)
    c_env = ffi.new("struct onebit_prefetch_env *", strings)
    n_warn = lib.onebit_prefetch_parse(c_env, predict_mode, out, warn, WARN_CAP)
    policy = PrefetchPolicy(
        mode=out.mode, n_threads=out.n_threads, max_bytes=out.max_bytes, guard=out.guard, room=out.room
    )
    return policy, n_warn, ffi.string(warn).decode()


def assert_prefetch_parity(c_policy, env: PrefetchEnv, predict_mode: int) -> tuple[PrefetchPolicy, int]:
    """The C and Python policies agree on every field and every warning; returns C's answer."""
    c, c_count, c_text = c_parse_prefetch(c_policy, env, predict_mode)
    p, warnings = parse_prefetch(env, predict_mode)
    assert c == p
    assert (c_count, c_text) == (len(warnings), "\n".join(warnings))
    return c, c_count


def test_c_constants(c_policy) -> None:
    _, lib = c_policy
    assert (lib.ONEBIT_PREFETCH_OFF, lib.ONEBIT_PREFETCH_ADVISE, lib.ONEBIT_PREFETCH_READ) == (
        k.PREFETCH_OFF,
        k.PREFETCH_ADVISE,
        k.PREFETCH_READ,
    )
    assert lib.ONEBIT_PREFETCH_THREADS_DEFAULT == k.PREFETCH_THREADS_DEFAULT
    assert lib.ONEBIT_PREFETCH_THREADS_MAX == k.PREFETCH_THREADS_MAX
    assert lib.ONEBIT_PREFETCH_MAX_BYTES_LIMIT == k.PREFETCH_MAX_BYTES_LIMIT
    assert (lib.ONEBIT_PREFETCH_GUARD_DEFAULT, lib.ONEBIT_PREFETCH_GUARD_MAX) == (
        k.PREFETCH_GUARD_DEFAULT,
        k.PREFETCH_GUARD_MAX,
    )
    assert (lib.ONEBIT_MODE_OFF, lib.ONEBIT_MODE_ROUTER, lib.ONEBIT_MODE_BLOCK, lib.ONEBIT_MODE_LEARNED) == (
        k.MODE_OFF,
        k.MODE_ROUTER,
        k.MODE_BLOCK,
        k.MODE_LEARNED,
    )


@prefetch_cases()
def test_c_parse_prefetch(c_policy, case: PrefetchCase) -> None:
    p, n_warn = assert_prefetch_parity(c_policy, case.env, case.predict_mode)
    assert (p.mode, p.max_bytes, p.n_threads, n_warn) == case[3:]


# the raw material: the grammar's own characters, ASCII whitespace, and non-ASCII look-alikes
# (Unicode digits and spaces, KELVIN SIGN, dotted capital I, control characters str.strip eats)
ALPHABET = " \t\n\r\f\v0123456789+-._xbeEiIkKmMgGtTadrsvo\u0661\u00b2\uff11\u00a0\u2003\u0085\u212a\u0130\x1c\x1f\u00e9"
WORDS = ["off", "advise", "read", "on", "madvise", "router", "block", "kib", "mib", "gib", "k", "m", "g"]
MIXED_CASE = st.sampled_from(WORDS).flatmap(
    lambda w: st.sets(st.integers(0, len(w) - 1)).map(
        lambda up: "".join(("\u212a" if c == "k" else c.upper()) if i in up else c for i, c in enumerate(w))
    )
)
PADDING = st.text(" \t\n\r\f\v\u00a0\u2003\u0085\x1c", max_size=3)
SUFFIXES = [
    "",
    "k",
    "K",
    "kib",
    "KiB",
    "KIB",
    "m",
    "M",
    "mib",
    "MiB",
    "g",
    "G",
    "gib",
    "GIB",
    "b",
    "kb",
    "ib",
    "ki",
    "t",
    "tib",
    "\u212a",
    "k ",
    " k",
    "\u0130b",
]
NUMBERS = st.one_of(
    st.integers(0, 10**14),
    st.integers(0, 20),
    st.sampled_from(
        [
            LIMIT,
            LIMIT + 1,
            LIMIT >> 10,
            (LIMIT >> 10) + 1,
            LIMIT >> 20,
            (LIMIT >> 20) + 1,
            1024,
            1025,
            10**12 - 1,
            10**12,
            10**9 - 1,
            10**9,
            2**31,
            2**63,
            10**30,
        ]
    ),
)


@st.composite
def numbers(draw: st.DrawFn) -> str:
    """A number as the knobs see it: maybe signed, zero-padded, suffixed, padded with whitespace."""
    digits = "0" * draw(st.integers(0, 3)) + str(draw(NUMBERS))
    sign = draw(st.sampled_from(["", "", "+", "-"]))
    return draw(PADDING) + sign + digits + draw(st.sampled_from(SUFFIXES)) + draw(PADDING)


VALUES = st.one_of(
    st.none(),
    st.text(ALPHABET, max_size=16),
    numbers(),
    MIXED_CASE,
    st.tuples(PADDING, MIXED_CASE, PADDING).map("".join),
    # ASCII and non-ASCII digits mixed (ARABIC-INDIC ONE, SUPERSCRIPT TWO, FULLWIDTH ONE), maybe suffixed
    st.tuples(st.text("0123456789\u0661\u00b2\uff11", min_size=1, max_size=13), st.sampled_from(SUFFIXES)).map("".join),
)
ENVS = st.builds(PrefetchEnv, VALUES, VALUES, VALUES, VALUES, VALUES)
PREDICT_MODES = st.one_of(st.sampled_from([k.MODE_OFF, k.MODE_ROUTER, k.MODE_BLOCK]), st.integers(-3, 7))


@settings(max_examples=2000, deadline=None)
@given(env=ENVS, predict_mode=PREDICT_MODES)
def test_prefetch_parity_random(c_policy, env: PrefetchEnv, predict_mode: int) -> None:
    assert_prefetch_parity(c_policy, env, predict_mode)


GUARD_CASES = [c for c in read_cases() if isinstance(c, GuardCase)]


@pytest.mark.parametrize("case", GUARD_CASES, ids=lambda c: f"line{c.line}")
def test_guard(c_policy, case: GuardCase) -> None:
    """ONEBIT_MOE_PREFETCH_GUARD: the probe window and its warnings, C and Python alike."""
    env = PrefetchEnv(mode="advise", guard=case.guard)
    p, n_warn = assert_prefetch_parity(c_policy, env, k.MODE_ROUTER)
    assert (p.guard, n_warn) == (case.window, case.n_warnings)


ROOM_CASES = [c for c in read_cases() if isinstance(c, RoomCase)]


@pytest.mark.parametrize("case", ROOM_CASES, ids=lambda c: f"line{c.line}")
def test_room(c_policy, case: RoomCase) -> None:
    """ONEBIT_MOE_PREFETCH_ROOM: the room rule's ratio and its warnings, C and Python alike."""
    env = PrefetchEnv(mode="advise", room=case.room)
    p, n_warn = assert_prefetch_parity(c_policy, env, k.MODE_ROUTER)
    assert (p.room, n_warn) == (case.ratio, case.n_warnings)
