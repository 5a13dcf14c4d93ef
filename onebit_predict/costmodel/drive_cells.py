"""The drive matrix of issue 23, cell by cell: what ``onebit-stats plot-drives`` prints and draws.

``onebit-bench MODEL --memory-limit 50%,25% --drive native,nvme,sata [--read-ahead-kb ...] --json``
runs every configuration on every drive at every limit. This module cuts its rows (one or several
reports, read by costmodel/measured.py :func:`~onebit_predict.costmodel.measured.load_measured`)
into **cells**: one drive (its label: the drive and, where it ran at several, its readahead:
``native @128``, ``native @8192``, ``nvme``, ``sata``) x one expert size (one model) x one limit
(``resident``, ``50 %``, ``25 %`` of the model's expert bytes). Within a cell each configuration
(its name without the drive and the readahead, which the cell says) gets:

- its decode tok/s, median (min-max), and its ratio to "patched off" of the same cell (the
  min and max over off's median too: the plot's error bars);
- its MiB read per token, and that over the cell's **floor**: the route-alone row's (route at
  route time, no predictor) ``route_missing_per_token``, the bytes per token the routed experts
  lacked in the page cache when routed: what any reader must bring in per token at this limit (none
  where the room rule held route's reads off in that row: it measured nothing, :func:`route_floor`);
- **gain from** (:func:`gain_from`): for a row at least 5 % faster than off (GAIN_MIN), "fewer
  bytes" when it read at most 0.9x off's MiB per token (FEWER_BYTES), else "reads in flight (same
  bytes)"; "-" otherwise, and where off read nothing (a resident cell: no bytes to save).

The cell's **physical limit** (:func:`physical_limit`) is ``1 / max(compute_s, floor / bandwidth)``
tok/s: compute_s is 1 / the resident "patched off" tok/s of the same model on the same drive (at
the same readahead, else at any, else on another drive: a resident run reads nothing) in any of the
reports, None where none has it (then the limit is None); bandwidth is the emulated drive's profile's (bytes/s) or the
native drive's measured one (:func:`native_bandwidth`: since 2026-12-05 the report's ``drive.random_mb_s``, 1 MiB
random reads at the workers' depth, the reads a token's misses are; before, ``drive.bandwidth_mb_s``, sequential, or
its samples' median).

Where a row's tokens' time went (:attr:`CellRow.decode`, the report row's ``decode``: compute and
waiting per token, reports since issue 30; None before) is drawn against two limits per cell: the
physical one above and the **retention-aware** one (:func:`with_belady`), the same formula with
the floor replaced by the bytes per token the replay's Belady policy (the offline optimum of an
expert cache) would miss at the cell's capacity: ``onebit-stats replay T.bin --slots N --policy
belady --json`` (:func:`load_replay`), N the cell's limit as a share of the experts (50 % of 128
experts: 64 slots per layer), its expert reads per token summed over the layers times one expert's
bytes (the cell's; else the report's expert bytes over the replay's layers and experts). The
cgroup's limit holds more than experts, so the capacity is an upper bound, and the replay starts
empty at the first decoded token (the prompt's reads are not counted, as in the measured rows):
replay a trace of the reports' own tokens (grown models route as the model they grew from). Each
row's decode tok/s over each limit (:meth:`Cell.of_physical`, :meth:`Cell.of_retention`) says how
far from it the row is: 0.41 is 41 % of the way.

The expert size is one expert's mean bytes over the layers, from the report's model file
(costmodel/expert_bytes.py, the GGUF's expert tensors) where it is readable here; else the file
name's width tag of the grown models (``w21504``: 2.7 MiB, ``w63488``: 8 MiB, WIDTH_LABELS) labels
it, and the size is unknown. A cell found in two reports is taken from the first given (a warning).
A report whose rows record no drive (written before ``--drive``) is refused (ValueError, exit 2).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .measured import DecodeSplit, Measured, MeasuredRow
from .row_config import NATIVE, OFF, RowConfig

logger = logging.getLogger("onebit_predict")
MIB = 2**20
GAIN_MIN = 1.05  # a row gains when it decodes at least this much faster than off
FEWER_BYTES = 0.9  # ... from fewer bytes when it reads at most this much of off's MiB per token
RESIDENT_LABEL = "resident"
WIDTH_LABELS = {21504: "2.7 MiB", 63488: "8 MiB"}  # the grown models' widths (docs/grown-models.md)
GAIN_BYTES = "fewer bytes"
GAIN_FLIGHT = "reads in flight (same bytes)"
NO_GAIN = "-"


@dataclass(frozen=True)
class ExpertSize:
    """One model's expert size: one expert's mean bytes (None: the model is not readable here)."""

    model: str
    per_expert_bytes: float | None
    total_bytes: int | None  # all the routed experts' bytes (the report's expert_bytes)

    @property
    def label(self) -> str:
        if self.per_expert_bytes and self.per_expert_bytes < MIB:
            return f"{self.per_expert_bytes / 1024:.0f} KiB"
        if self.per_expert_bytes:
            return f"{self.per_expert_bytes / MIB:.1f} MiB".replace(".0 MiB", " MiB")
        m = re.search(r"(?:^|[^a-z0-9])w(\d+)", Path(self.model).name)
        if m:
            return WIDTH_LABELS.get(int(m.group(1)), f"w{m.group(1)}")
        return Path(self.model).name


@dataclass(frozen=True)
class CellRow:
    """One configuration in one cell."""

    configuration: str  # its name without the drive and the readahead ("block + read + route, guard 4")
    tok_s: float
    min_tok_s: float | None
    max_tok_s: float | None
    ratio_to_off: float | None  # median over off's median in the same cell
    read_mib_per_token: float | None
    read_over_floor: float | None  # MiB read per token over the cell's floor (None: no floor, or a floor of 0)
    gain_from: str  # GAIN_BYTES, GAIN_FLIGHT or NO_GAIN
    route_missing_mib_per_token: float | None  # its own route-time misses (None: no route)
    off_tok_s: float | None  # the cell's off median, for the ratio's spread
    decode: DecodeSplit | None = None  # where its tokens' time went (None: a report before it)

    @property
    def ratio_min(self) -> float | None:
        return None if self.min_tok_s is None or not self.off_tok_s else self.min_tok_s / self.off_tok_s

    @property
    def ratio_max(self) -> float | None:
        return None if self.max_tok_s is None or not self.off_tok_s else self.max_tok_s / self.off_tok_s


@dataclass(frozen=True)
class Cell:
    """One drive x one expert size x one limit, and its configurations' rows."""

    drive_label: str  # "native @128", "nvme", ...
    drive: str  # native, nvme, nvme-1m, nvme-3g, sata
    read_ahead_kb: int | None
    emulated: bool
    size: ExpertSize
    limit_bytes: int  # 0: resident
    bandwidth: float | None  # bytes/s: the emulated profile's, or the native drive's measured
    floor_bytes: float | None  # the route-alone row's route_missing_per_token (None: no such row)
    compute_s: float | None  # 1 / the resident patched off tok/s of the model on this drive (None: not run)
    compute_read_ahead_kb: int | None  # the readahead that resident run had (another's where this one has none)
    compute_drive: str | None  # the drive it ran on (another where this one has none: a resident run reads nothing)
    off_tok_s: float | None  # this cell's patched off median
    rows: tuple[CellRow, ...]
    report: Path
    belady_floor_bytes: float | None = None  # what Belady would miss per token at this capacity (with_belady)

    @property
    def resident(self) -> bool:
        return self.limit_bytes == 0

    @property
    def limit_fraction(self) -> float | None:
        """The limit over the model's expert bytes (None: resident, or the bytes unknown)."""
        if self.resident or not self.size.total_bytes:
            return None
        return self.limit_bytes / self.size.total_bytes

    @property
    def limit_label(self) -> str:
        if self.resident:
            return RESIDENT_LABEL
        frac = self.limit_fraction
        return f"{self.limit_bytes / MIB:.0f} MiB" if frac is None else f"{100 * frac:.0f} %"

    @property
    def label(self) -> str:
        return f"{self.size.label}, {self.limit_label}"

    @property
    def floor_mib(self) -> float | None:
        return None if self.floor_bytes is None else self.floor_bytes / MIB

    @property
    def drive_s(self) -> float | None:
        """Seconds per token the drive needs for the floor's bytes at its bandwidth."""
        if self.floor_bytes is None or not self.bandwidth:
            return None
        return self.floor_bytes / self.bandwidth

    @property
    def physical_limit_tok_s(self) -> float | None:
        return physical_limit(self.compute_s, self.floor_bytes, self.bandwidth)

    @property
    def retention_limit_tok_s(self) -> float | None:
        """The physical limit with the Belady floor: what an expert cache that kept the best experts could reach."""
        return physical_limit(self.compute_s, self.belady_floor_bytes, self.bandwidth)

    @property
    def has_split(self) -> bool:
        """Some row records compute and waiting per token (a report since issue 30)."""
        return any(r.decode is not None and r.decode.wait_ms is not None for r in self.rows)

    def row(self, configuration: str) -> CellRow | None:
        return next((r for r in self.rows if r.configuration == configuration), None)

    def of_physical(self, row: CellRow) -> float | None:
        """The row's decode tok/s over the cell's physical limit (None: no limit)."""
        return of_limit(row.tok_s, self.physical_limit_tok_s)

    def of_retention(self, row: CellRow) -> float | None:
        """The row's decode tok/s over the cell's retention-aware limit (None: no limit)."""
        return of_limit(row.tok_s, self.retention_limit_tok_s)


