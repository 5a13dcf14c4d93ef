"""The prefetch consumer's policy (ONEBIT_MOE_PREFETCH*): onebit_predict.policy.parse_prefetch
against every `prefetch`, `route`, `wait`, `keep`, `order` and `layers_ahead` case of ctest_port/cases.tsv and its exact
warning texts; then the C++ onebit_prefetch_parse (through cffi) against the same cases, and against
the Python policy on random and malformed environments: same fields, same warnings.

The C half needs the patched tree (ONEBIT_LLAMA_TREE, or the tree build.sh recorded; the
``c_policy`` fixture marks it needs_build), which one pin makes the tree of the series: its
src/onebit-moe-policy.h declares onebit_prefetch_parse, and a tree that does not fails to build
the module, never skips. The Python half needs no tree."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ctest_port.cases import (
    GuardCase,
    KeepCase,
    LayersAheadCase,
    OrderCase,
    PrefetchCase,
    RoomCase,
    RouteCase,
    WaitCase,
    read_cases,
)
from onebit_predict import constants as k
from onebit_predict.policy import PrefetchEnv, PrefetchPolicy, parse_prefetch, prefetch_mode_name

CASES = [c for c in read_cases() if isinstance(c, PrefetchCase)]
ROUTE_CASES = [c for c in read_cases() if isinstance(c, RouteCase)]
WAIT_CASES = [c for c in read_cases() if isinstance(c, WaitCase)]
KEEP_CASES = [c for c in read_cases() if isinstance(c, KeepCase)]
ORDER_CASES = [c for c in read_cases() if isinstance(c, OrderCase)]
LAYERS_AHEAD_CASES = [c for c in read_cases() if isinstance(c, LayersAheadCase)]
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


def test_there_are_route_cases() -> None:
    assert len(ROUTE_CASES) >= 20


@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: f"line{c.line}")
def test_parse_route(case: RouteCase) -> None:
    p, warnings = parse_prefetch(case.env, case.predict_mode)
    assert (p.mode, p.speculative, p.route, p.random, len(warnings)) == case[3:]


def test_there_are_wait_cases() -> None:
    assert len(WAIT_CASES) >= 20


@pytest.mark.parametrize("case", WAIT_CASES, ids=lambda c: f"line{c.line}")
def test_parse_wait(case: WaitCase) -> None:
    p, warnings = parse_prefetch(case.env, case.predict_mode)
    assert (p.mode, p.wait, len(warnings)) == case[3:]


def test_there_are_keep_cases() -> None:
    assert len(KEEP_CASES) >= 30
    assert {c.keep for c in KEEP_CASES} == {k.KEEP_KERNEL, k.KEEP_LRU, k.KEEP_ANON}


@pytest.mark.parametrize("case", KEEP_CASES, ids=lambda c: f"line{c.line}")
def test_parse_keep(case: KeepCase) -> None:
    p, warnings = parse_prefetch(case.env, case.predict_mode)
    assert (p.keep, len(warnings)) == case[3:]


def test_there_are_order_cases() -> None:
    assert len(ORDER_CASES) >= 30
    assert {c.order for c in ORDER_CASES} == {k.ORDER_INDEX, k.ORDER_HITS}


@pytest.mark.parametrize("case", ORDER_CASES, ids=lambda c: f"line{c.line}")
def test_parse_order(case: OrderCase) -> None:
    p, warnings = parse_prefetch(case.env, case.predict_mode)
    assert (p.order, len(warnings)) == case[3:]


def test_there_are_layers_ahead_cases() -> None:
    assert len(LAYERS_AHEAD_CASES) >= 30
    assert {c.layers for c in LAYERS_AHEAD_CASES} >= {0, 1, 2, k.PREFETCH_LAYERS_MAX}


@pytest.mark.parametrize("case", LAYERS_AHEAD_CASES, ids=lambda c: f"line{c.line}")
def test_parse_layers_ahead(case: LayersAheadCase) -> None:
    p, warnings = parse_prefetch(case.env, case.predict_mode)
    assert (p.layers, len(warnings)) == case[3:]


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
        PrefetchPolicy(mode=k.PREFETCH_READ, n_threads=4, max_bytes=64 << 20, speculative=True),
        [],
    )
    routed = {"ONEBIT_MOE_PREFETCH_ROUTE": "1", "ONEBIT_MOE_PREFETCH_RANDOM": "yes"}
    assert PrefetchEnv.from_environ(routed) == PrefetchEnv(route="1", random="yes")
    assert parse_prefetch(PrefetchEnv.from_environ(routed), k.MODE_OFF) == (
        PrefetchPolicy(
            mode=k.PREFETCH_ROUTE_CALL, n_threads=k.PREFETCH_THREADS_DEFAULT, max_bytes=0, route=True, random=True
        ),
        [],
    )
    waited = {"ONEBIT_MOE_PREFETCH": "pread", "ONEBIT_MOE_PREFETCH_ROUTE": "1", "ONEBIT_MOE_PREFETCH_WAIT": "on"}
    assert PrefetchEnv.from_environ(waited) == PrefetchEnv(mode="pread", route="1", wait="on")
    assert parse_prefetch(PrefetchEnv.from_environ(waited), k.MODE_OFF) == (
        PrefetchPolicy(mode=k.PREFETCH_PREAD, n_threads=k.PREFETCH_THREADS_DEFAULT, max_bytes=0, route=True, wait=True),
        [],
    )
    kept = {"ONEBIT_MOE_PREFETCH_ROUTE": "1", "ONEBIT_MOE_PREFETCH_KEEP": " LRU"}
    assert PrefetchEnv.from_environ(kept) == PrefetchEnv(route="1", keep=" LRU")
    assert parse_prefetch(PrefetchEnv.from_environ(kept), k.MODE_OFF) == (
        PrefetchPolicy(
            mode=k.PREFETCH_ROUTE_CALL, n_threads=k.PREFETCH_THREADS_DEFAULT, max_bytes=0, route=True, keep=k.KEEP_LRU
        ),
        [],
    )
    ordered = {"ONEBIT_MOE_PREFETCH": "pread", "ONEBIT_MOE_PREFETCH_ROUTE": "1", "ONEBIT_MOE_PREFETCH_ORDER": "Hits "}
    assert PrefetchEnv.from_environ(ordered) == PrefetchEnv(mode="pread", route="1", order="Hits ")
    assert parse_prefetch(PrefetchEnv.from_environ(ordered), k.MODE_OFF) == (
        PrefetchPolicy(
            mode=k.PREFETCH_PREAD, n_threads=k.PREFETCH_THREADS_DEFAULT, max_bytes=0, route=True, order=k.ORDER_HITS
        ),
        [],
    )
    ahead = {"ONEBIT_MOE_PREFETCH_ROUTE": "1", "ONEBIT_MOE_PREFETCH_LAYERS": " 2"}
    assert PrefetchEnv.from_environ(ahead) == PrefetchEnv(route="1", layers=" 2")
    assert parse_prefetch(PrefetchEnv.from_environ(ahead), k.MODE_OFF) == (
        PrefetchPolicy(
            mode=k.PREFETCH_ROUTE_CALL, n_threads=k.PREFETCH_THREADS_DEFAULT, max_bytes=0, route=True, layers=2
        ),
        [],
    )


def test_every_variable_is_read() -> None:
    """PrefetchEnv.from_environ reads one variable per field, each of them in ENV_ALL."""
    environ = {name: f"v{i}" for i, name in enumerate(k.ENV_ALL)}
    env = PrefetchEnv.from_environ(environ)
    assert len(set(env)) == len(PrefetchEnv._fields) and None not in env
    assert k.ENV_PREFETCH_ROUTE in k.ENV_ALL and k.ENV_PREFETCH_RANDOM in k.ENV_ALL
    assert k.ENV_PREFETCH_WAIT in k.ENV_ALL and "wait" in PrefetchEnv._fields
    assert k.ENV_PREFETCH_KEEP in k.ENV_ALL and "keep" in PrefetchEnv._fields
    assert k.ENV_PREFETCH_ORDER in k.ENV_ALL and "order" in PrefetchEnv._fields
    assert k.ENV_PREFETCH_LAYERS in k.ENV_ALL and "layers" in PrefetchEnv._fields
    assert k.ENV_PREFETCH_DEBUG_HANDBACK in k.ENV_ALL


def test_defaults() -> None:
    assert parse_prefetch(PrefetchEnv(), k.MODE_OFF) == (
        PrefetchPolicy(mode=k.PREFETCH_OFF, n_threads=k.PREFETCH_THREADS_DEFAULT, max_bytes=0),
        [],
    )


def test_warning_texts() -> None:
    _, warnings = parse_prefetch(PrefetchEnv(mode=" Turbo ", max_bytes=" 1.5M", threads="two "), k.MODE_ROUTER)
    assert warnings == [
        "ONEBIT_MOE_PREFETCH=' Turbo ' is not one of off|advise|read|populate|pread; using off",
        "ONEBIT_MOE_PREFETCH_MAX_BYTES=' 1.5M' is not a byte count (N, Nk, Nm or Ng, at most 1 TiB); no cap",
        "ONEBIT_MOE_PREFETCH_THREADS='two ' is not a non-negative integer; using 8",
    ]
    _, warnings = parse_prefetch(PrefetchEnv(mode="\tAdvise", max_bytes="1025G", threads="0"), k.MODE_OFF)
    assert warnings == [
        "ONEBIT_MOE_PREFETCH=advise needs ONEBIT_MOE_PREDICT=router, block or learned, "
        "or ONEBIT_MOE_PREFETCH_ROUTE=1; using off",
        "ONEBIT_MOE_PREFETCH_MAX_BYTES='1025G' is not a byte count (N, Nk, Nm or Ng, at most 1 TiB); no cap",
        "ONEBIT_MOE_PREFETCH_THREADS=0 must be at least 1; using 8",
    ]
    _, warnings = parse_prefetch(PrefetchEnv(mode="READ", max_bytes="\u0661", threads=" +0017 "), k.MODE_OFF)
    assert warnings == [
        "ONEBIT_MOE_PREFETCH=read needs ONEBIT_MOE_PREDICT=router, block or learned, "
        "or ONEBIT_MOE_PREFETCH_ROUTE=1; using off",
        "ONEBIT_MOE_PREFETCH_MAX_BYTES='\u0661' is not a byte count (N, Nk, Nm or Ng, at most 1 TiB); no cap",
        "ONEBIT_MOE_PREFETCH_THREADS=17 exceeds 16; clamped to 16",
    ]


def test_route_warning_texts() -> None:
    """The order is C's: the call, _ROUTE, _RANDOM, then the call's need, then _RANDOM's."""
    _, warnings = parse_prefetch(PrefetchEnv(mode=" Populate", route="maybe", random=" 1"), k.MODE_OFF)
    assert warnings == [
        "ONEBIT_MOE_PREFETCH_ROUTE='maybe' is not one of 1|0|true|false|yes|no|on|off; using 0",
        "ONEBIT_MOE_PREFETCH=populate needs ONEBIT_MOE_PREDICT=router, block or learned, "
        "or ONEBIT_MOE_PREFETCH_ROUTE=1; using off",
        "ONEBIT_MOE_PREFETCH_RANDOM=1 needs the consumer on (ONEBIT_MOE_PREFETCH or ONEBIT_MOE_PREFETCH_ROUTE); "
        "ignored",
    ]
    p, warnings = parse_prefetch(PrefetchEnv(mode="fast", random="2"), k.MODE_BLOCK)
    assert warnings == [
        "ONEBIT_MOE_PREFETCH='fast' is not one of off|advise|read|populate|pread; using off",
        "ONEBIT_MOE_PREFETCH_RANDOM='2' is not one of 1|0|true|false|yes|no|on|off; using 0",
    ]
    assert (p.mode, p.speculative, p.route, p.random) == (k.PREFETCH_OFF, False, False, False)


