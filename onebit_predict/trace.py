"""Read a P/A trace (docs/trace-format.md): a validated header and memory-mapped records.

The records are a numpy memmap with a structured dtype built from the header's
``n_expert_used`` and ``depth``, so a trace of any size is read without one Python object
per record, and ``Trace.iter_chunks`` walks it in bounded memory. A bad header raises
``TraceError`` naming the field, its value and the range it must lie in (every field is
bounded: docs/trace-format.md, "Bounds a reader enforces"), so no later int32 or size
arithmetic can overflow; a partial last record (a crash mid-write) is dropped with a logged
warning.

A record's ``distance`` (version 3, record offset 18) is how many layers ahead its
prediction was made: a PREDICTED record of layer l was predicted from layer l - distance.
Versions 1 and 2 left the field zero and always predicted one layer ahead; ``record_distances``
gives every version's records their distance (1 for a version 1/2 PREDICTED record) and
refuses a version-3 record whose distance is out of bounds with ``TraceError``.
``Trace.iter_chunks`` yields records with the field so defined and checked; ``Trace.records``
is the file's bytes as they are.

Two header flags say whether the file is whole: ``OPEN`` (the writer has not freed its context:
it died or is still running) and ``INCOMPLETE`` (a write of records failed, e.g. on a full
disk). ``Trace.open`` reads such a trace and warns once; ``written_problem`` is the verdict of a
command that has just written one (``onebit-trace``, ``onebit-bitident``): it must not report
success for it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .constants import (
    AHEAD_MAX,
    MAX_LAYERS,
    MODE_NAMES,
    MODE_ROUTER,
    PREFETCH_GUARD_MAX,
    PREFETCH_MAX_BYTES_LIMIT,
    PREFETCH_NAMES,
    PREFETCH_THREADS_MAX,
    TRACE_ARCH_BYTES,
    TRACE_CHUNK_RECORDS,
    TRACE_FLAG_PREDICTED,
    TRACE_HDR_AHEAD_MASK,
    TRACE_HDR_AHEAD_SHIFT,
    TRACE_HDR_FLAG_PREFETCH_TOTALS,
    TRACE_HDR_FLAGS_KNOWN,
    TRACE_HEADER_SIZE,
    TRACE_MAGIC,
    TRACE_MAX_DEPTH,
    TRACE_MAX_DEPTH_REQUESTED,
    TRACE_MAX_ERRNO,
    TRACE_MAX_EXPERTS,
    TRACE_MAX_PREFETCH_TOTAL,
    TRACE_MODEL_BYTES,
    TRACE_RECORD_FIXED,
    TRACE_VERSION,
    TRACE_VERSION_DISTANCE,
    TRACE_VERSIONS_READ,
)
from .trace_flags import HeaderFlags

logger = logging.getLogger(__name__)

# Version 3: record offset 18 (reserved and zero before) is the lookahead distance K of a
# PREDICTED record (ONEBIT_MOE_PREDICT_AHEAD, 1..AHEAD_MAX), zero on the others.
TRACE_MAX_DISTANCE = AHEAD_MAX  # a record's largest distance: ONEBIT_MOE_PREDICT_AHEAD's largest K

HEADER_DTYPE = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("header_size", "<u4"),
        ("record_size", "<u4"),
        ("n_layer", "<u4"),
        ("n_expert", "<u4"),
        ("n_expert_used", "<u4"),
        ("depth", "<u4"),
        ("mode", "<u4"),
        ("depth_requested", "<i4"),
        ("margin", "<f4"),
        ("min_read", "<u4"),
        ("flags", "<u4"),
        ("layer_mask", "u1", (MAX_LAYERS // 8,)),
        ("arch", f"S{TRACE_ARCH_BYTES}"),
        ("model", f"S{TRACE_MODEL_BYTES}"),
        # version 2: the prefetch consumer (zero in version 1 and when it was off)
        ("prefetch_mode", "<u4"),
        ("prefetch_threads", "<u4"),
        ("prefetch_max_bytes", "<i8"),
        ("prefetch_totals", "<u8", (9,)),  # PrefetchTotals, in field order
        ("prefetch_errors", "<u4", (4,)),  # (errno, ranges) x 2, most frequent first
    ]
)
assert HEADER_DTYPE.itemsize == TRACE_HEADER_SIZE


class PrefetchTotals(NamedTuple):
    """What the prefetch consumer did over the whole context (written when it was freed)."""

    experts: int  # experts issued
    ranges: int  # byte ranges issued, one per expert slice of a tensor
    bytes: int  # bytes issued, page-rounded
    resident_ranges: int  # ranges already wholly resident
    resident_bytes: int  # bytes already resident when issued
    failed: int  # ranges whose madvise or mincore failed
    dropped_bytes: int  # bytes the _MAX_BYTES cap kept from being issued
    queue_full: int  # read mode: ranges not queued (workers behind)
    touched_bytes: int  # read mode: bytes the workers touched
    errors: tuple[tuple[int, int], ...]  # (errno, ranges), the two most frequent


class TraceError(ValueError):
    """The file is not a trace this reader can read (bad magic, version, or a field out of bounds)."""


def record_size(n_expert_used: int, depth: int) -> int:
    """Bytes per record for a model using ``n_expert_used`` experts and ``depth`` candidates."""
    return TRACE_RECORD_FIXED + 8 * n_expert_used + 8 * depth


def record_dtype(n_expert_used: int, depth: int) -> np.dtype:
    """The structured dtype of one record (little-endian, packed, ``record_size`` bytes)."""
    dt = np.dtype(
        [
            ("step", "<u4"),
            ("seq_id", "<i4"),
            ("pos", "<i4"),
            ("layer", "<u2"),
            ("n_read", "<u2"),
            ("flags", "<u2"),
            ("distance", "<u2"),  # version 3: layers ahead (PREDICTED), else 0; versions 1, 2: 0
            ("actual_ids", "<i4", (n_expert_used,)),
            ("actual_w", "<f4", (n_expert_used,)),
            ("pred_ids", "<i4", (depth,)),
            ("pred_logits", "<f4", (depth,)),
        ]
    )
    assert dt.itemsize == record_size(n_expert_used, depth)
    return dt


def _c_string(raw: bytes) -> str:
    """A NUL-padded field as text (up to the first NUL; bad UTF-8, e.g. a cut character, replaced)."""
    return raw.split(b"\0", 1)[0].decode("utf-8", errors="replace")


@dataclass(frozen=True)
class TraceHeader(HeaderFlags):
    """Every field of the 512-byte header, with the mask and the strings decoded (the flags word's
    bits and fields: the properties of ``HeaderFlags``)."""

    version: int
    header_size: int
    record_size: int
    n_layer: int
    n_expert: int
    n_expert_used: int
    depth: int
    mode: int
    depth_requested: int
    margin: float  # +inf when no margin gate was set
    min_read: int
    flags: int
    layer_mask: frozenset[int]  # the predicted layers
    arch: str
    model: str
    prefetch_mode: int = 0  # PREFETCH_OFF, _ADVISE, _READ, _POPULATE
    prefetch_threads: int = 0
    prefetch_max_bytes: int = 0  # per token, 0 = no cap
    prefetch_totals: PrefetchTotals | None = None  # None unless the consumer ran and the context was freed

    @classmethod
    def build(
        cls,
        *,
        n_layer: int,
        n_expert: int,
        n_expert_used: int,
        depth: int | None = None,
        mode: int = MODE_ROUTER,
        depth_requested: int | None = None,
        margin: float = math.inf,
        min_read: int | None = None,
        flags: int = 0,
        layers: Iterable[int] | None = None,
        arch: str = "",
        model: str = "",
        version: int = TRACE_VERSION,
        ahead: int = 1,
    ) -> TraceHeader:
        """A header (of the version this package writes, unless ``version`` says) with the sizes
        filled in and llama.cpp's defaults.

        depth defaults to ``n_expert_used``, depth_requested to the depth given (0 if none),
        min_read to ``min(n_expert_used, depth)``, layers to ``1 .. n_layer-1``. A version-3
        trace's PREDICTED records need their ``distance`` set (1..3): a writer of version 2
        leaves it zero; its flags carry ``ahead`` (bits 8..11).
        """
        if version >= TRACE_VERSION_DISTANCE and not flags & TRACE_HDR_AHEAD_MASK:
            flags |= ahead << TRACE_HDR_AHEAD_SHIFT
        if depth_requested is None:
            depth_requested = 0 if depth is None else depth
        depth = n_expert_used if depth is None else depth
        return cls(
            version=version,
            header_size=TRACE_HEADER_SIZE,
            record_size=record_size(n_expert_used, depth),
            n_layer=n_layer,
            n_expert=n_expert,
            n_expert_used=n_expert_used,
            depth=depth,
            mode=mode,
            depth_requested=depth_requested,
            margin=margin,
            min_read=min(n_expert_used, depth) if min_read is None else min_read,
            flags=flags,
            layer_mask=frozenset(range(1, n_layer)) if layers is None else frozenset(layers),
            arch=arch,
            model=model,
        )

    @classmethod
    def from_bytes(cls, buf: bytes) -> TraceHeader:
        """Decode and validate a header; raise TraceError on anything this reader cannot use."""
        if len(buf) < TRACE_HEADER_SIZE:
            raise TraceError(f"file is {len(buf)} bytes, shorter than the {TRACE_HEADER_SIZE}-byte header")
        raw = np.frombuffer(buf, dtype=HEADER_DTYPE, count=1)[0]
        magic = bytes(buf[:8])
        if magic != TRACE_MAGIC:
            raise TraceError(f"bad magic {magic!r} (expected {TRACE_MAGIC!r}): not a P/A trace")
        if raw["version"] not in TRACE_VERSIONS_READ:
            known = ", ".join(str(v) for v in TRACE_VERSIONS_READ)
            raise TraceError(f"trace version {raw['version']} is not supported (this reader knows versions {known})")
        has_prefetch = raw["version"] >= 2  # version 1 left offsets 408.. unused
        problems = []  # what only the raw bytes show; _validate adds the rest
        strings = (("arch", 120, TRACE_ARCH_BYTES), ("model", 120 + TRACE_ARCH_BYTES, TRACE_MODEL_BYTES))
        for name, offset, size in strings:
            if buf[offset + size - 1] != 0:  # the writer copies at most size-1 bytes
                problems.append(f"{name} is not NUL-terminated within its {size} bytes")
        if not has_prefetch and raw["flags"] & TRACE_HDR_FLAG_PREFETCH_TOTALS:
            problems.append(f"flags {int(raw['flags']):#x}: bit 3 (PREFETCH_TOTALS) is set in a version-1 trace")
        totals = None
        if has_prefetch and raw["flags"] & TRACE_HDR_FLAG_PREFETCH_TOTALS:
            for i, (e, n) in enumerate(zip(raw["prefetch_errors"][0::2], raw["prefetch_errors"][1::2])):
                if n > 0 and not 1 <= e <= TRACE_MAX_ERRNO:
                    problems.append(f"prefetch_errors[{i}] errno {int(e)} is not in 1..{TRACE_MAX_ERRNO}")
            err = [int(x) for x in raw["prefetch_errors"]]
            errors = tuple((err[i], err[i + 1]) for i in (0, 2) if err[i + 1] > 0)
            totals = PrefetchTotals(*(int(x) for x in raw["prefetch_totals"]), errors=errors)
        mask_bits = np.unpackbits(raw["layer_mask"], bitorder="little")
        header = cls(
            version=int(raw["version"]),
            header_size=int(raw["header_size"]),
            record_size=int(raw["record_size"]),
            n_layer=int(raw["n_layer"]),
            n_expert=int(raw["n_expert"]),
            n_expert_used=int(raw["n_expert_used"]),
            depth=int(raw["depth"]),
            mode=int(raw["mode"]),
            depth_requested=int(raw["depth_requested"]),
            margin=float(raw["margin"]),
            min_read=int(raw["min_read"]),
            flags=int(raw["flags"]),
            layer_mask=frozenset(int(i) for i in np.flatnonzero(mask_bits)),
            arch=_c_string(raw["arch"]),
            model=_c_string(raw["model"]),
            prefetch_mode=int(raw["prefetch_mode"]) if has_prefetch else 0,
            prefetch_threads=int(raw["prefetch_threads"]) if has_prefetch else 0,
            prefetch_max_bytes=int(raw["prefetch_max_bytes"]) if has_prefetch else 0,
            prefetch_totals=totals,
        )
        header._validate(problems)
        return header

    def _validate(self, problems: list[str]) -> None:
        """Add every field out of its bounds to ``problems``; raise TraceError if there are any.

        The bounds are docs/trace-format.md's "Bounds a reader enforces". The layer mask is
        not bounded here: its 512 bits cannot overflow anything, and a bit at or above
        n_layer (or layer 0) is reported by onebit-stats' consistency control instead.
        """
        problems += self._shape_problems() + self._policy_problems() + self._prefetch_problems()
        if problems:
            raise TraceError("bad trace header: " + "; ".join(problems))

    def _shape_problems(self) -> list[str]:
        """The sizes: header, layers, experts, top-k, depth and the record size they give."""
        problems = []
        if self.header_size != TRACE_HEADER_SIZE:
            problems.append(f"header_size {self.header_size} != {TRACE_HEADER_SIZE}")
        if not 1 <= self.n_layer <= MAX_LAYERS:
            problems.append(f"n_layer {self.n_layer} is not in 1..{MAX_LAYERS}")
        if not 1 <= self.n_expert <= TRACE_MAX_EXPERTS:
            problems.append(f"n_expert is {self.n_expert}, not in 1..{TRACE_MAX_EXPERTS}")
        top = f"n_expert ({self.n_expert})" if self.n_expert <= TRACE_MAX_DEPTH else str(TRACE_MAX_DEPTH)
        for name in ("n_expert_used", "depth"):
            if not 1 <= getattr(self, name) <= min(self.n_expert, TRACE_MAX_DEPTH):
                problems.append(f"{name} {getattr(self, name)} is not in 1..{top}")
        if self.record_size != record_size(self.n_expert_used, self.depth):
            problems.append(
                f"record_size {self.record_size} != {record_size(self.n_expert_used, self.depth)}"
                f" (20 + 8*n_expert_used + 8*depth with n_expert_used={self.n_expert_used}, depth={self.depth})"
            )
        return problems

    def _policy_problems(self) -> list[str]:
        """The predictor's settings and the flags."""
        problems = []
        if self.mode not in MODE_NAMES:
            known = ", ".join(f"{k} {v}" for k, v in MODE_NAMES.items())
            problems.append(f"unknown mode {self.mode} (known: {known})")
        if not 0 <= self.depth_requested <= TRACE_MAX_DEPTH_REQUESTED:
            problems.append(f"depth_requested {self.depth_requested} is not in 0..{TRACE_MAX_DEPTH_REQUESTED}")
        if not self.margin >= 0:  # also rejects NaN
            problems.append(f"margin {self.margin} is not a non-negative number or +inf")
        if self.min_read > self.depth:
            problems.append(f"min_read {self.min_read} exceeds depth {self.depth}")
        ahead = (self.flags & TRACE_HDR_AHEAD_MASK) >> TRACE_HDR_AHEAD_SHIFT
        if self.version >= TRACE_VERSION_DISTANCE and not 1 <= ahead <= TRACE_MAX_DISTANCE:
            problems.append(f"ahead {ahead} (flags bits 8..11) is not in 1..{TRACE_MAX_DISTANCE}")
        elif self.version < TRACE_VERSION_DISTANCE and ahead:
            problems.append(f"ahead {ahead} in flags bits 8..11 of a version {self.version} trace (zero there)")
        if self.prefetch_guard > PREFETCH_GUARD_MAX:
            problems.append(
                f"prefetch guard {self.prefetch_guard} (flags bits 16..23) is not in 0..{PREFETCH_GUARD_MAX}"
            )
        if self.flags & ~TRACE_HDR_FLAGS_KNOWN:
            unknown = self.flags & ~TRACE_HDR_FLAGS_KNOWN
            problems.append(f"flags {self.flags:#x} has unknown bits {unknown:#x} (known: {TRACE_HDR_FLAGS_KNOWN:#x})")
        return problems

    def _prefetch_problems(self) -> list[str]:
        """The prefetch consumer's fields (zero in version 1)."""
        problems = []
        if self.prefetch_mode not in PREFETCH_NAMES:
            known = ", ".join(f"{k} {v}" for k, v in PREFETCH_NAMES.items())
            problems.append(f"unknown prefetch mode {self.prefetch_mode} (known: {known})")
        if not 0 <= self.prefetch_threads <= PREFETCH_THREADS_MAX:
            problems.append(f"prefetch_threads {self.prefetch_threads} is not in 0..{PREFETCH_THREADS_MAX}")
        if self.prefetch_max_bytes < 0:
            problems.append(f"prefetch cap {self.prefetch_max_bytes} is negative")
        elif self.prefetch_max_bytes > PREFETCH_MAX_BYTES_LIMIT:
            problems.append(f"prefetch_max_bytes {self.prefetch_max_bytes} is not in 0..{PREFETCH_MAX_BYTES_LIMIT}")
        if self.prefetch_totals is not None:
            for name, value in zip(PrefetchTotals._fields, self.prefetch_totals[:9]):
                if value > TRACE_MAX_PREFETCH_TOTAL:
                    problems.append(f"prefetch_totals.{name} {value} is not in 0..{TRACE_MAX_PREFETCH_TOTAL}")
        return problems

    def to_bytes(self) -> bytes:
        """Encode as the 512-byte header (no validation: tests write bad headers with it)."""
        raw = np.zeros((), dtype=HEADER_DTYPE)
        for name in (
            "version",
            "header_size",
            "record_size",
            "n_layer",
            "n_expert",
            "n_expert_used",
            "depth",
            "mode",
            "depth_requested",
            "margin",
            "min_read",
            "flags",
            "prefetch_mode",
            "prefetch_threads",
            "prefetch_max_bytes",
        ):
            raw[name] = getattr(self, name)
        if self.prefetch_totals is not None:
            raw["flags"] |= TRACE_HDR_FLAG_PREFETCH_TOTALS
            raw["prefetch_totals"] = self.prefetch_totals[:9]
            errors = [x for pair in self.prefetch_totals.errors[:2] for x in pair]
            raw["prefetch_errors"] = errors + [0] * (4 - len(errors))
        raw["magic"] = TRACE_MAGIC
        bits = np.zeros(MAX_LAYERS, dtype=np.uint8)
        bits[sorted(self.layer_mask)] = 1
        raw["layer_mask"] = np.packbits(bits, bitorder="little")
        raw["arch"] = self.arch.encode()[: TRACE_ARCH_BYTES - 1]
        raw["model"] = self.model.encode()[: TRACE_MODEL_BYTES - 1]
        return raw.tobytes()

    @property
    def mode_name(self) -> str:
        return MODE_NAMES[self.mode]

    @property
    def prefetch_name(self) -> str:
        return PREFETCH_NAMES[self.prefetch_mode]

    @property
    def dtype(self) -> np.dtype:
        """The structured dtype of this trace's records."""
        return record_dtype(self.n_expert_used, self.depth)

    @property
    def has_distance(self) -> bool:
        """The records carry their lookahead distance (version 3); before, every prediction is 1 ahead."""
        return self.version >= TRACE_VERSION_DISTANCE