def of_limit(tok_s: float, limit_tok_s: float | None) -> float | None:
    """A speed as a fraction of a limit (None: the limit is unknown)."""
    return None if not limit_tok_s else tok_s / limit_tok_s


def physical_limit(compute_s: float | None, floor_bytes: float | None, bandwidth: float | None) -> float | None:
    """``1 / max(compute_s, floor_bytes / bandwidth)`` tok/s; None when an input is unknown (or 0 s)."""
    if compute_s is None or floor_bytes is None or not bandwidth:
        return None
    slowest = max(compute_s, floor_bytes / bandwidth)
    return 1.0 / slowest if slowest > 0 else None


def gain_from(ratio: float | None, read_mib: float | None, off_read_mib: float | None) -> str:
    """Where a row's gain over off comes from (the module docstring's rule)."""
    if ratio is None or ratio < GAIN_MIN or read_mib is None or not off_read_mib:
        return NO_GAIN
    return GAIN_BYTES if read_mib <= FEWER_BYTES * off_read_mib else GAIN_FLIGHT


def expert_size(report: Measured) -> ExpertSize:
    """The report's model's expert size, read from its GGUF where the file is here (else labelled by its name)."""
    from .expert_bytes import mean_expert_bytes

    per = mean_expert_bytes(report.model)
    return ExpertSize(report.model, per, report.expert_bytes)