WAIT_WORDS = (
    "ONEBIT_MOE_PREFETCH_WAIT=1 needs route-time reads (ONEBIT_MOE_PREFETCH_ROUTE=1) by a call that finishes "
    "them (read, populate or pread, not advise); ignored"
)
# (env, predict mode, the warnings in C's order: the call, _ROUTE, _RANDOM, their needs, _WAIT, its need;
# the call, route, wait as parsed)
WAIT_TEXTS = [
    (PrefetchEnv(mode="\tAdvise ", route="1", wait=" yes"), k.MODE_OFF, [WAIT_WORDS], (k.PREFETCH_ADVISE, True, False)),
    (
        PrefetchEnv(mode="PREAD", random="1", wait="1"),
        k.MODE_OFF,
        [
            "ONEBIT_MOE_PREFETCH=pread needs ONEBIT_MOE_PREDICT=router, block or learned, "
            "or ONEBIT_MOE_PREFETCH_ROUTE=1; using off",
            "ONEBIT_MOE_PREFETCH_RANDOM=1 needs the consumer on (ONEBIT_MOE_PREFETCH or ONEBIT_MOE_PREFETCH_ROUTE); "
            "ignored",
            WAIT_WORDS,
        ],
        (k.PREFETCH_OFF, False, False),
    ),
    (
        PrefetchEnv(mode="preads", route="1", wait="maybe"),
        k.MODE_ROUTER,
        [
            "ONEBIT_MOE_PREFETCH='preads' is not one of off|advise|read|populate|pread; using off",
            "ONEBIT_MOE_PREFETCH_WAIT='maybe' is not one of 1|0|true|false|yes|no|on|off; using 0",
        ],
        (k.PREFETCH_ROUTE_CALL, True, False),
    ),
]


