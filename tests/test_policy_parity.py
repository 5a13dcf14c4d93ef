"""The C++ policy (through cffi) against every case of ctest_port/cases.tsv, and against
onebit_predict.policy on random and malformed environments: same fields, same warnings."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctest_port.cases import AheadCase, DepthCase, KnobCase, LayersCase, MinCase, PolicyCase, ReadCase, read_cases
from onebit_predict import policy as py
from onebit_predict.policy import Env, Policy

CASES = read_cases()
WARN_CAP = 1 << 16

# the raw material of environment strings: the grammar's own bytes, ASCII whitespace, and
# a few non-ASCII look-alikes (Unicode digits and spaces, KELVIN SIGN, control characters)
ALPHABET = " \t\n\r\f\v0123456789+-.eE,abcfiklnortuyxABCKLNORTX\u0661\u00b2\u00a0\u2003\u0085\u212a\x1c\x1f\u00e9"
FRAGMENTS = [
    "0",
    "1",
    "8",
    "47",
    "300",
    "999999999",
    "1234567890",
    "+",
    "-",
    ".",
    "e",
    "E-",
    ",",
    " ",
    "\t",
    "\n",
    "3.4028235e38",
    "3.4028236e38",
    "1e39",
    "1e-50",
    "\u0661",
    "\u00a0",
]
WORDS = ["off", "router", "block", "true", "false", "yes", "no", "on", "inf", "nan"]
# a word with some letters upper-cased; an upper-case k is KELVIN SIGN, which str.lower() takes to 'k'
MIXED_CASE = st.sampled_from(WORDS).flatmap(
    lambda w: st.sets(st.integers(0, len(w) - 1)).map(
        lambda up: "".join(("\u212a" if c == "k" else c.upper()) if i in up else c for i, c in enumerate(w))
    )
)
LAYER_ITEMS = st.one_of(
    st.integers(0, 120).map(str),
    st.tuples(st.integers(0, 120), st.integers(0, 120)).map(lambda ab: f"{ab[0]}-{ab[1]}"),
    st.text(ALPHABET, max_size=4),
)
ENV_VALUES = st.one_of(
    st.none(),
    st.text(ALPHABET, max_size=16),
    st.lists(st.sampled_from(FRAGMENTS), max_size=6).map("".join),
    MIXED_CASE,
    st.lists(LAYER_ITEMS, max_size=5).map(",".join),
)
ENVS = st.builds(Env, *[ENV_VALUES] * len(Env._fields))
MODELS = st.integers(1, 300).flatmap(
    lambda n_expert: st.tuples(st.integers(1, 100), st.just(n_expert), st.integers(1, min(8, n_expert)))
)


def cases_of(kind: type) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("case", [c for c in CASES if isinstance(c, kind)], ids=lambda c: f"line{c.line}")


def c_parse_policy(c_policy, env: Env, n_layer: int, n_expert: int, n_used: int) -> tuple[Policy, int, str]:
    """onebit_policy_parse as a Policy, the warning count and the warning buffer."""
    ffi, lib = c_policy
    strings = {k: ffi.NULL if v is None else ffi.new("char[]", v.encode()) for k, v in env._asdict().items()}
    out = ffi.new("struct onebit_policy *")
    warn = ffi.new("char[]", WARN_CAP)
    n_warn = lib.onebit_policy_parse(
        ffi.new("struct onebit_env *", strings), n_layer, n_expert, n_used, out, warn, WARN_CAP
    )
    policy = Policy(
        mode=out.mode,
        depth_requested=out.depth_requested,
        depth=out.depth,
        margin=out.margin,
        min_requested=out.min_requested,
        min_read=out.min_read,
        no_attn=bool(out.no_attn),
        stats=bool(out.stats),
        n_layer_predicted=out.n_layer_predicted,
        layer_mask=frozenset(i for i, m in enumerate(ffi.buffer(out.layer_mask)[:]) if m),
        ahead=out.ahead,
    )
    return policy, n_warn, ffi.string(warn).decode()


def c_parse_layers(c_policy, spec: str | None, n_layer: int) -> tuple[frozenset[int], int, str]:
    """onebit_parse_layers: the layers set, their count and the warning buffer."""
    ffi, lib = c_policy
    mask = ffi.new("uint8_t[]", lib.ONEBIT_MAX_LAYERS)
    warn = ffi.new("char[]", WARN_CAP)
    n_set = lib.onebit_parse_layers(ffi.NULL if spec is None else spec.encode(), n_layer, mask, warn, WARN_CAP)
    return frozenset(i for i, m in enumerate(ffi.buffer(mask)[:]) if m), n_set, ffi.string(warn).decode()


def assert_policy_parity(c_policy, env: Env, n_layer: int, n_expert: int, n_used: int) -> tuple[Policy, int]:
    """The C and Python policies agree on every field and every warning; returns C's answer."""
    c, c_count, c_text = c_parse_policy(c_policy, env, n_layer, n_expert, n_used)
    p, warnings = py.parse_policy(env, n_layer, n_expert, n_used)
    assert c == p
    assert (c_count, c_text) == (len(warnings), "\n".join(warnings))

    c_mask, c_set, c_layers_text = c_parse_layers(c_policy, env.layers, n_layer)
    mask, layer_warnings = py.parse_layers(env.layers, n_layer)
    assert (c_mask, c_set, c_layers_text) == (mask, len(mask), "\n".join(layer_warnings))
    return c, c_count


