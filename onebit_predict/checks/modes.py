"""The modes of onebit-bitident: their grammar and what each asks of the context.

A mode is ``PREDICTOR[@K][+CALL][+route[+exact][+wait][+lru][+anon][+hits][+layers]]`` or
``[CALL+]route[+exact][+wait][+lru][+anon][+hits][+layers]`` (checks/bitident.py says what each part
sets); parse_mode reads one into a ModeSpec, or says in a ValueError what is unknown or misplaced.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..constants import (
    AHEAD_MAX,
    KEEP_ANON,
    KEEP_KERNEL,
    KEEP_LRU,
    PREFETCH_ADVISE,
    PREFETCH_NAMES,
    PREFETCH_OFF,
    PREFETCH_PREAD,
    PREFETCH_ROUTE_CALL,
)

PREDICTORS = ("router", "block", "learned")
CONSUMERS = tuple(name for name in PREFETCH_NAMES.values() if name != "off")
ROUTE = "route"  # route-time reads (ONEBIT_MOE_PREFETCH_ROUTE=1): the last part before its qualifiers
QUALIFIERS = ("exact", "wait", "lru", "anon", "hits", "layers")  # route time's qualifiers, after +route, in this order


@dataclass(frozen=True)
class ModeSpec:
    """A mode, parsed (parse_mode)."""

    predictor: str  # router, block, learned, or off (route time alone; "off" itself is the reference)
    ahead: int  # the K of @K, 1 without it
    consumer: str | None  # the call named (advise, read, populate, pread), None: none named
    route: bool = False  # +route
    exact: bool = False  # +exact: ONEBIT_MOE_PREFETCH_RANDOM=1
    wait: bool = False  # +wait: ONEBIT_MOE_PREFETCH_WAIT=1
    lru: bool = False  # +lru: ONEBIT_MOE_PREFETCH_KEEP=lru
    anon: bool = False  # +anon: ONEBIT_MOE_PREFETCH_KEEP=anon (the LRU in memory of its own; pread, the wait)
    hits: bool = False  # +hits: ONEBIT_MOE_PREFETCH_ORDER=hits
    layers: bool = False  # +layers: ONEBIT_MOE_PREFETCH_LAYERS=LAYERS

    @property
    def keeps(self) -> bool:
        """Whether an LRU keeps route's reads (+lru or +anon)."""
        return self.lru or self.anon

    @property
    def keep(self) -> int:
        """The keep the context's counters must show: KEEP_ANON, KEEP_LRU or KEEP_KERNEL."""
        return KEEP_ANON if self.anon else KEEP_LRU if self.lru else KEEP_KERNEL

    @property
    def call(self) -> str:
        """The call the trace header must record: the one named, route time's own (read) without one."""
        if self.consumer is not None:
            return self.consumer
        return PREFETCH_NAMES[PREFETCH_ROUTE_CALL if self.route else PREFETCH_OFF]


def _bad(mode: str, why: str) -> ValueError:
    return ValueError(f"mode {mode!r}: {why}")


def _qualifiers(mode: str, quals: list[str]) -> None:
    """ValueError unless ``quals`` (the parts after +route) are qualifiers, each once, in order."""
    for q in quals:
        if q == ROUTE:
            raise _bad(mode, "+route twice")
        if q in CONSUMERS:
            raise _bad(mode, f"the call {q} is misplaced: it comes before +route")
        if q not in QUALIFIERS:
            raise _bad(mode, f"{q!r} is not a qualifier of +route ({', '.join(QUALIFIERS)})")
    if len(set(quals)) != len(quals) or quals != sorted(quals, key=QUALIFIERS.index):
        raise _bad(mode, f"+route's qualifiers are written once each, in the order {'+'.join(QUALIFIERS)}")


def _head(mode: str, head: list[str], route: bool) -> tuple[str, int, str | None]:
    """(predictor, ahead, call) of the parts before +route (all of them without it)."""
    for p in head:
        if p in QUALIFIERS:
            raise _bad(mode, f"+{p} qualifies route time: it comes after +route")
    if not head:  # route alone
        return "off", 1, None
    if head[0] in CONSUMERS and route and len(head) == 1:  # CALL+route: the predictor off
        return "off", 1, head[0]
    predictor, at, k = head[0].partition("@")
    if predictor not in PREDICTORS:
        if head[0] in CONSUMERS:
            raise _bad(mode, f"the call {head[0]} without a predictor needs +route")
        raise _bad(mode, f"{head[0]!r} is not a predictor ({', '.join(PREDICTORS)}) or a call ({', '.join(CONSUMERS)})")
    if at and k not in [str(i) for i in range(1, AHEAD_MAX + 1)]:
        raise _bad(mode, f"@{k} is not a lookahead of 1..{AHEAD_MAX}")
    if len(head) > 2:
        raise _bad(mode, f"one call at most before +route, not {'+'.join(head[1:])}")
    if len(head) == 2 and head[1] not in CONSUMERS:
        raise _bad(mode, f"{head[1]!r} is not a call ({', '.join(CONSUMERS)})")
    return predictor, int(k) if at else 1, head[1] if len(head) == 2 else None


def parse_mode(mode: str) -> ModeSpec:
    """A mode of the module's grammar, or ``off`` (the reference), as a ModeSpec; ValueError naming what is
    unknown or misplaced."""
    if mode == "off":
        return ModeSpec("off", 1, None)
    parts = mode.split("+")
    route = ROUTE in parts
    head, quals = (parts[: parts.index(ROUTE)], parts[parts.index(ROUTE) + 1 :]) if route else (parts, [])
    _qualifiers(mode, quals)
    predictor, ahead, consumer = _head(mode, head, route)
    if "wait" in quals and consumer == PREFETCH_NAMES[PREFETCH_ADVISE]:
        raise _bad(mode, "+wait needs a call that finishes its reads (read, populate or pread), not advise")
    if "anon" in quals and (consumer != PREFETCH_NAMES[PREFETCH_PREAD] or "lru" in quals):
        raise _bad(mode, "+anon is the LRU in memory of its own: it reads with pread and is not +lru as well")
    if "anon" in quals and "wait" not in quals and "hits" not in quals:
        raise _bad(mode, "+anon waits for its reads, the layer (+wait) or each expert's matmul (+hits): name which")
    return ModeSpec(predictor, ahead, consumer, route, *(q in quals for q in QUALIFIERS))


def split_mode(mode: str) -> tuple[str, str | None]:
    """``block+read`` -> ("block", "read"); ``router`` -> ("router", None); ``router@2`` ->
    ("router", None) (the distance: mode_ahead); ``block+read+route+wait`` -> ("block", "read")
    (route time: mode_route); ``route`` -> ("off", None); ``pread+route`` -> ("off", "pread").
    ValueError if unknown (parse_mode)."""
    spec = parse_mode(mode)
    return spec.predictor, spec.consumer


def mode_route(mode: str) -> bool:
    """Whether ``mode`` reads at route time (``+route``, or route alone)."""
    return parse_mode(mode).route


def mode_ahead(mode: str) -> int:
    """The K of ``PREDICTOR@K[+CALL]...``, 1 without ``@K``."""
    return parse_mode(mode).ahead