@pytest.mark.parametrize(("env", "predict_mode", "texts", "parsed"), WAIT_TEXTS)
def test_wait_warning_texts(env: PrefetchEnv, predict_mode: int, texts: list[str], parsed: tuple) -> None:
    p, warnings = parse_prefetch(env, predict_mode)
    assert warnings == texts
    assert (p.mode, p.route, p.wait) == parsed


KEEP_BAD = "is not one of kernel|lru|anon; using kernel"
KEEP_NEEDS = "ONEBIT_MOE_PREFETCH_KEEP=lru needs route-time reads (ONEBIT_MOE_PREFETCH_ROUTE=1); ignored"
ANON_NEEDS = "ONEBIT_MOE_PREFETCH_KEEP=anon needs route-time reads (ONEBIT_MOE_PREFETCH_ROUTE=1); ignored"
ANON_PREAD = "ONEBIT_MOE_PREFETCH_KEEP=anon reads with pread (ONEBIT_MOE_PREFETCH=pread); using lru"
# (env, predict mode, the warnings in C's order: the call, _ROUTE, _RANDOM, their needs, _WAIT, its need,
# _KEEP, its need; the call, route, wait, keep as parsed)
KEEP_TEXTS = [
    # lru without route: one warning, kernel
    (PrefetchEnv(keep="lru"), k.MODE_OFF, [KEEP_NEEDS], (k.PREFETCH_OFF, False, False, k.KEEP_KERNEL)),
    (
        PrefetchEnv(mode="read", keep="\tLru "),
        k.MODE_ROUTER,
        [KEEP_NEEDS],
        (k.PREFETCH_READ, False, False, k.KEEP_KERNEL),
    ),
    # a bad value, with route and without: the raw value quoted, kernel, never the need as well
    (
        PrefetchEnv(route="1", keep=" LFU\t"),
        k.MODE_OFF,
        [f"ONEBIT_MOE_PREFETCH_KEEP=' LFU\t' {KEEP_BAD}"],
        (k.PREFETCH_ROUTE_CALL, True, False, k.KEEP_KERNEL),
    ),
    (
        PrefetchEnv(keep="lru2"),
        k.MODE_BLOCK,
        [f"ONEBIT_MOE_PREFETCH_KEEP='lru2' {KEEP_BAD}"],
        (k.PREFETCH_OFF, False, False, k.KEEP_KERNEL),
    ),
    # keep with wait: both kept, no warning
    (
        PrefetchEnv(mode="pread", route="1", wait="1", keep="LRU"),
        k.MODE_OFF,
        [],
        (k.PREFETCH_PREAD, True, True, k.KEEP_LRU),
    ),
    # advise with route: the wait dropped (its reads are not finished), lru kept (it needs route alone)
    (
        PrefetchEnv(mode="advise", route="1", wait="yes", keep="lru"),
        k.MODE_ROUTER,
        [WAIT_WORDS],
        (k.PREFETCH_ADVISE, True, False, k.KEEP_LRU),
    ),
    # neither has route: the wait's warning, then keep's
    (
        PrefetchEnv(mode="read", wait="on", keep="lru"),
        k.MODE_LEARNED,
        [WAIT_WORDS, KEEP_NEEDS],
        (k.PREFETCH_READ, False, False, k.KEEP_KERNEL),
    ),
    # anon with pread and route: kept, and the layer waits though _WAIT is unset or 0, unless the order is
    # hits (each expert's matmul waits for its own)
    (
        PrefetchEnv(mode="pread", route="1", keep="anon", order="hits"),
        k.MODE_OFF,
        [],
        (k.PREFETCH_PREAD, True, False, k.KEEP_ANON),
    ),
    (
        PrefetchEnv(mode="pread", route="1", wait="1", keep="anon", order="hits"),
        k.MODE_OFF,
        [],
        (k.PREFETCH_PREAD, True, True, k.KEEP_ANON),
    ),
    (PrefetchEnv(mode="pread", route="1", keep="anon"), k.MODE_OFF, [], (k.PREFETCH_PREAD, True, True, k.KEEP_ANON)),
    (
        PrefetchEnv(mode="pread", route="1", wait="0", keep=" ANON\t"),
        k.MODE_ROUTER,
        [],
        (k.PREFETCH_PREAD, True, True, k.KEEP_ANON),
    ),
    # anon without route: its own name in the need, kernel, no wait
    (
        PrefetchEnv(mode="pread", keep="anon"),
        k.MODE_ROUTER,
        [ANON_NEEDS],
        (k.PREFETCH_PREAD, False, False, k.KEEP_KERNEL),
    ),
    # anon with another call: the LRU in the page cache instead, the wait as given
    (PrefetchEnv(route="1", keep="anon"), k.MODE_OFF, [ANON_PREAD], (k.PREFETCH_ROUTE_CALL, True, False, k.KEEP_LRU)),
    (
        PrefetchEnv(mode="read", route="1", wait="1", keep="Anon"),
        k.MODE_OFF,
        [ANON_PREAD],
        (k.PREFETCH_READ, True, True, k.KEEP_LRU),
    ),
    # every warning of the two at once, in order: the call, its need, the wait's value, keep's value
    (
        PrefetchEnv(mode="populate", wait="maybe", keep="most-recent"),
        k.MODE_OFF,
        [
            "ONEBIT_MOE_PREFETCH=populate needs ONEBIT_MOE_PREDICT=router, block or learned, "
            "or ONEBIT_MOE_PREFETCH_ROUTE=1; using off",
            "ONEBIT_MOE_PREFETCH_WAIT='maybe' is not one of 1|0|true|false|yes|no|on|off; using 0",
            f"ONEBIT_MOE_PREFETCH_KEEP='most-recent' {KEEP_BAD}",
        ],
        (k.PREFETCH_OFF, False, False, k.KEEP_KERNEL),
    ),
]


