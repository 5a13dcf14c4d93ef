"""fio against the emulated drive, for each profile: the table of docs/drive.md.

    python -m onebit_predict.drive.fiocheck [--size-mib 2048] [--profiles nvme,sata,host] [--markdown OUT.md]

``host`` is no device model at all: what this machine's FUSE path and page cache deliver, the
ceiling of every profile here. For each profile, two mounts (FUSE max_read / bdi read_ahead_kb:
128 KiB / 128, the kernel's defaults, and 1 MiB / 1024) and two request sizes (256 KiB, 1 MiB) at
1, 4 and 8 jobs:

- ``buffered``: psync reads through the page cache (what llama.cpp's mmap sees). Each job reads
  its own region of the file (fio's ``offset_increment``) in random order for ``runtime`` seconds
  (``time_based``; fio's default ``fadvise_hint`` makes the reads random, so no readahead beyond
  them); the file is evicted before each run (posix_fadvise DONTNEED here) and fio drops a region
  from the page cache each time it starts over (``--invalidate=1``): the emulator's counters show
  that every byte fio read was served by the device (column ``served / read``);
- ``direct``: O_DIRECT psync reads on the 1 MiB mount: the device model without the page cache,
  each read one request of ``bs`` bytes, ``jobs`` of them in flight.

The ``model`` column is ``DriveProfile.model_throughput(request, jobs)``: what the device model
alone allows. Needs root (read_ahead_kb), fio, and what the emulator needs. Exit 0 ok, 1 failure,
2 usage.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ..llama.evict import drop_file
from .emudrive import EmuDriveError, Mount, mounted
from .profiles import KIB, MIB, PROFILES, DriveProfile

# no device model at all: what the host's FUSE path and page cache deliver, the ceiling of any profile
logger = logging.getLogger("onebit_predict")
HOST = DriveProfile(name="host", latency_us=0.0, bandwidth=0.0, channels=4096, source="no device model")
CHOICES = {**PROFILES, HOST.name: HOST}


@dataclass(frozen=True)
class FioRow:
    """One fio run against a mount, with the emulator's counters over it."""

    profile: str
    mode: str  # buffered | direct
    max_read: int
    read_ahead_kb: int
    bs: int
    jobs: int
    mb_s: float  # fio's read bandwidth, 1e6 bytes/s
    model_mb_s: float  # the device model's, at the request size served and `jobs` in flight
    fio_bytes: int
    served_bytes: int
    requests: int
    max_inflight: int
    cpu_s: float  # the emulator's user + system seconds over the run
    command: str

    @property
    def mean_request(self) -> float:
        return self.served_bytes / self.requests if self.requests else 0.0

    @property
    def cpu_s_per_gb(self) -> float:
        return self.cpu_s / (self.served_bytes / 1e9) if self.served_bytes else 0.0


def fio_command(path: Path, bs: int, jobs: int, region: int, runtime_s: float, direct: bool) -> list[str]:
    return [
        "fio",
        "--name=r",
        f"--filename={path}",
        "--rw=randread",
        f"--bs={bs // KIB}k",
        "--ioengine=psync",
        f"--numjobs={jobs}",
        f"--size={region // MIB}m",
        f"--offset_increment={region // MIB}m",
        f"--runtime={runtime_s:g}",
        "--invalidate=1",
        f"--direct={int(direct)}",
        "--group_reporting",
        "--time_based",
        "--output-format=json",
    ]


