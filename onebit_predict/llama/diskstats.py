"""The read requests a drive served while a benchmark's worker decoded (checks/worker.py).

For the model's own block device the kernel counts them in ``/proc/diskstats`` (the kernel's
Documentation/admin-guide/iostats.rst; fields numbered after the device's name): reads completed
(1), sectors read (3, of 512 bytes), milliseconds spent reading (4: the sum of every read's time,
queue and service), milliseconds the device had I/O in progress (10, ``io_ticks``) and the
weighted milliseconds (11: every request's time in queue and service, summed). Over an interval
of wall time ``wall_ms``: the mean request is ``sectors * 512 / reads``, the mean requests in flight
``weighted_ms / wall_ms`` (writes and flushes count in field 11 too: a decode writes little, its
trace through the page cache), the drive's busy share ``io_ticks / wall_ms``. The counters are the
device's, every process's reads together: the benchmark runs alone on the machine.

The largest request is not in ``/proc/diskstats``: :class:`ReadRequests` holds the device's cap,
``queue/max_sectors_kb``, as the largest *possible* (LARGEST_CAP). The model's device is
llama/read_ahead.py :func:`~onebit_predict.llama.read_ahead.block_device`'s (the whole disk); a
file on a partition takes the partition's line where /proc/diskstats has one, else the disk's.
An emulated drive (drive/emudrive.py) has no line there (FUSE reads never reach the block layer):
the worker builds its :class:`ReadRequests` from the emulator's counters: requests, bytes, the
largest request it served since mounted (LARGEST_SEEN), and since 2026-12-06 the times of its device
schedule (each request's arrival to its transfer's end, summed, as the read and weighted time; the time
at least one request was in the device as io_ticks): not the host's delays in replying.

Everything takes the diskstats file and the sysfs root as parameters, so that the tests feed
made-up text and never read a real device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..constants import DISKSTATS_SECTOR, LARGEST_CAP, PROC_DISKSTATS
from .read_ahead import ReadAheadError, block_device

FIELDS = 11  # the fields a line has after its name, at least (kernels since 2.6.25 write them for partitions too)


@dataclass(frozen=True)
class DiskStats:
    """One device's line of /proc/diskstats, the fields the decode's figures use."""

    name: str
    reads: int  # field 1: reads completed
    sectors: int  # field 3: 512-byte sectors read
    read_ms: int  # field 4: the reads' time, summed
    io_ticks_ms: int  # field 10: time with I/O in progress
    weighted_ms: int  # field 11: every request's time in queue and service, summed

    def minus(self, before: DiskStats) -> DiskStats:
        """The counts between two readings of the same device."""
        return DiskStats(
            self.name,
            self.reads - before.reads,
            self.sectors - before.sectors,
            self.read_ms - before.read_ms,
            self.io_ticks_ms - before.io_ticks_ms,
            self.weighted_ms - before.weighted_ms,
        )


def parse_diskstats(text: str) -> dict[str, DiskStats]:
    """Every device line of /proc/diskstats text, by name (lines too short to hold field 11 are skipped)."""
    out = {}
    for line in text.splitlines():
        words = line.split()
        if len(words) < 3 + FIELDS:
            continue
        try:
            f = [int(w) for w in words[3 : 3 + FIELDS]]
        except ValueError:
            continue
        out[words[2]] = DiskStats(words[2], f[0], f[2], f[3], f[9], f[10])
    return out


def read_diskstats(names: tuple[str, ...], path: str | Path = PROC_DISKSTATS) -> DiskStats | None:
    """The line of the first of ``names`` the file has (a partition, then its disk); None where none is
    there, or the file cannot be read."""
    try:
        stats = parse_diskstats(Path(path).read_text())
    except OSError:
        return None
    return next((stats[n] for n in names if n in stats), None)


@dataclass(frozen=True)
class ModelDisk:
    """Where the model's reads are counted: its /proc/diskstats names (partition first) and its queue's cap."""

    names: tuple[str, ...]
    max_sectors_kb: int | None  # queue/max_sectors_kb: the largest request the kernel sends it


def model_disk(path: str | Path, sys_root: Path | None = None) -> ModelDisk | None:
    """The block device holding ``path`` as /proc/diskstats names it; None without one (FUSE, tmpfs)."""
    try:
        dev = block_device(path, sys_root)
    except ReadAheadError:
        return None
    if dev.name.startswith("bdi "):  # a filesystem with no block device (the emulated drive's mount)
        return None
    cap_file = Path(dev.read_ahead_file).with_name("max_sectors_kb")
    try:
        cap: int | None = int(cap_file.read_text().strip())
    except (OSError, ValueError):
        cap = None
    return ModelDisk(tuple(n for n in (dev.partition, dev.name) if n), cap)


@dataclass(frozen=True)
class ReadRequests:
    """The read requests a drive served over an interval (a decode): from /proc/diskstats or an emulated
    drive's counters (its schedule's times). The times are None where the source has none."""

    source: str  # "diskstats vda", "emulated"
    requests: int
    bytes: int
    wall_s: float  # the interval
    largest_bytes: int | None = None
    largest_is: str | None = None  # LARGEST_CAP (the device's cap: the largest possible) or LARGEST_SEEN
    read_ms: float | None = None  # the reads' time, summed (diskstats field 4)
    weighted_ms: float | None = None  # every request's time in queue and service, summed (field 11)
    io_ticks_ms: float | None = None  # time the device had I/O in progress (field 10)

    @classmethod
    def of_disk(cls, delta: DiskStats, wall_s: float, max_sectors_kb: int | None) -> ReadRequests:
        largest = None if max_sectors_kb is None else max_sectors_kb * 1024
        return cls(
            f"diskstats {delta.name}",
            delta.reads,
            delta.sectors * DISKSTATS_SECTOR,
            wall_s,
            largest,
            None if largest is None else LARGEST_CAP,
            float(delta.read_ms),
            float(delta.weighted_ms),
            float(delta.io_ticks_ms),
        )

    @property
    def mean_bytes(self) -> float | None:
        return self.bytes / self.requests if self.requests else None

    @property
    def mean_ms(self) -> float | None:
        """A read's mean time, queue and service (None: no read, or no times)."""
        return None if self.read_ms is None or not self.requests else self.read_ms / self.requests

    @property
    def in_flight(self) -> float | None:
        """The mean requests in flight over the interval: weighted ms over wall ms."""
        return None if self.weighted_ms is None or not self.wall_s > 0 else self.weighted_ms / (1e3 * self.wall_s)

    @property
    def busy(self) -> float | None:
        """The share of the interval the device had a request in progress: io_ticks over wall."""
        return None if self.io_ticks_ms is None or not self.wall_s > 0 else self.io_ticks_ms / (1e3 * self.wall_s)