@pytest.mark.parametrize(("env", "predict_mode", "texts", "parsed"), KEEP_TEXTS)
def test_keep_warning_texts(env: PrefetchEnv, predict_mode: int, texts: list[str], parsed: tuple) -> None:
    p, warnings = parse_prefetch(env, predict_mode)
    assert warnings == texts
    assert (p.mode, p.route, p.wait, p.keep) == parsed


ORDER_BAD = "is not one of index|hits; using index"
ORDER_NEEDS = "ONEBIT_MOE_PREFETCH_ORDER=hits needs route-time reads (ONEBIT_MOE_PREFETCH_ROUTE=1); ignored"
# (env, predict mode, the warnings in C's order: the call, _ROUTE, _RANDOM, their needs, _WAIT, its need,
# _KEEP, its need, _ORDER, its need; the call, route, keep, order as parsed)
ORDER_TEXTS = [
    # hits without route: one warning, index
    (PrefetchEnv(order="hits"), k.MODE_OFF, [ORDER_NEEDS], (k.PREFETCH_OFF, False, k.KEEP_KERNEL, k.ORDER_INDEX)),
    (
        PrefetchEnv(mode="read", order="\tHits "),
        k.MODE_ROUTER,
        [ORDER_NEEDS],
        (k.PREFETCH_READ, False, k.KEEP_KERNEL, k.ORDER_INDEX),
    ),
    # a bad value, with route and without: the raw value quoted, index, never the need as well
    (
        PrefetchEnv(route="1", order=" HOT\t"),
        k.MODE_OFF,
        [f"ONEBIT_MOE_PREFETCH_ORDER=' HOT\t' {ORDER_BAD}"],
        (k.PREFETCH_ROUTE_CALL, True, k.KEEP_KERNEL, k.ORDER_INDEX),
    ),
    (
        PrefetchEnv(order="hits2"),
        k.MODE_BLOCK,
        [f"ONEBIT_MOE_PREFETCH_ORDER='hits2' {ORDER_BAD}"],
        (k.PREFETCH_OFF, False, k.KEEP_KERNEL, k.ORDER_INDEX),
    ),
    # hits with lru: both kept, no warning
    (
        PrefetchEnv(mode="pread", route="1", keep="lru", order="HITS"),
        k.MODE_OFF,
        [],
        (k.PREFETCH_PREAD, True, k.KEEP_LRU, k.ORDER_HITS),
    ),
    # hits with advise and route: kept (it needs route alone)
    (
        PrefetchEnv(mode="advise", route="1", order="hits"),
        k.MODE_ROUTER,
        [],
        (k.PREFETCH_ADVISE, True, k.KEEP_KERNEL, k.ORDER_HITS),
    ),
    # neither has route: keep's warning, then order's
    (
        PrefetchEnv(mode="read", keep="lru", order="hits"),
        k.MODE_LEARNED,
        [KEEP_NEEDS, ORDER_NEEDS],
        (k.PREFETCH_READ, False, k.KEEP_KERNEL, k.ORDER_INDEX),
    ),
    # every warning of the two at once, in order: the call, its need, the keep's value, order's value
    (
        PrefetchEnv(mode="populate", keep="most-recent", order="hottest"),
        k.MODE_OFF,
        [
            "ONEBIT_MOE_PREFETCH=populate needs ONEBIT_MOE_PREDICT=router, block or learned, "
            "or ONEBIT_MOE_PREFETCH_ROUTE=1; using off",
            f"ONEBIT_MOE_PREFETCH_KEEP='most-recent' {KEEP_BAD}",
            f"ONEBIT_MOE_PREFETCH_ORDER='hottest' {ORDER_BAD}",
        ],
        (k.PREFETCH_OFF, False, k.KEEP_KERNEL, k.ORDER_INDEX),
    ),
    # a bad ROUTE value: route 0, so hits is dropped after the route's warning
    (
        PrefetchEnv(route="maybe", order="hits"),
        k.MODE_OFF,
        [
            "ONEBIT_MOE_PREFETCH_ROUTE='maybe' is not one of 1|0|true|false|yes|no|on|off; using 0",
            ORDER_NEEDS,
        ],
        (k.PREFETCH_OFF, False, k.KEEP_KERNEL, k.ORDER_INDEX),
    ),
]


