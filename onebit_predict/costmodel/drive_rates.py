"""The drive as fio times it: read throughput by request size and depth (``onebit-stats simulate
--drive-rates FIO.json``).

One bandwidth and one latency cannot serve a drive whose rate depends on the request's size as a
virtio disk's does (docs/cost-model.md, "Out of sample": 0.41 GB/s at 128 KiB and 1.8 at 1 MiB, both
at depth 1). :func:`load_fio` reads fio's JSON output (``--output-format=json``) of random reads,
one job per request size and depth, into :class:`DriveRates`; the page model's drive (kernel.py
``PageDrive``) then serves a request of ``n`` bytes entering with ``k`` requests in flight (itself
included) in ``n / rate(n, k)``, one request's data after another's, and no latency of its own: at
depth 1 that is fio's time per request, and with ``k`` always in flight fio's throughput at ``k``.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIO_RW = ("randread",)  # what a job must be: the expert reads are random
_FIO_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}  # fio's kb_base 1024, its default


@dataclass(frozen=True)
class DriveRates:
    """Read throughput in bytes/s at each request size (ascending) and depth (ascending)."""

    sizes: tuple[int, ...]  # request bytes
    depths: tuple[int, ...]  # requests in flight
    rates: tuple[tuple[float, ...], ...]  # rates[i][j]: bytes/s at sizes[i], depths[j]
    source: str

    def rate(self, size: float, depth: int) -> float:
        """Bytes/s of a request of ``size`` bytes with ``depth`` requests in flight: linear in log size and
        log depth between the table's points, the nearest edge's beyond them."""
        i, fi = _between(self.sizes, size)
        j, fj = _between(self.depths, depth)
        r = self.rates
        lo = r[i][j] + fj * (r[i][j + 1] - r[i][j]) if fj else r[i][j]
        if not fi:
            return lo
        hi = r[i + 1][j] + fj * (r[i + 1][j + 1] - r[i + 1][j]) if fj else r[i + 1][j]
        return lo + fi * (hi - lo)

    def text(self, bandwidth: Any) -> str:
        """``fio grid.json: 128 KiB to 4096 KiB at depth 1 to 16, 0.41 GB/s to 1.80 GB/s``."""
        flat = [x for row in self.rates for x in row]
        return (
            f"{self.source}: {self.sizes[0] // 1024} KiB to {self.sizes[-1] // 1024} KiB at depth "
            f"{self.depths[0]} to {self.depths[-1]}, {bandwidth(min(flat))} to {bandwidth(max(flat))}"
        )

    def as_json(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "depths": list(self.depths), "rates": [list(r) for r in self.rates]}


def _between(points: tuple[int, ...], x: float) -> tuple[int, float]:
    """``(i, f)``: x lies at fraction f (in log scale) from points[i] to points[i + 1]; f 0 at or beyond an edge."""
    if x <= points[0] or len(points) == 1:
        return 0, 0.0
    if x >= points[-1]:
        return len(points) - 1, 0.0
    i = bisect.bisect_right(points, x) - 1  # points[i] <= x < points[-1]
    return i, math.log(x / points[i]) / math.log(points[i + 1] / points[i])


def fio_size(text: str) -> int:
    """fio's size option (``128k``, ``1m``, ``4M``, ``131072``; a read,write pair's read part) in bytes."""
    value = str(text).split(",")[0].strip().lower().removesuffix("ib").removesuffix("b")
    unit = value[-1:] if value[-1:] in _FIO_UNITS and not value[-1:].isdigit() else ""
    number = value[: len(value) - len(unit)]
    if not number.isdigit() or int(number) <= 0:
        raise ValueError(f"'{text}' is not a request size fio writes (128k, 1m, 131072)")
    return int(number) * _FIO_UNITS[unit]


def load_fio(paths: Sequence[Path]) -> DriveRates:
    """The rates of fio's JSON outputs at ``paths``: every job a random read with its ``bs`` and ``iodepth``
    (its own options or the global ones), each cell once a file, together a full grid of sizes by depths;
    a cell several files time is their mean (fio's rates on a shared disk move between runs). ValueError
    saying what is wrong."""
    runs: dict[tuple[int, int], list[float]] = {}
    for path in paths:
        for key, bw in _fio_cells(Path(path)).items():
            runs.setdefault(key, []).append(bw)
    sizes, depths = sorted({s for s, _ in runs}), sorted({d for _, d in runs})
    missing = [f"{s // 1024} KiB at depth {d}" for s in sizes for d in depths if (s, d) not in runs]
    if missing:
        raise ValueError(
            f"{', '.join(map(str, paths))}: not a full grid of sizes by depths; missing {', '.join(missing)}"
        )
    rates = tuple(tuple(sum(runs[(s, d)]) / len(runs[(s, d)]) for d in depths) for s in sizes)
    return DriveRates(tuple(sizes), tuple(depths), rates, "fio " + ", ".join(map(str, paths)))


def _fio_cells(path: Path) -> dict[tuple[int, int], float]:
    """``{(request bytes, depth): bytes/s}`` of one fio JSON output."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not fio's JSON output (--output-format=json): {e}") from None
    jobs = data.get("jobs") if isinstance(data, dict) else None
    if not isinstance(jobs, list) or not jobs:
        raise ValueError(f"{path}: no 'jobs' list: not fio's JSON output (--output-format=json)")
    glob = data.get("global options") or {}
    cells: dict[tuple[int, int], float] = {}
    for n, job in enumerate(jobs):
        where = f"{path}: job {n} ({job.get('jobname', '?') if isinstance(job, dict) else '?'})"
        try:
            opts = {**glob, **job["job options"]}
            rw, bs, depth, bw = opts.get("rw"), opts.get("bs"), opts.get("iodepth", "1"), job["read"]["bw_bytes"]
        except (KeyError, TypeError):
            raise ValueError(f"{where}: no 'job options' or 'read.bw_bytes'") from None
        if rw not in FIO_RW:
            raise ValueError(f"{where}: rw={rw}; the expert reads are random: rw={'|'.join(FIO_RW)}")
        if bs is None:
            raise ValueError(f"{where}: no bs (its request size)")
        if not str(depth).isdigit() or int(depth) < 1:
            raise ValueError(f"{where}: iodepth={depth}; a depth is a whole number of at least 1")
        if not isinstance(bw, (int, float)) or not bw > 0:
            raise ValueError(f"{where}: read.bw_bytes={bw}: it read nothing")
        key = (fio_size(bs), int(depth))
        if key in cells:
            raise ValueError(f"{where}: bs {key[0]} at iodepth {key[1]} given twice")
        cells[key] = float(bw)
    return cells