def record_distances(header: TraceHeader, rows: np.ndarray, first: int = 0, path: Path | None = None) -> np.ndarray:
    """The lookahead distance of each record of ``rows`` (u16): 0 for a record without PREDICTED.

    Versions 1 and 2: 1 for every PREDICTED record (the field is reserved there and not read).
    Version 3: the field, checked against docs/trace-format.md's bounds: a PREDICTED record's
    distance in 1..TRACE_MAX_DISTANCE and at most its layer, any other record's 0; a record
    outside them raises TraceError naming the first (``first`` is the index of ``rows[0]`` in
    the file, ``path`` the file, for the message).
    """
    predicted = (rows["flags"] & TRACE_FLAG_PREDICTED) != 0
    if not header.has_distance:
        return predicted.astype(np.uint16)
    if header.debug_self:
        # the control ranks each layer by its own router: llama.cpp writes distance 0, and its rows
        # are scored where a one-layer-ahead prediction would be
        raw = np.asarray(rows["distance"], dtype=np.uint16)
        if raw.any():
            i = int(np.flatnonzero(raw)[0])
            where = f"{path}: " if path is not None else ""
            raise TraceError(
                f"{where}bad trace record {first + i}: distance {int(raw[i])} in a DEBUG_SELF control trace (must be 0)"
            )
        return predicted.astype(np.uint16)
    d = np.asarray(rows["distance"], dtype=np.uint16)
    layer = rows["layer"]
    bad = np.where(predicted, (d < 1) | (d > TRACE_MAX_DISTANCE) | (layer < d), d != 0)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        r = rows[i]
        if not predicted[i]:
            why = f"distance {int(d[i])} on a record without PREDICTED (must be 0)"
        elif not 1 <= d[i] <= TRACE_MAX_DISTANCE:
            why = f"distance {int(d[i])} is not in 1..{TRACE_MAX_DISTANCE}"
        else:
            why = f"distance {int(d[i])} exceeds the record's layer {int(layer[i])}: no layer predicts it"
        where = f"{path}: " if path is not None else ""
        raise TraceError(
            f"{where}bad trace record {first + i} (step {int(r['step'])}, seq {int(r['seq_id'])}, pos {int(r['pos'])},"
            f" layer {int(r['layer'])}, flags {int(r['flags']):#x}): {why}"
            f" ({int(bad.sum())} of records {first}..{first + len(rows) - 1} have a distance out of bounds)"
        )
    return d