@pytest.mark.parametrize(("env", "predict_mode", "texts", "parsed"), ORDER_TEXTS)
def test_order_warning_texts(env: PrefetchEnv, predict_mode: int, texts: list[str], parsed: tuple) -> None:
    p, warnings = parse_prefetch(env, predict_mode)
    assert warnings == texts
    assert (p.mode, p.route, p.keep, p.order) == parsed


LAYERS_NEEDS = "needs route-time reads (ONEBIT_MOE_PREFETCH_ROUTE=1); ignored"
# (env, predict mode, the warnings in C's order: ..., _ORDER, its need, _LAYERS's value, its need; the
# call, route, order, layers as parsed)
LAYERS_AHEAD_TEXTS = [
    # without route: the value named in the need, 0
    (
        PrefetchEnv(layers="2"),
        k.MODE_OFF,
        [f"ONEBIT_MOE_PREFETCH_LAYERS=2 {LAYERS_NEEDS}"],
        (k.PREFETCH_OFF, False, k.ORDER_INDEX, 0),
    ),
    # clamped, then without route: the clamped value named in the need
    (
        PrefetchEnv(layers=" 12"),
        k.MODE_ROUTER,
        ["ONEBIT_MOE_PREFETCH_LAYERS=12 exceeds 8; clamped to 8", f"ONEBIT_MOE_PREFETCH_LAYERS=8 {LAYERS_NEEDS}"],
        (k.PREFETCH_OFF, False, k.ORDER_INDEX, 0),
    ),
    # not an integer: the raw value quoted, 0, never the need as well
    (
        PrefetchEnv(route="1", layers=" -1\t"),
        k.MODE_OFF,
        ["ONEBIT_MOE_PREFETCH_LAYERS=' -1\t' is not a non-negative integer; using 0"],
        (k.PREFETCH_ROUTE_CALL, True, k.ORDER_INDEX, 0),
    ),
    # with hits and route: both kept
    (
        PrefetchEnv(mode="pread", route="1", order="hits", layers="3"),
        k.MODE_OFF,
        [],
        (k.PREFETCH_PREAD, True, k.ORDER_HITS, 3),
    ),
    # neither has route: order's warning, then layers'
    (
        PrefetchEnv(order="hits", layers="1"),
        k.MODE_OFF,
        [ORDER_NEEDS, f"ONEBIT_MOE_PREFETCH_LAYERS=1 {LAYERS_NEEDS}"],
        (k.PREFETCH_OFF, False, k.ORDER_INDEX, 0),
    ),
]