@cases_of(DepthCase)
def test_effective_depth(c_policy, case: DepthCase) -> None:
    assert c_policy[1].onebit_effective_depth(case.req, case.n_expert, case.n_used) == case.expected


@cases_of(MinCase)
def test_effective_min(c_policy, case: MinCase) -> None:
    assert c_policy[1].onebit_effective_min(case.req, case.depth, case.n_used) == case.expected


@cases_of(ReadCase)
def test_n_read(c_policy, case: ReadCase) -> None:
    ffi, lib = c_policy
    assert lib.onebit_n_read(ffi.new("float[]", case.logits), case.depth, case.margin, case.min_read) == case.expected


@cases_of(LayersCase)
def test_parse_layers(c_policy, case: LayersCase) -> None:
    mask, n_set, _ = c_parse_layers(c_policy, case.spec, case.n_layer)
    _, n_warn, _ = c_parse_policy(c_policy, Env(layers=case.spec), case.n_layer, 1, 1)
    assert (mask, n_set, n_warn) == (case.layers, len(case.layers), case.n_warnings)


@cases_of(PolicyCase)
def test_parse_policy(c_policy, case: PolicyCase) -> None:
    p, n_warn = assert_policy_parity(c_policy, case.env, case.n_layer, case.n_expert, case.n_used)
    got = (p.mode, p.depth, p.margin, p.min_read, p.n_layer_predicted, p.no_attn, p.stats, n_warn)
    assert got == case[5:]


@settings(max_examples=1000, deadline=None)
@given(env=ENVS, model=MODELS)
def test_policy_parity_random(c_policy, env: Env, model: tuple[int, int, int]) -> None:
    assert_policy_parity(c_policy, env, *model)


@st.composite
def ranked_rows(draw: st.DrawFn) -> tuple[list[float], int, float, int]:
    logits = draw(st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=16))
    logits.sort(reverse=True)
    with np.errstate(over="ignore"):
        gaps = [float(np.float32(logits[0]) - np.float32(x)) for x in logits]  # margins on the boundary
    margin = draw(
        st.one_of(
            st.just(math.inf),
            st.floats(min_value=0, allow_nan=False, allow_infinity=False, width=32),
            st.sampled_from([g for g in gaps if math.isfinite(g)]),
        )
    )
    return logits, draw(st.integers(0, len(logits))), margin, draw(st.integers(0, 20))


@settings(max_examples=1000, deadline=None)
@given(row=ranked_rows())
def test_n_read_parity_random(c_policy, row: tuple[list[float], int, float, int]) -> None:
    ffi, lib = c_policy
    logits, depth, margin, min_read = row
    assert lib.onebit_n_read(ffi.new("float[]", logits), depth, margin, min_read) == py.n_read(
        logits, depth, margin, min_read
    )


@cases_of(KnobCase)
def test_resolve_knob(c_policy, case: KnobCase) -> None:
    ffi, lib = c_policy

    def c_str(v: str | None):
        return ffi.NULL if v is None else ffi.new("char[]", v.encode())

    api, env = c_str(case.api), c_str(case.env)
    got = lib.onebit_resolve_knob(api, env)
    assert (None if got == ffi.NULL else ffi.string(got).decode()) == case.expected


@cases_of(AheadCase)
def test_ahead(c_policy, case: AheadCase) -> None:
    """ONEBIT_MOE_PREDICT_AHEAD=K: layers below K are never predicted, C and Python alike."""
    env = Env(ahead=case.ahead, layers=case.layers)
    p, n_warn = assert_policy_parity(c_policy, env, case.n_layer, 1, 1)
    assert (p.ahead, p.layer_mask, n_warn) == (case.expected_ahead, case.expected_layers, case.n_warnings)
