"""Read ctest_port/cases.tsv, the policy unit cases shared by the C++ ctest and pytest.

The format is described at the top of cases.tsv and in ctest_port/README.md. Every case
carries the line it came from, so a failure names the line to look at.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from onebit_predict.constants import KEEP_NAMES, ORDER_NAMES
from onebit_predict.policy import MODES, PREFETCH_MODES, Env, PrefetchEnv

CASES_TSV = Path(__file__).with_name("cases.tsv")
UNSET = "@"
EMPTY = '""'
ESCAPES = {"s": " ", "t": "\t", "n": "\n", "r": "\r", "f": "\f", "v": "\v", "\\": "\\"}
HEX_DIGITS = "0123456789abcdefABCDEF"
KEEPS = {name: keep for keep, name in KEEP_NAMES.items()}  # a keep case's expected KEEP
ORDERS = {name: order for order, name in ORDER_NAMES.items()}  # an order case's expected ORDER


class AheadCase(NamedTuple):
    line: int
    ahead: str | None  # ONEBIT_MOE_PREDICT_AHEAD
    layers: str | None  # ONEBIT_MOE_PREDICT_LAYERS
    n_layer: int
    expected_ahead: int
    expected_layers: frozenset[int]
    n_warnings: int


class GuardCase(NamedTuple):
    line: int
    guard: str | None  # ONEBIT_MOE_PREFETCH_GUARD, with ONEBIT_MOE_PREFETCH=advise
    window: int
    n_warnings: int


class RoomCase(NamedTuple):
    line: int
    room: str | None  # ONEBIT_MOE_PREFETCH_ROOM, with ONEBIT_MOE_PREFETCH=advise
    ratio: float  # binary32
    n_warnings: int


class RouteCase(NamedTuple):
    line: int
    env: PrefetchEnv  # ONEBIT_MOE_PREFETCH, _ROUTE and _RANDOM (the other knobs unset)
    predict_mode: int  # the parsed ONEBIT_MOE_PREDICT
    mode: int  # the workers' call
    speculative: bool
    route: bool
    random: bool
    n_warnings: int


class WaitCase(NamedTuple):
    line: int
    env: PrefetchEnv  # ONEBIT_MOE_PREFETCH, _ROUTE and _WAIT (the other knobs unset)
    predict_mode: int  # the parsed ONEBIT_MOE_PREDICT
    mode: int  # the workers' call
    wait: bool  # the route-time op waits for its layer's reads
    n_warnings: int


class KeepCase(NamedTuple):
    line: int
    env: PrefetchEnv  # ONEBIT_MOE_PREFETCH, _ROUTE and _KEEP (the other knobs unset)
    predict_mode: int  # the parsed ONEBIT_MOE_PREDICT
    keep: int  # what decides which experts stay cached: KEEP_KERNEL, KEEP_LRU or KEEP_ANON
    n_warnings: int


class OrderCase(NamedTuple):
    line: int
    env: PrefetchEnv  # ONEBIT_MOE_PREFETCH, _ROUTE and _ORDER (the other knobs unset)
    predict_mode: int  # the parsed ONEBIT_MOE_PREDICT
    order: int  # the order of a layer's reads and expert matmuls: ORDER_INDEX or ORDER_HITS
    n_warnings: int


class LayersAheadCase(NamedTuple):
    line: int
    env: PrefetchEnv  # ONEBIT_MOE_PREFETCH, _ROUTE and _LAYERS (the other knobs unset)
    predict_mode: int  # the parsed ONEBIT_MOE_PREDICT
    layers: int  # the whole layers a batch's route-time reads go ahead
    n_warnings: int


class KnobCase(NamedTuple):
    line: int
    api: str | None  # the C API's value (None: not given)
    env: str | None  # the ONEBIT_* variable's (None: unset)
    expected: str | None


class DepthCase(NamedTuple):
    line: int
    req: int
    n_expert: int
    n_used: int
    expected: int


class MinCase(NamedTuple):
    line: int
    req: int
    depth: int
    n_used: int
    expected: int


class ReadCase(NamedTuple):
    line: int
    logits: tuple[float, ...]  # binary32 values
    depth: int
    margin: float
    min_read: int
    expected: int


class LayersCase(NamedTuple):
    line: int
    spec: str | None
    n_layer: int
    layers: frozenset[int]
    n_warnings: int


class PolicyCase(NamedTuple):
    line: int
    env: Env
    n_layer: int
    n_expert: int
    n_used: int
    mode: int
    depth: int
    margin: float
    min_read: int
    n_layer_predicted: int
    no_attn: bool
    stats: bool
    n_warnings: int


class PrefetchCase(NamedTuple):
    line: int
    env: PrefetchEnv
    predict_mode: int  # the parsed ONEBIT_MOE_PREDICT
    mode: int
    max_bytes: int  # 0 = no cap
    n_threads: int
    n_warnings: int


Case = (
    DepthCase
    | MinCase
    | ReadCase
    | LayersCase
    | PolicyCase
    | PrefetchCase
    | KnobCase
    | AheadCase
    | GuardCase
    | RoomCase
    | RouteCase
    | WaitCase
    | KeepCase
    | OrderCase
    | LayersAheadCase
)


class CaseFormatError(ValueError):
    """A line of the case file does not follow its format."""


def _code_point(hex4: str) -> str:
    cp = int(hex4, 16) if len(hex4) == 4 and all(h in HEX_DIGITS for h in hex4) else 0
    if cp == 0 or 0xD800 <= cp <= 0xDFFF:
        raise CaseFormatError(f"bad escape \\u{hex4}")
    return chr(cp)


def _string(field: str) -> str | None:
    """An environment string: '@' is unset, '""' is empty, escapes as the file header says."""
    if field == UNSET:
        return None
    if field == EMPTY:
        return ""
    out: list[str] = []
    i = 0
    while i < len(field):
        c = field[i]
        if c != "\\":
            out.append(c)
            i += 1
        elif field[i + 1 : i + 2] == "u":
            out.append(_code_point(field[i + 2 : i + 6]))
            i += 6
        elif field[i + 1 : i + 2] in ESCAPES:
            out.append(ESCAPES[field[i + 1]])
            i += 2
        else:
            raise CaseFormatError(f"bad escape in {field!r}")
    return "".join(out)


def _float32(field: str) -> float:
    with np.errstate(over="ignore"):
        return float(np.float32(float(field)))


def _flag(field: str) -> bool:
    if field not in ("0", "1"):
        raise CaseFormatError(f"{field!r} is not 0 or 1")
    return field == "1"


def _keep(field: str) -> int:
    if field not in KEEPS:
        raise CaseFormatError(f"{field!r} is not one of {'|'.join(KEEPS)}")
    return KEEPS[field]


def _order(field: str) -> int:
    if field not in ORDERS:
        raise CaseFormatError(f"{field!r} is not one of {'|'.join(ORDERS)}")
    return ORDERS[field]


def _layer_list(field: str) -> frozenset[int]:
    if field == "-":
        return frozenset()
    layers: set[int] = set()
    for item in field.split(","):
        lo, _, hi = item.partition("-")
        layers.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(layers)


def _case(line: int, f: list[str]) -> Case:
    kind, n = f[0], len(f)
    if kind == "depth" and n == 5:
        return DepthCase(line, *map(int, f[1:]))
    if kind == "min" and n == 5:
        return MinCase(line, *map(int, f[1:]))
    if kind == "read" and n == 6:
        logits = tuple(_float32(x) for x in f[1].split(","))
        case = ReadCase(line, logits, int(f[2]), _float32(f[3]), int(f[4]), int(f[5]))
        if case.depth > len(logits):
            raise CaseFormatError(f"depth {case.depth} is longer than the row")
        return case
    if kind == "layers" and n == 5:
        return LayersCase(line, _string(f[1]), int(f[2]), _layer_list(f[3]), int(f[4]))
    if kind == "policy" and n == 19:
        return PolicyCase(
            line,
            Env(*map(_string, f[1:8])),
            int(f[8]),
            int(f[9]),
            int(f[10]),
            MODES[f[11]],
            int(f[12]),
            _float32(f[13]),
            int(f[14]),
            int(f[15]),
            _flag(f[16]),
            _flag(f[17]),
            int(f[18]),
        )
    if kind == "knob" and n == 4:
        return KnobCase(line, *map(_string, f[1:4]))
    if kind == "ahead" and n == 7:
        return AheadCase(line, _string(f[1]), _string(f[2]), int(f[3]), int(f[4]), _layer_list(f[5]), int(f[6]))
    return _prefetch_case(line, f)


def _prefetch_case(line: int, f: list[str]) -> Case:
    """A case of onebit_prefetch_parse: the prefetch consumer's kinds."""
    kind, n = f[0], len(f)
    if kind == "prefetch" and n == 9:
        return PrefetchCase(
            line,
            PrefetchEnv(*map(_string, f[1:4])),
            MODES[f[4]],
            PREFETCH_MODES[f[5]],
            int(f[6]),
            int(f[7]),
            int(f[8]),
        )
    if kind == "guard" and n == 4:
        return GuardCase(line, _string(f[1]), int(f[2]), int(f[3]))
    if kind == "room" and n == 4:
        return RoomCase(line, _string(f[1]), _float32(f[2]), int(f[3]))
    if kind == "route" and n == 10:
        return RouteCase(
            line,
            PrefetchEnv(mode=_string(f[1]), route=_string(f[2]), random=_string(f[3])),
            MODES[f[4]],
            PREFETCH_MODES[f[5]],
            _flag(f[6]),
            _flag(f[7]),
            _flag(f[8]),
            int(f[9]),
        )
    if kind == "wait" and n == 8:
        return WaitCase(
            line,
            PrefetchEnv(mode=_string(f[1]), route=_string(f[2]), wait=_string(f[3])),
            MODES[f[4]],
            PREFETCH_MODES[f[5]],
            _flag(f[6]),
            int(f[7]),
        )
    if kind == "keep" and n == 7:
        return KeepCase(
            line,
            PrefetchEnv(mode=_string(f[1]), route=_string(f[2]), keep=_string(f[3])),
            MODES[f[4]],
            _keep(f[5]),
            int(f[6]),
        )
    if kind == "order" and n == 7:
        return OrderCase(
            line,
            PrefetchEnv(mode=_string(f[1]), route=_string(f[2]), order=_string(f[3])),
            MODES[f[4]],
            _order(f[5]),
            int(f[6]),
        )
    if kind == "layers_ahead" and n == 7:
        return LayersAheadCase(
            line,
            PrefetchEnv(mode=_string(f[1]), route=_string(f[2]), layers=_string(f[3])),
            MODES[f[4]],
            int(f[5]),
            int(f[6]),
        )
    raise CaseFormatError(f"unknown kind {kind!r} or wrong number of fields ({n})")


def read_cases(path: Path = CASES_TSV) -> list[Case]:
    """Every case of the file, in file order; CaseFormatError names the first bad line."""
    cases: list[Case] = []
    with open(path, encoding="utf-8", newline="") as f:
        lines = f.read().split("\n")
    for number, text in enumerate(lines, start=1):
        text = text.removesuffix("\r")
        if not text or text.startswith("#"):
            continue
        fields = text.split("\t")
        try:
            if "" in fields:
                raise CaseFormatError("empty field")
            cases.append(_case(number, fields))
        except (ValueError, KeyError) as e:
            raise CaseFormatError(f"{path}:{number}: {e}") from e
    if not cases:
        raise CaseFormatError(f"{path}: no cases")
    return cases