@pytest.mark.parametrize(("env", "predict_mode", "texts", "parsed"), LAYERS_AHEAD_TEXTS)
def test_layers_ahead_warning_texts(env: PrefetchEnv, predict_mode: int, texts: list[str], parsed: tuple) -> None:
    p, warnings = parse_prefetch(env, predict_mode)
    assert warnings == texts
    assert (p.mode, p.route, p.order, p.layers) == parsed


def test_prefetch_mode_name() -> None:
    assert [prefetch_mode_name(m) for m in range(-1, 6)] == ["off", "off", "advise", "read", "populate", "pread", "off"]


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
        mode=out.mode,
        n_threads=out.n_threads,
        max_bytes=out.max_bytes,
        guard=out.guard,
        room=out.room,
        speculative=bool(out.speculative),
        route=bool(out.route),
        random=bool(out.random),
        wait=bool(out.wait),
        keep=out.keep,
        order=out.order,
        layers=out.layers,
    )
    assert {out.speculative, out.route, out.random, out.wait} <= {0, 1}
    assert out.keep in k.KEEP_NAMES
    assert out.order in k.ORDER_NAMES
    assert 0 <= out.layers <= k.PREFETCH_LAYERS_MAX
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
    assert (
        lib.ONEBIT_PREFETCH_OFF,
        lib.ONEBIT_PREFETCH_ADVISE,
        lib.ONEBIT_PREFETCH_READ,
        lib.ONEBIT_PREFETCH_POPULATE,
        lib.ONEBIT_PREFETCH_PREAD,
    ) == (k.PREFETCH_OFF, k.PREFETCH_ADVISE, k.PREFETCH_READ, k.PREFETCH_POPULATE, k.PREFETCH_PREAD)
    assert lib.ONEBIT_PREFETCH_ROUTE_CALL == k.PREFETCH_ROUTE_CALL
    keeps = (lib.ONEBIT_KEEP_KERNEL, lib.ONEBIT_KEEP_LRU, lib.ONEBIT_KEEP_ANON)
    assert keeps == (k.KEEP_KERNEL, k.KEEP_LRU, k.KEEP_ANON)
    assert (lib.ONEBIT_ORDER_INDEX, lib.ONEBIT_ORDER_HITS) == (k.ORDER_INDEX, k.ORDER_HITS)
    assert lib.ONEBIT_PREFETCH_THREADS_DEFAULT == k.PREFETCH_THREADS_DEFAULT
    assert lib.ONEBIT_PREFETCH_THREADS_MAX == k.PREFETCH_THREADS_MAX
    assert lib.ONEBIT_PREFETCH_MAX_BYTES_LIMIT == k.PREFETCH_MAX_BYTES_LIMIT
    assert lib.ONEBIT_PREFETCH_LAYERS_MAX == k.PREFETCH_LAYERS_MAX
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