def configuration(row: MeasuredRow) -> str:
    """A row's configuration without the drive and the readahead (the cell says those)."""
    bare = _bare(row)
    return row.name if bare is None else bare.name


def _bare(row: MeasuredRow) -> RowConfig | None:
    """The row's configuration without its drive and readahead (None: a name that is no configuration)."""
    return None if row.config is None else dataclasses.replace(row.config, drive=None, read_ahead_kb=None)


def _is_off(row: MeasuredRow) -> bool:
    return _bare(row) == RowConfig() or (row.config is None and row.name == OFF)


def route_alone(rows: Sequence[MeasuredRow]) -> MeasuredRow | None:
    """The cell's route-alone row (route, no predictor): the one without further knobs first."""
    found = [r for r in rows if r.config is not None and r.config.route and r.config.predictor is None]
    plain = [r for r in found if _bare(r) == RowConfig(consumer=r.config.consumer, route=True)]
    return (plain or found or [None])[0]


def _labels(keys: set[tuple[str, int | None]]) -> dict[tuple[str, int | None], str]:
    """Each (drive, readahead) its label: native always with its readahead, an emulated drive only
    where the reports ran it at several."""
    several = {d for d, _ in keys if sum(1 for d2, _ in keys if d2 == d) > 1}
    out = {}
    for d, ra in keys:
        shown = (d == NATIVE or d in several) and ra is not None
        out[(d, ra)] = f"{d} @{ra}" if shown else d
    return out


