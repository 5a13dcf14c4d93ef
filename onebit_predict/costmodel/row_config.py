"""One configuration of a benchmark row, typed: the predictor, its consumer and their knobs.

A row of ``onebit-bench --memory-limit`` (checks/bench_memory.py) or ``--cold``
(checks/bench_cold.py), and the page model's play of it (costmodel/page_check.py), are one frozen
:class:`RowConfig`. Everything else comes from it:

- :attr:`RowConfig.name`: the display name (``block + advise, depth 16, room 0``);
- :meth:`RowConfig.env`: the ONEBIT_* variables the benchmark's worker runs with (the report's
  per-row ``env``);
- :meth:`RowConfig.knobs`: the same knobs for the C API (llama/runner.py ``Context(model,
  settings, knobs)``, llama/moe_api.py ``moe_params``): every variable the configuration
  controls, None where it takes the default, so that nothing leaks in from the process
  environment;
- :meth:`RowConfig.fields` and :meth:`RowConfig.from_fields`: the row's ``config`` object in a
  report, written and read back.

A report written before the ``config`` objects names its rows only: :func:`from_name` parses
those names, here and nowhere else (``block + advise, depth 16, no guard``, ``oracle + advise``).

The consumer reads at two moments (include/onebit-moe.h, docs/policy.md): ``consumer`` names the
workers' call (advise, read, populate) and, with a predictor, turns its speculative reads on;
``route`` reads each layer's routed experts as soon as its router ran (the peers' mechanism,
ONEBIT_MOE_PREFETCH_ROUTE; with a predictor, only what the prediction missed), with ``consumer``'s
call, or llama.cpp's default for it (populate) when the consumer is off. Names join the parts with
`` + ``: ``route``, ``block + populate + route``, ``oracle + advise + route``. ``random`` turns the
kernel's readahead off on the expert tensors (ONEBIT_MOE_PREFETCH_RANDOM, ``exact`` in the name).

A knob is a field declared with :func:`knob` (its variable, its word in the name, its type);
adding one is that one line: the name, the environment, the C API settings and the report's
fields follow. The oracle (the consumer spending the routing a trace of the same tokens
recorded, ONEBIT_MOE_PREFETCH_DEBUG_ORACLE, router mode) is the upper bound: it runs without the
room rule and the guard unless its fields say otherwise.

``read_ahead_kb`` is such a knob without a variable: the drive's readahead the row ran at
(``onebit-bench --memory-limit --read-ahead-kb``, set on the device, not in the environment),
``readahead 128`` in the name. None is unknown: a report before the field (those of this machine
ran at 8192), or a run that did not set it, whose report records the device's value once
(costmodel/measured.py reads that in).

``copy`` is one more (``patched off, copy 2``): the same configuration run again as a row of its own,
each round in its own process beside the first copy. Its ratio to the first copy (for ``patched off``,
its ``vs patched off``) is an A/A control: how far two runs of identical code differ in that cell, the
spread a ratio of another row must leave before it says anything.

``drive`` is another: the drive the row read the model from (``onebit-bench --memory-limit --drive
native,nvme,sata``): ``native`` the model where it is, ``nvme``, ``nvme-1m``, ``nvme-3g`` or ``sata`` the emulated drive
(onebit_predict/drive) serving it. Its qualifier is the value alone (``block + advise, nvme``: a
``bare`` knob, one of its ``choices``). None is unknown: a report before the field, or a run that
did not name a drive, whose report records the one it used (costmodel/measured.py reads that in).

A prompt-processing row (``onebit-bench --memory-limit --prompt-tokens 512 --ubatch 128``,
checks/bench_prefill.py) is a :class:`PrefillConfig`: a RowConfig, the prompt's tokens and the ubatch
(n_batch = n_ubatch), named with two qualifiers after the row's (``route, prefill 512, ubatch 128``;
:func:`prefill_from_name` reads them back). They are not knobs of RowConfig: the report keeps prefill
rows in a list of their own (``prefill_rows``), each with its ``config`` object as a decode row writes
it and ``prompt_tokens`` and ``ubatch`` beside it, so that decode rows and their readers do not change.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..constants import (
    ENV_AHEAD,
    ENV_DEPTH,
    ENV_MODE,
    ENV_PREFETCH,
    ENV_PREFETCH_DEBUG_HANDBACK,
    ENV_PREFETCH_DEBUG_ORACLE,
    ENV_PREFETCH_GUARD,
    ENV_PREFETCH_KEEP,
    ENV_PREFETCH_LAYERS,
    ENV_PREFETCH_ORDER,
    ENV_PREFETCH_RANDOM,
    ENV_PREFETCH_ROOM,
    ENV_PREFETCH_ROUTE,
    ENV_PREFETCH_THREADS,
    ENV_PREFETCH_WAIT,
    MODE_NAMES,
    MODE_OFF,
)
from ..drive.profiles import PROFILES

OFF = "patched off"  # the name of the predictor off
ORACLE = "oracle"  # the name's predictor for an oracle row
PREDICTORS = tuple(name for mode, name in MODE_NAMES.items() if mode != MODE_OFF)
CONSUMERS = ("off", "advise", "read", "populate", "pread")
ROUTE = "route"  # the name's part for route-time reads
EXACT = "exact"  # the name's qualifier for readahead off on the experts (random)
NATIVE = "native"  # the drive the model lives on, read where it is
DRIVES = (NATIVE, *PROFILES)  # and the emulated drives' profiles (onebit_predict/drive/profiles.py)
ORACLE_OFF = ("guard", "room")  # what the oracle runs without (0) unless its fields say otherwise


@dataclass(frozen=True)
class Knob:
    """A knob's metadata: its variable, its qualifier in the name (``word value``), its type."""

    env: str | None  # its ONEBIT_* variable (None: not a knob of llama.cpp's, such as a drive)
    word: str  # the qualifier is "<word> <value>"
    kind: type  # int, float or str
    low: float | None = None  # the smallest value it takes
    zero: str | None = None  # a qualifier of its own for the value 0 ("no guard")
    choices: tuple[str, ...] | None = None  # the values it takes (None: any of its kind)
    bare: bool = False  # the qualifier is the value alone ("nvme"), one of its choices

    def text(self, value: Any) -> str:
        """The value as its variable (and the name) writes it: 16, 0.5, 0."""
        if self.kind is not float:
            return str(value)
        short = f"{value:g}"
        return short if float(short) == value else repr(float(value))

    def qualifier(self, value: Any) -> str:
        if self.bare:
            return self.text(value)
        return self.zero if self.zero is not None and value == 0 else f"{self.word} {self.text(value)}"

    def read(self, value: Any, where: str) -> Any:
        """A value of a report's fields or a name, checked; ValueError naming ``where``."""
        if self.kind is str:
            ok = isinstance(value, str)
        elif self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (self.low is not None and value < self.low):
            bound = "" if self.low is None else f" >= {self.low:g}"
            raise ValueError(f"{where}: {self.word} {value!r} is not {self.kind.__name__}{bound}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{where}: {self.word} {value!r} is not one of {', '.join(self.choices)}")
        return self.kind(value)