@pytest.mark.parametrize("case", ROUTE_CASES, ids=lambda c: f"line{c.line}")
def test_c_parse_route(c_policy, case: RouteCase) -> None:
    p, n_warn = assert_prefetch_parity(c_policy, case.env, case.predict_mode)
    assert (p.mode, p.speculative, p.route, p.random, n_warn) == case[3:]


@pytest.mark.parametrize("case", WAIT_CASES, ids=lambda c: f"line{c.line}")
def test_c_parse_wait(c_policy, case: WaitCase) -> None:
    p, n_warn = assert_prefetch_parity(c_policy, case.env, case.predict_mode)
    assert (p.mode, p.wait, n_warn) == case[3:]


@pytest.mark.parametrize(("env", "predict_mode", "texts", "parsed"), WAIT_TEXTS)
def test_c_wait_warning_texts(c_policy, env: PrefetchEnv, predict_mode: int, texts: list[str], parsed: tuple) -> None:
    p, _, text = c_parse_prefetch(c_policy, env, predict_mode)
    assert text == "\n".join(texts)
    assert (p.mode, p.route, p.wait) == parsed


@pytest.mark.parametrize("case", KEEP_CASES, ids=lambda c: f"line{c.line}")
def test_c_parse_keep(c_policy, case: KeepCase) -> None:
    p, n_warn = assert_prefetch_parity(c_policy, case.env, case.predict_mode)
    assert (p.keep, n_warn) == case[3:]