Compute = tuple[float | None, int | None, str | None]  # 1 / resident off tok/s, its readahead, its drive


def _compute_s(reports: Sequence[Measured]) -> dict[tuple[str, str | None, int | None], Compute]:
    """(1 / the resident patched off tok/s, its readahead, its drive) per (model, drive, readahead), first
    report first; the key with readahead None holds the drive's at any readahead, the key with drive None
    too the model's on any drive (native first: a resident run reads nothing, whatever the drive)."""
    out: dict[tuple[str, str | None, int | None], Compute] = {}
    for rep in reports:
        for r in sorted(rep.rows, key=lambda r: r.drive != NATIVE):
            if r.resident and r.drive is not None and _is_off(r) and r.tok_s > 0:
                got = (1.0 / r.tok_s, r.read_ahead_kb, r.drive)
                for key in ((rep.model, r.drive, r.read_ahead_kb), (rep.model, r.drive, None), (rep.model, None, None)):
                    out.setdefault(key, got)
    return out


def drive_cells(reports: Sequence[Measured]) -> list[Cell]:
    """The cells of memory reports: drive (native first, then the emulated ones as found), expert
    size ascending, then resident and the limits descending. ValueError on a row without a drive."""
    for rep in reports:
        unknown = [r.name for r in rep.rows if r.drive is None]
        if unknown:
            raise ValueError(
                f"{rep.path}: rows record no drive ({unknown[0]!r}...): a report written before "
                "onebit-bench --drive, or without its drives object"
            )
    labels = _labels({(r.drive, r.read_ahead_kb) for rep in reports for r in rep.rows if r.drive is not None})
    compute = _compute_s(reports)
    cells: dict[tuple[str, str, int], Cell] = {}
    for rep in reports:
        size = expert_size(rep)
        groups: dict[tuple[str, int | None, int], list[MeasuredRow]] = {}
        for r in rep.rows:
            assert r.drive is not None
            groups.setdefault((r.drive, r.read_ahead_kb, r.limit_bytes or 0), []).append(r)
        for (drive, ra, limit), rows in groups.items():
            key = (labels[(drive, ra)], rep.model, limit)
            if key in cells:
                logger.warning("%s: cell %s, %s also in %s: kept that one", rep.path, key[0], limit, cells[key].report)
                continue
            emulated = drive != NATIVE
            profile = rep.drive(drive) if emulated else None
            bandwidth = profile.bandwidth if profile is not None else (None if emulated else native_bandwidth(rep))
            keys = ((rep.model, drive, ra), (rep.model, drive, None), (rep.model, None, None))
            cs = next((compute[k] for k in keys if k in compute), (None, None, None))
            cells[key] = _cell(labels[(drive, ra)], drive, ra, emulated, size, limit, bandwidth, cs, rows, rep.path)
    order = {"native": 0}
    drives = list(dict.fromkeys(c.drive for c in cells.values()))
    return sorted(
        cells.values(),
        key=lambda c: (
            order.get(c.drive, 1 + drives.index(c.drive)),
            c.read_ahead_kb or 0,
            c.size.per_expert_bytes or c.size.total_bytes or 0,
            c.size.model,
            c.limit_bytes != 0,
            -c.limit_bytes,
        ),
    )