def run_one(m: Mount, mode: str, bs: int, jobs: int, size: int, runtime_s: float) -> FioRow:
    region = (size // jobs) // MIB * MIB
    cmd = fio_command(m.path, bs, jobs, region, runtime_s, mode == "direct")
    drop_file(m.path)
    before = m.stats()
    r = subprocess.run(cmd, capture_output=True, text=True)
    after = m.stats()
    if r.returncode != 0:
        raise EmuDriveError(f"fio failed ({' '.join(cmd)}):\n{r.stderr.strip()}")
    job = json.loads(r.stdout[r.stdout.index("{") :])["jobs"][0]["read"]
    d = after.minus(before)
    # the model at the request size the kernel actually sent, `jobs` requests in flight
    request = round(d.bytes / d.requests) if d.requests else min(bs, m.max_read)
    return FioRow(
        profile=m.profile.name,
        mode=mode,
        max_read=m.max_read,
        read_ahead_kb=m.read_ahead_kb,
        bs=bs,
        jobs=jobs,
        mb_s=job["bw_bytes"] / 1e6,
        model_mb_s=m.profile.model_throughput(request, jobs) / 1e6,
        fio_bytes=int(job["io_bytes"]),
        served_bytes=d.bytes,
        requests=d.requests,
        max_inflight=d.window_max_inflight,
        cpu_s=d.serve_cpu_s,
        command=" ".join(cmd).replace(str(m.path), "<mount>/" + m.path.name),
    )


def machine() -> str:
    from ..llama.drive import cpu_model

    cpu = cpu_model()
    fio = subprocess.run(["fio", "--version"], capture_output=True, text=True).stdout.strip()
    fuse = subprocess.run(["pkg-config", "--modversion", "fuse3"], capture_output=True, text=True).stdout.strip()
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    return f"{cpu}, {os.cpu_count()} CPUs, Linux {platform.release()}, {fio}, libfuse {fuse}, load average {load}"


def markdown(rows: list[FioRow]) -> str:
    out = [
        "| profile | mode | max_read / read_ahead_kb | bs | jobs | MB/s | model MB/s | mean request | max in flight "
        "| served / read | emulator CPU s/GB |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r.profile} | {r.mode} | {r.max_read // KIB} KiB / {r.read_ahead_kb} | {r.bs // KIB}k | {r.jobs} "
            f"| {r.mb_s:,.0f} | {_mb(r.model_mb_s)} | {r.mean_request / KIB:.0f} KiB | {r.max_inflight} "
            f"| {r.served_bytes / r.fio_bytes if r.fio_bytes else 0:.2f} | {r.cpu_s_per_gb:.2f} |"
        )
    return "\n".join(out)


def _mb(x: float) -> str:
    return f"{x:,.0f}" if x != float("inf") else "-"


MOUNTS = ((128 * KIB, 128, "buffered"), (1 * MIB, 1024, "buffered"), (1 * MIB, 1024, "direct"))  # max_read, ra, mode


def run_check(
    profiles: list[DriveProfile], sizes: list[int], jobs: list[int], modes: list[str], size_mib: int, runtime_s: float
) -> list[FioRow]:
    """fio against each profile's mount (a sparse SIZE_MIB file the emulator holds), every request
    size, job count and mode; each row is also logged as it comes. EmuDriveError / OSError on failure."""
    if shutil.which("fio") is None:
        raise EmuDriveError("fio is missing (apt-get install fio)")
    rows: list[FioRow] = []
    with tempfile.TemporaryDirectory(prefix="onebit-fiocheck-") as tmp:
        src = Path(tmp) / "drive.bin"
        with open(src, "wb") as f:
            f.truncate(size_mib * MIB)  # sparse: the emulator holds its bytes, not the disk
        for p in profiles:
            for max_read, ra_kb in sorted({(mr, ra) for mr, ra, md in MOUNTS if md in modes}):
                with mounted(src, p, read_ahead_kb=ra_kb, max_read=max_read) as m:
                    for mode in (md for mr, ra, md in MOUNTS if (mr, ra) == (max_read, ra_kb) and md in modes):
                        for bs in sizes:
                            for j in jobs:
                                row = run_one(m, mode, bs, j, size_mib * MIB, runtime_s)
                                rows.append(row)
                                logger.info("%s", markdown([row]).splitlines()[-1])
    return rows