@pytest.mark.parametrize(("env", "predict_mode", "texts", "parsed"), KEEP_TEXTS)
def test_c_keep_warning_texts(c_policy, env: PrefetchEnv, predict_mode: int, texts: list[str], parsed: tuple) -> None:
    p, _, text = c_parse_prefetch(c_policy, env, predict_mode)
    assert text == "\n".join(texts)
    assert (p.mode, p.route, p.wait, p.keep) == parsed


@pytest.mark.parametrize("case", ORDER_CASES, ids=lambda c: f"line{c.line}")
def test_c_parse_order(c_policy, case: OrderCase) -> None:
    p, n_warn = assert_prefetch_parity(c_policy, case.env, case.predict_mode)
    assert (p.order, n_warn) == case[3:]


@pytest.mark.parametrize(("env", "predict_mode", "texts", "parsed"), ORDER_TEXTS)
def test_c_order_warning_texts(c_policy, env: PrefetchEnv, predict_mode: int, texts: list[str], parsed: tuple) -> None:
    p, _, text = c_parse_prefetch(c_policy, env, predict_mode)
    assert text == "\n".join(texts)
    assert (p.mode, p.route, p.keep, p.order) == parsed


@pytest.mark.parametrize("case", LAYERS_AHEAD_CASES, ids=lambda c: f"line{c.line}")
def test_c_parse_layers_ahead(c_policy, case: LayersAheadCase) -> None:
    p, n_warn = assert_prefetch_parity(c_policy, case.env, case.predict_mode)
    assert (p.layers, n_warn) == case[3:]


@pytest.mark.parametrize(("env", "predict_mode", "texts", "parsed"), LAYERS_AHEAD_TEXTS)
def test_c_layers_ahead_warning_texts(
    c_policy, env: PrefetchEnv, predict_mode: int, texts: list[str], parsed: tuple
) -> None:
    p, _, text = c_parse_prefetch(c_policy, env, predict_mode)
    assert text == "\n".join(texts)
    assert (p.mode, p.route, p.order, p.layers) == parsed


def test_c_prefetch_mode_name(c_policy) -> None:
    ffi, lib = c_policy
    for mode in range(-2, 7):
        assert ffi.string(lib.onebit_prefetch_mode_name(mode)).decode() == prefetch_mode_name(mode)


# the raw material: the grammar's own characters, ASCII whitespace, and non-ASCII look-alikes
# (Unicode digits and spaces, KELVIN SIGN, dotted capital I, control characters str.strip eats)
ALPHABET = " \t\n\r\f\v0123456789+-._xbeEiIkKmMgGtTadrsvo\u0661\u00b2\uff11\u00a0\u2003\u0085\u212a\u0130\x1c\x1f\u00e9"
WORDS = [
    "off",
    "advise",
    "read",
    "populate",
    "pread",
    "kernel",
    "lru",
    "index",
    "hits",
    "on",
    "madvise",
    "router",
    "block",
    "kib",
    "mib",
    "gib",
    "k",
    "m",
    "g",
    "1",
    "0",
    "true",
    "false",
    "yes",
    "no",
]
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
ENVS = st.builds(PrefetchEnv, *[VALUES] * len(PrefetchEnv._fields))
PREDICT_MODES = st.one_of(
    st.sampled_from([k.MODE_OFF, k.MODE_ROUTER, k.MODE_BLOCK, k.MODE_LEARNED]), st.integers(-3, 7)
)


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
