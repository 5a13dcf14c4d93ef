"""Measure the drive a model lives on: sequential bandwidth, large random reads, one page's latency.

What `onebit-bench --cold` measures against, and what `onebit-stats simulate` needs as
`--bandwidth` and `--latency-us` to predict the same run. A scratch file is written next to
the model (so it is on the same filesystem), written back and dropped from the page cache
(posix_fadvise DONTNEED), then read: once sequentially in 1 MiB reads (bandwidth), once as
single 4 KiB preads at random page-aligned offsets, one at a time (latency at queue depth 1),
and once as 1 MiB preads at random 1 MiB-aligned offsets, RANDOM_DEPTH at a time, with the
kernel's readahead off on the file (POSIX_FADV_RANDOM): the reads the consumer's workers make
(slices of 0.3 to 3 MiB, PREFETCH_THREADS_DEFAULT workers). A drive can serve those far from its
sequential rate, either way (docs/results.md, 2026-12-05), so the physical limit takes this one
(costmodel/drive_cells.py). The file is removed afterwards. :func:`device_read_ahead_kb` reads
the readahead of the device holding a file on this machine (the page model's read-around window,
costmodel/kernel.py).
"""

from __future__ import annotations

import mmap
import os
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..constants import PREFETCH_THREADS_DEFAULT

SCRATCH_BYTES = 256 << 20
CHUNK = 1 << 20
N_RANDOM_READS = 256
RANDOM_DEPTH = PREFETCH_THREADS_DEFAULT  # the consumer's workers: the reads a layer's misses make at once


class DriveError(RuntimeError):
    """The scratch file could not be written or read."""


@dataclass(frozen=True)
class DriveFigures:
    directory: str
    bandwidth_mb_s: float  # sequential read, MB/s (10^6 bytes)
    page_read_us: float  # mean latency of one 4 KiB random read at queue depth 1
    random_mb_s: float | None = None  # 1 MiB random reads, RANDOM_DEPTH in flight, MB/s (None: not measured)

    def words(self) -> str:
        """The figures as the bench's table header and log say them."""
        random_part = (
            "" if self.random_mb_s is None else f"{self.random_mb_s:.0f} MB/s in random 1 MiB reads x{RANDOM_DEPTH}, "
        )
        return (
            f"{self.bandwidth_mb_s:.0f} MB/s sequential, {random_part}{self.page_read_us:.0f} us per random 4 KiB read"
        )


def _drop(fd: int, size: int) -> None:
    os.fsync(fd)
    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)


def measure_drive(directory: Path, size: int = SCRATCH_BYTES, seed: int = 0) -> DriveFigures:
    """Write, drop and read a scratch file of size bytes in directory."""
    page = mmap.PAGESIZE
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".onebit-drive-") as f:
            block = os.urandom(CHUNK)  # incompressible: a compressing filesystem would flatter zeros
            for _ in range(size // CHUNK):
                f.write(block)
            f.flush()
            fd = f.fileno()
            _drop(fd, size)
            t0 = time.perf_counter()
            offset = 0
            while offset < size:
                n = len(os.pread(fd, CHUNK, offset))
                if n == 0:
                    break
                offset += n
            seq_s = time.perf_counter() - t0
            _drop(fd, size)
            rng = random.Random(seed)
            offsets = [rng.randrange(size // page) * page for _ in range(N_RANDOM_READS)]
            t0 = time.perf_counter()
            for off in offsets:
                os.pread(fd, page, off)
            rand_s = time.perf_counter() - t0
            _drop(fd, size)
            large_s = _random_chunks(fd, size, rng)
    except OSError as exc:
        raise DriveError(f"cannot measure the drive under {directory}: {exc}") from None
    chunks = size // CHUNK * CHUNK  # none in a file under 1 MiB: not measured
    random_mb_s = chunks / large_s / 1e6 if chunks and large_s > 0 else None
    return DriveFigures(str(directory), size / seq_s / 1e6, rand_s / N_RANDOM_READS * 1e6, random_mb_s)


def _random_chunks(fd: int, size: int, rng: random.Random) -> float:
    """Seconds to read every CHUNK of the dropped file once, in random order, RANDOM_DEPTH preads at a
    time (threads: a pread releases the GIL), readahead off so that each asks for exactly its chunk."""
    from concurrent.futures import ThreadPoolExecutor

    offsets = [i * CHUNK for i in range(size // CHUNK)]
    rng.shuffle(offsets)
    os.posix_fadvise(fd, 0, size, os.POSIX_FADV_RANDOM)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(RANDOM_DEPTH) as pool:
        for n in pool.map(lambda off: len(os.pread(fd, CHUNK, off)), offsets):
            if n != CHUNK:
                raise OSError(f"a {CHUNK}-byte read returned {n} bytes")
    return time.perf_counter() - t0


def device_read_ahead_kb(path: str | Path) -> int | None:
    """read_ahead_kb of the block device holding ``path`` on this machine (None when unknown): what a
    major fault's read-around window is made of (the page model, costmodel/kernel.py). The device as
    llama/read_ahead.py ``block_device`` finds it (the whole disk for a partition)."""
    from .read_ahead import ReadAheadError, block_device

    try:
        return block_device(path).read_ahead_kb
    except ReadAheadError:
        return None


def cpu_model(default: str = "") -> str:
    """This machine's CPU model as /proc/cpuinfo names it (``default`` where it does not): the line
    every benchmark's machine description starts with."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return default