def _cell(
    label: str,
    drive: str,
    ra: int | None,
    emulated: bool,
    size: ExpertSize,
    limit: int,
    bandwidth: float | None,
    compute: Compute,
    rows: list[MeasuredRow],
    report: Path,
) -> Cell:
    off = next((r for r in rows if _is_off(r)), None)
    floor = route_floor(route_alone(rows), limit)
    out: list[CellRow] = []
    seen: set[str] = set()
    for r in rows:
        name = configuration(r)
        if name in seen:
            logger.warning("%s: %s twice in cell %s, %s: the first kept", report, name, label, limit)
            continue
        seen.add(name)
        ratio = r.tok_s / off.tok_s if off is not None and off.tok_s > 0 else r.ratio_to_off
        over = None if not floor or r.read_mib_per_token is None else r.read_mib_per_token / (floor / MIB)
        off_read = None if off is None else off.read_mib_per_token
        gain = NO_GAIN if r is off else gain_from(ratio, r.read_mib_per_token, off_read)
        missing = None if r.route_missing_per_token is None else r.route_missing_per_token / MIB
        off_tok = None if off is None else off.tok_s
        out.append(
            CellRow(
                name,
                r.tok_s,
                r.min_tok_s,
                r.max_tok_s,
                ratio,
                r.read_mib_per_token,
                over,
                gain,
                missing,
                off_tok,
                r.decode,
            )
        )
    off_tok_s = None if off is None else off.tok_s
    compute_s, compute_ra, compute_drive = compute
    return Cell(
        label,
        drive,
        ra,
        emulated,
        size,
        limit,
        bandwidth,
        floor,
        compute_s,
        compute_ra,
        compute_drive,
        off_tok_s,
        tuple(out),
        report,
    )


def native_bandwidth(rep: Measured) -> float | None:
    """The native drive's bytes/s for the physical limit: its 1 MiB random reads at the workers' depth where
    the report measured them (since 2026-12-05: a token's misses are random slices, read several at once,
    and that is the rate a drive serves them at), else its sequential reads (the reports before)."""
    return rep.random_bandwidth or rep.bandwidth


def route_floor(route: MeasuredRow | None, limit: int) -> float | None:
    """The route-alone row's routed bytes missing per token; None without that row, and in a limited cell
    where route time measured nothing (its rows' decode says so: no expert hit rate, the room rule held
    its reads off), not 0 (0 is a resident cell's floor: nothing to miss)."""
    if route is None:
        return None
    held_off = limit != 0 and route.decode is not None and route.decode.expert_hit is None
    return None if held_off else route.route_missing_per_token


def by_drive(cells: Sequence[Cell]) -> dict[str, list[Cell]]:
    """The cells per drive label, in the cells' order."""
    out: dict[str, list[Cell]] = {}
    for c in cells:
        out.setdefault(c.drive_label, []).append(c)
    return out


def configurations(cells: Sequence[Cell]) -> list[str]:
    """The configurations of some cells, in the order first found, patched off first."""
    names = list(dict.fromkeys(r.configuration for c in cells for r in c.rows))
    return sorted(names, key=lambda n: n != OFF)


def flat_rows(cells: Sequence[Cell]) -> list[dict[str, object]]:
    """One dict per cell and configuration, with the cell's fields: ``--json`` and ``--csv``."""
    out = []
    for c in cells:
        for r in c.rows:
            out.append(
                {
                    "drive": c.drive_label,
                    "drive_name": c.drive,
                    "read_ahead_kb": c.read_ahead_kb,
                    "emulated": c.emulated,
                    "model": c.size.model,
                    "expert_size": c.size.label,
                    "expert_bytes_each": c.size.per_expert_bytes,
                    "expert_bytes_total": c.size.total_bytes,
                    "limit": c.limit_label,
                    "limit_bytes": c.limit_bytes,
                    "limit_fraction": c.limit_fraction,
                    "configuration": r.configuration,
                    "median_tok_s": r.tok_s,
                    "min_tok_s": r.min_tok_s,
                    "max_tok_s": r.max_tok_s,
                    "ratio_to_off": r.ratio_to_off,
                    "ratio_min": r.ratio_min,
                    "ratio_max": r.ratio_max,
                    "read_mib_per_token": r.read_mib_per_token,
                    "floor_mib_per_token": c.floor_mib,
                    "read_over_floor": r.read_over_floor,
                    "gain_from": r.gain_from,
                    "route_missing_mib_per_token": r.route_missing_mib_per_token,
                    "compute_s": c.compute_s,
                    "compute_read_ahead_kb": c.compute_read_ahead_kb,
                    "compute_drive": c.compute_drive,
                    "bandwidth_bytes_s": c.bandwidth,
                    "physical_limit_tok_s": c.physical_limit_tok_s,
                    "belady_floor_mib_per_token": None if c.belady_floor_bytes is None else c.belady_floor_bytes / MIB,
                    "retention_limit_tok_s": c.retention_limit_tok_s,
                    "of_physical_limit": c.of_physical(r),
                    "of_retention_limit": c.of_retention(r),
                    **{f"decode_{f.name}": None if r.decode is None else getattr(r.decode, f.name) for f in _DECODE},
                    "report": str(c.report),
                }
            )
    return out