@dataclass(frozen=True, eq=False)
class Trace:
    """An open trace: its header and its whole records as a read-only memmap."""

    path: Path
    header: TraceHeader
    records: np.ndarray  # structured, header.dtype, shape (n_records,)
    dropped_bytes: int  # bytes of a partial last record that were ignored

    @classmethod
    def open(cls, path: str | Path) -> Trace:
        """Open and validate ``path``; OSError if it cannot be read, TraceError if it is not a trace."""
        path = Path(path)
        with path.open("rb") as f:
            try:
                header = TraceHeader.from_bytes(f.read(TRACE_HEADER_SIZE))
            except TraceError as e:  # the message names the file: a command may open several
                raise TraceError(f"{path}: {e}") from None
        body = path.stat().st_size - TRACE_HEADER_SIZE
        n_records, dropped = divmod(body, header.record_size)
        if dropped:
            logger.warning(
                "%s: truncated trace: dropped %d bytes of a partial last record (read %d whole records)",
                path,
                dropped,
                n_records,
            )
        # every command reads its traces here: a file its writer did not finish is read, with a warning
        if header.open:
            logger.warning(
                "%s: not closed cleanly (the writer died or is still running): %d records read, totals unknown",
                path,
                n_records,
            )
        if header.incomplete:
            logger.warning(
                "%s: incomplete: record write(s) failed (full disk?); the table covers only the %d records written",
                path,
                n_records,
            )
        if n_records:
            records = np.memmap(path, dtype=header.dtype, mode="r", offset=TRACE_HEADER_SIZE, shape=(n_records,))
        else:  # mmap cannot map zero bytes
            records = np.empty(0, dtype=header.dtype)
        return cls(path, header, records, dropped)

    @property
    def n_records(self) -> int:
        return len(self.records)

    def iter_chunks(self, records_per_chunk: int = TRACE_CHUNK_RECORDS) -> Iterator[np.ndarray]:
        """Yield the records in order as consecutive arrays of at most ``records_per_chunk``.

        Each chunk is read into a fresh array with plain reads, not sliced from the memmap:
        pages of a mapping stay resident in the process once touched, so a pass over the
        memmap grows the RSS to the size of the trace; a read keeps it to one chunk.

        Each chunk's ``distance`` is the record's lookahead distance (``record_distances``: 1
        on a version 1/2 PREDICTED record); a version-3 record out of its bounds raises
        TraceError when its chunk is read.
        """
        if records_per_chunk < 1:
            raise ValueError(f"records_per_chunk must be >= 1, not {records_per_chunk}")
        with self.path.open("rb") as f:
            f.seek(self.header.header_size)
            for start in range(0, self.n_records, records_per_chunk):
                chunk = np.empty(min(records_per_chunk, self.n_records - start), dtype=self.header.dtype)
                if f.readinto(chunk.view(np.uint8)) != chunk.nbytes:
                    raise TraceError(f"{self.path}: the trace got shorter while it was read")
                chunk["distance"] = record_distances(self.header, chunk, start, self.path)
                yield chunk

    def actual(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``start:stop``: actual ids ``(n, n_expert_used)`` i32 and their weights f32."""
        rows = self.records[start:stop]
        return rows["actual_ids"], rows["actual_w"]

    def predicted(self, start: int = 0, stop: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows ``start:stop``: predicted ids ``(n, depth)`` i32 (-1 unpredicted) and logits f32."""
        rows = self.records[start:stop]
        return rows["pred_ids"], rows["pred_logits"]

    def distance(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows ``start:stop``: the lookahead distance of each (u16, 0 unpredicted; ``record_distances``)."""
        first = range(self.n_records)[start:stop].start if self.n_records else 0
        return record_distances(self.header, self.records[start:stop], first, self.path)


def open_trace(path: str | Path) -> Trace:
    """Open a trace (``Trace.open``)."""
    return Trace.open(path)