def knob(
    env: str | None,
    word: str,
    kind: type,
    low: float | None = None,
    zero: str | None = None,
    choices: tuple[str, ...] | None = None,
    bare: bool = False,
) -> Any:
    """A knob field of :class:`RowConfig`: None (its default, unset) unless given."""
    if bare and not choices:
        raise ValueError(f"knob {word}: a bare qualifier needs its choices (a name must say which knob it is)")
    return field(default=None, metadata={"knob": Knob(env, word, kind, low, zero, choices, bare)})


@dataclass(frozen=True)
class RowConfig:
    """A configuration of the predictor and its consumer, as a benchmark row runs it."""

    predictor: str | None = None  # router, block, learned; None: the predictor off ("patched off")
    consumer: str = "off"  # the workers' call: off, advise, read, populate (with a predictor: speculative reads)
    oracle: bool = False  # the consumer spends a recorded trace's routing (router mode): the upper bound
    route: bool = False  # read each layer's routed experts at route time (the peers' mechanism)
    random: bool = False  # readahead off on the expert tensors (MADV_RANDOM): exact reads only
    # the knobs, None: the default (unset); one line each
    ahead: int | None = knob(ENV_AHEAD, "ahead", int, low=1)  # predict layer l+K from layer l
    depth: int | None = knob(ENV_DEPTH, "depth", int, low=1)  # candidates ranked per layer
    guard: int | None = knob(ENV_PREFETCH_GUARD, "guard", int, low=0, zero="no guard")  # tokens per probe
    room: float | None = knob(ENV_PREFETCH_ROOM, "room", float, low=0)  # the room rule's factor R
    workers: int | None = knob(ENV_PREFETCH_THREADS, "workers", int, low=1)  # the consumer's read workers
    read_ahead_kb: int | None = knob(None, "readahead", int, low=0)  # the drive's, set for the run
    drive: str | None = knob(None, "drive", str, choices=DRIVES, bare=True)  # where the model was read from
    wait: int | None = knob(ENV_PREFETCH_WAIT, "wait", int, low=0)  # route time: the layer waits for its reads
    keep: str | None = knob(ENV_PREFETCH_KEEP, "keep", str, choices=("kernel", "lru", "anon"))  # what stays cached
    order: str | None = knob(ENV_PREFETCH_ORDER, "order", str, choices=("index", "hits"))  # the matmuls' order
    layers: int | None = knob(ENV_PREFETCH_LAYERS, "layers", int, low=0)  # whole layers a batch reads ahead
    # layers: what becomes of a layer that ran (pageout, the knob's own, where the room holds fewer than all)
    handback: str | None = knob(ENV_PREFETCH_DEBUG_HANDBACK, "handback", str, choices=("none", "cold", "pageout"))
    # the A/A control: the same configuration again as a row of its own, its own process each round; its
    # ratio to the first copy is the spread between runs of identical code in that cell
    copy: int | None = knob(None, "copy", int, low=2)

    def __post_init__(self) -> None:
        if self.predictor is not None and self.predictor not in PREDICTORS:
            raise ValueError(f"unknown predictor {self.predictor!r} (one of {', '.join(PREDICTORS)}, or None)")
        if self.consumer not in CONSUMERS:
            raise ValueError(f"unknown consumer {self.consumer!r} (one of {', '.join(CONSUMERS)})")
        if self.consumer != "off" and self.predictor is None and not self.route:
            raise ValueError(f"the consumer {self.consumer} needs a predictor or route")
        if self.oracle and (self.predictor != "router" or self.consumer == "off"):
            raise ValueError("the oracle is a consumer (advise, read or populate) of the router predictor")
        if self.random and self.consumer == "off" and not self.route:
            raise ValueError("readahead off on the experts (random) needs the consumer on")
        if self.keep == "anon" and (self.consumer != "pread" or not self.route):
            raise ValueError("keep anon holds what pread reads at route time: it needs pread + route")
        for f, k in _knobs(type(self)):
            value = getattr(self, f.name)
            if value is not None:
                k.read(value, "a row's configuration")

    @property
    def is_off(self) -> bool:
        """The predictor off (``patched off``)."""
        return self.predictor is None

    @property
    def speculative(self) -> bool:
        """Whether the consumer reads predicted experts ahead of their layer."""
        return self.predictor is not None and self.consumer != "off"

    @property
    def name(self) -> str:
        """The display name: ``patched off``, ``router``, ``block + advise, depth 16, room 0``, ``oracle + advise``,
        ``route``, ``block + populate + route``."""
        parts = [] if self.predictor is None else [ORACLE if self.oracle else self.predictor]
        parts += [self.consumer] if self.consumer != "off" else []
        parts += [ROUTE] if self.route else []
        head = " + ".join(parts) or OFF
        return ", ".join([head, *([EXACT] if self.random else []), *(k.qualifier(v) for k, v in self._set())])

    def _set(self) -> list[tuple[Knob, Any]]:
        """The knobs given (not None), in field order."""
        return [(k, getattr(self, f.name)) for f, k in _knobs(type(self)) if getattr(self, f.name) is not None]

    def env(self, oracle_source: str | Path | None = None) -> dict[str, str]:
        """The ONEBIT_* variables of this configuration (what the worker runs with; an oracle's
        recorded routing ``oracle_source`` where given)."""
        out: dict[str, str] = {}
        if self.predictor is not None:
            out[ENV_MODE] = self.predictor
        if self.predictor is not None or self.route:
            out[ENV_PREFETCH] = self.consumer
        if self.route:
            out[ENV_PREFETCH_ROUTE] = "1"
        if self.random:
            out[ENV_PREFETCH_RANDOM] = "1"
        for f, k in _knobs(type(self)):
            value = getattr(self, f.name)
            if value is None and self.oracle and f.name in ORACLE_OFF:
                value = 0
            if value is not None and k.env is not None:
                out[k.env] = k.text(value)
        if self.oracle and oracle_source is not None:
            out[ENV_PREFETCH_DEBUG_ORACLE] = str(oracle_source)
        return out

    def knobs(self, oracle_source: str | Path | None = None) -> dict[str, str | None]:
        """The C API's settings (runner.Context, moe_api.moe_params): :meth:`env`, and None (the
        default, whatever the environment says) for every other variable this configuration controls."""
        knobs = [k.env for _, k in _knobs(type(self)) if k.env]
        controlled = [
            ENV_MODE,
            ENV_PREFETCH,
            ENV_PREFETCH_ROUTE,
            ENV_PREFETCH_RANDOM,
            ENV_PREFETCH_DEBUG_ORACLE,
            *knobs,
        ]
        return {name: None for name in controlled} | self.env(oracle_source)

    def consumer_off(self) -> RowConfig:
        """The same predictor (at the same lookahead, on the same drive and its setting) with the consumer
        off: the never-a-loss baseline."""
        return type(self)(self.predictor, ahead=self.ahead, read_ahead_kb=self.read_ahead_kb, drive=self.drive)

    def predictor_off(self) -> RowConfig:
        """The predictor off on the same drive and setting: what ``vs patched off`` compares with."""
        return type(self)(read_ahead_kb=self.read_ahead_kb, drive=self.drive)

    def fields(self) -> dict[str, Any]:
        """The ``config`` object of a report's row."""
        return dataclasses.asdict(self)

    @classmethod
    def from_fields(cls, data: Any, where: str = "config") -> RowConfig:
        """A report row's ``config`` object; ValueError (naming ``where``) when it is not one."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} is not an object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"{where}: unknown fields {unknown} (a report of a later version?)")
        kw: dict[str, Any] = {}
        for f, k in _knobs(cls):
            if data.get(f.name) is not None:
                kw[f.name] = k.read(data[f.name], where)
        predictor, consumer, oracle = data.get("predictor"), data.get("consumer", "off"), data.get("oracle", False)
        route, random = data.get("route", False), data.get("random", False)
        if not (predictor is None or isinstance(predictor, str)) or not isinstance(consumer, str):
            raise ValueError(f"{where}: predictor and consumer are strings")
        if not all(isinstance(b, bool) for b in (oracle, route, random)):
            raise ValueError(f"{where}: oracle, route and random are true or false")
        try:
            return cls(predictor, consumer, oracle, route, random, **kw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def _knobs(cls: type = RowConfig) -> list[tuple[dataclasses.Field, Knob]]:
    """The knob fields of a configuration class, in field order."""
    return [(f, f.metadata["knob"]) for f in dataclasses.fields(cls) if "knob" in f.metadata]


def from_name(name: str) -> RowConfig | None:
    """The configuration a report written before the ``config`` objects names (None when the name
    is not one: ``patched off, warm``, ``router + trace``, ...). The only reader of names."""
    head, *quals = [x.strip() for x in name.split(",")]
    kw: dict[str, Any] = {"consumer": "off"}
    if head != OFF:
        for part in (x.strip() for x in head.split(" + ")):
            if part == ORACLE and not kw.get("predictor"):
                kw |= {"predictor": "router", "oracle": True}
            elif part in PREDICTORS and not kw.get("predictor"):
                kw["predictor"] = part
            elif part in CONSUMERS[1:] and kw["consumer"] == "off":
                kw["consumer"] = part
            elif part == ROUTE and not kw.get("route"):
                kw["route"] = True
            else:
                return None
    by_word = {k.word: (f.name, k) for f, k in _knobs() if not k.bare}
    zeros = {k.zero: f.name for f, k in _knobs() if k.zero is not None}
    bare = {value: f.name for f, k in _knobs() if k.bare for value in k.choices or ()}
    for q in quals:
        word, _, text = q.partition(" ")
        if q == EXACT:
            kw["random"] = True
        elif q in zeros:
            kw[zeros[q]] = 0
        elif q in bare:
            kw[bare[q]] = q
        elif word in by_word and text:
            fname, k = by_word[word]
            try:
                kw[fname] = k.read(k.kind(text), name)
            except ValueError:
                return None
        else:
            return None
    try:
        return RowConfig(**kw)
    except ValueError:
        return None


PREFILL = "prefill"  # the prefill row's qualifier: "prefill 512", the prompt's tokens
UBATCH = "ubatch"  # ... and "ubatch 128": n_batch = n_ubatch of its run


@dataclass(frozen=True)
class PrefillConfig:
    """A prompt-processing row: a configuration processing a prompt of ``prompt_tokens`` tokens in
    ubatches of ``ubatch`` (its name: the row's, then ``prefill N, ubatch U``)."""

    row: RowConfig
    prompt_tokens: int
    ubatch: int

    def __post_init__(self) -> None:
        for word, v in ((PREFILL, self.prompt_tokens), (UBATCH, self.ubatch)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"a prefill row's {word} {v!r} is not a positive integer")

    @property
    def name(self) -> str:
        return f"{self.row.name}, {PREFILL} {self.prompt_tokens}, {UBATCH} {self.ubatch}"

    def predictor_off(self) -> PrefillConfig:
        """The predictor off on the same drive and setting, at the same prompt and ubatch: its ``vs patched off``."""
        return PrefillConfig(self.row.predictor_off(), self.prompt_tokens, self.ubatch)

    def fields(self) -> dict[str, Any]:
        """The prefill row's ``config``, ``prompt_tokens`` and ``ubatch`` (the report's ``prefill_rows``)."""
        return {"config": self.row.fields(), "prompt_tokens": self.prompt_tokens, "ubatch": self.ubatch}

    @classmethod
    def from_fields(cls, data: Any, where: str = "prefill row") -> PrefillConfig:
        """A report's prefill row (its ``config``, ``prompt_tokens``, ``ubatch``); ValueError naming ``where``."""
        if not isinstance(data, dict):
            raise ValueError(f"{where} is not an object")
        row = RowConfig.from_fields(data.get("config"), f"{where}: config")
        try:
            return cls(row, data.get("prompt_tokens"), data.get("ubatch"))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def prefill_from_name(name: str) -> PrefillConfig | None:
    """The prefill row a name says (``route, prefill 512, ubatch 128``); None when it is not one."""
    head, sep, tail = name.rpartition(f", {PREFILL} ")
    n, sep2, u = tail.partition(f", {UBATCH} ")
    if not (sep and sep2 and n.isdigit() and u.isdigit()) or (row := from_name(head)) is None:
        return None
    try:
        return PrefillConfig(row, int(n), int(u))
    except ValueError:
        return None