_DECODE = dataclasses.fields(DecodeSplit)


# --- the retention-aware limit: a Belady replay at each cell's capacity ------------------------


@dataclass(frozen=True)
class BeladyReplay:
    """The Belady results of an ``onebit-stats replay --policy belady --json`` (no prefetch, not cold)."""

    path: Path
    n_expert: int
    n_layers: int  # the layers it replayed
    reads_per_token: dict[int, float]  # slots per layer -> expert reads per decoded token, summed over the layers


def load_replay(path: Path) -> BeladyReplay:
    """A replay's JSON; ValueError (exit 2) when it is not one, or holds no Belady result."""
    try:
        data = json.loads(Path(path).read_text())
    except ValueError as e:
        raise ValueError(f"--replay {path}: not JSON ({e})") from None
    try:
        n_expert = int(data["header"]["n_expert"])
        found = [
            r
            for r in data["results"]
            if r["policy"] == "belady" and r.get("prefetch", "none") == "none" and not r.get("cold")
        ]
        reads = {int(r["slots"]): sum(float(x["reads_per_token"] or 0.0) for x in r["layers"]) for r in found}
        layers = max((len(r["layers"]) for r in found), default=0)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"--replay {path}: not an onebit-stats replay --json ({e!r})") from None
    if not reads:
        raise ValueError(f"--replay {path}: no belady result without prefetch (onebit-stats replay --policy belady)")
    return BeladyReplay(Path(path), n_expert, layers, reads)


def belady_floor(cell: Cell, replays: Sequence[BeladyReplay]) -> float | None:
    """The bytes per token the first replay with a Belady result at the cell's capacity (its limit's share of
    the experts, in slots per layer) would miss; 0 for a resident cell; None for an unknown share, no such result."""
    if cell.resident:
        return 0.0  # the model read in before the run: nothing left to miss
    frac = cell.limit_fraction
    if frac is None:
        return None
    for rep in replays:
        reads = rep.reads_per_token.get(round(frac * rep.n_expert))
        if reads is None:
            continue
        each = cell.size.per_expert_bytes
        if each is None and cell.size.total_bytes and rep.n_layers:
            each = cell.size.total_bytes / (rep.n_layers * rep.n_expert)
        return None if each is None else reads * each
    return None


def with_belady(cells: Sequence[Cell], replays: Sequence[BeladyReplay]) -> list[Cell]:
    """The cells with their Belady floor (:func:`belady_floor`); a warning for each limited cell without one."""
    out = []
    for c in cells:
        floor = belady_floor(c, replays) if replays else None
        frac = c.limit_fraction
        if replays and floor is None and frac is not None:
            slots = ", ".join(sorted({str(round(frac * r.n_expert)) for r in replays}))
            logger.warning(
                "cell %s, %s: no Belady result at %s slots per layer in --replay", c.drive_label, c.label, slots
            )
        out.append(dataclasses.replace(c, belady_floor_bytes=floor))
    return out
