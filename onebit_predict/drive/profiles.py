"""The emulated drives' profiles: the device model's parameters, each from a public drive spec.

The model (onebit-emudrive.c) gives a request of ``s`` bytes a latency ``L``, then a transfer of
``s / B`` on a bus of ``B`` bytes/s shared by the requests in flight, with at most ``channels``
requests in service. With ``k`` requests of ``s`` bytes kept in flight it delivers

    min(B, min(k, channels) * s / (L + s / B))   bytes/s

(``model_throughput``). Each profile picks ``L``, ``B`` and ``channels`` so that this gives the
drive's published figures at the request sizes the mount sends: 128 KiB by default (FUSE's
``max_read`` and the bdi's ``read_ahead_kb`` of 128 both cap a request there), up to 1 MiB with
``max_read=1 MiB`` and ``read_ahead_kb >= 1024``. docs/drive.md has the derivation and fio's check.

nvme (a PCIe 4.0 x4 drive; numbers from Samsung's 980 PRO 1 TB data sheet: sequential read
7,000 MB/s, 4 KB random read 1,000K IOPS at QD32; the target the project set from them: about
80 us per request, about 1.5 GB/s at QD1 rising to about 6 GB/s at QD >= 8):
  - B = 6.0 GB/s: the target at QD >= 8, below the data sheet's 7,000 MB/s (the PCIe 4.0 x4
    ceiling at deep queues);
  - L = 65 us: a 128 KiB request then takes 65 + 131072 / 6e9 s = 87 us, about 80 us per request
    and 1.5 GB/s at QD1; at QD 4 the bus is full (4 x 1.5 = 6.0 GB/s); a 1 MiB request at QD1
    gives 4.4 GB/s;
  - channels = 64: 1,000K IOPS of 4 KB at 66 us each need about 66 requests in service
    (Little's law); at 128 KiB the bus, not the channels, is the limit.
nvme-1m: the same nvme whose mount takes the kernel's largest FUSE request, 1 MiB (``max_read``),
as a real NVMe drive takes 512 KiB to 2 MiB requests: a pread of a whole expert slice, or a readahead
window of ``read_ahead_kb >= 1024``, then reaches the drive as 1 MiB requests, where the default
mount splits every one at 128 KiB. Faults stay at the bdi's ``read_ahead_kb``.
nvme-3g: the same nvme with its bus at 3 GB/s, the drive the seed's Python prototype simulated for its
5.47x (docs/int2.md, the seed's system measured whole): a 128 KiB request takes 65 + 44 = 109 us.
sata (a SATA 6 Gb/s drive; Samsung 870 EVO data sheet: sequential read 560 MB/s, 4 KB random
read 13K IOPS at QD1 and 98K IOPS at QD32):
  - B = 560 MB/s: the sequential read figure (the SATA link's ceiling);
  - L = 70 us: a 4 KB request takes 70 + 7.3 = 77 us, 13K IOPS at QD1; a 128 KiB request takes
    304 us, 431 MB/s at QD1, and the bus is full from QD 2 (560 MB/s): little scaling;
  - channels = 8: 98K IOPS of 4 KB at 77 us need about 8 in service.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

KIB = 1024
MIB = 1024 * KIB

MAX_READ_DEFAULT = 128 * KIB  # FUSE's default largest read request, the kernel's default readahead
MAX_READ_LIMIT = 1 * MIB  # the kernel's fuse max_pages_limit (256 pages) caps a request here


@dataclass(frozen=True)
class DriveProfile:
    """One emulated drive: the device model's parameters and where they come from."""

    name: str
    latency_us: float  # per request, overlapping across requests in service
    bandwidth: float  # bytes/s of the bus the requests in flight share
    channels: int  # requests in service at once; later ones wait
    max_read: int = MAX_READ_DEFAULT  # FUSE's largest read request (bytes)
    source: str = ""  # the public spec the numbers come from

    def __post_init__(self) -> None:
        if self.latency_us < 0 or self.bandwidth < 0 or self.channels < 1:
            raise ValueError(f"drive profile {self.name}: latency and bandwidth must be >= 0, channels >= 1")
        if not (4096 <= self.max_read <= MAX_READ_LIMIT) or self.max_read % 4096:
            raise ValueError(f"drive profile {self.name}: max_read must be a multiple of 4096 in 4 KiB..1 MiB")

    def model_throughput(self, request_bytes: int, in_flight: int) -> float:
        """Bytes/s the model delivers with ``in_flight`` requests of ``request_bytes`` kept in flight."""
        xfer_s = request_bytes / self.bandwidth if self.bandwidth > 0 else 0.0
        per_request_s = self.latency_us / 1e6 + xfer_s
        busy = min(in_flight, self.channels)
        rate = busy * request_bytes / per_request_s if per_request_s > 0 else float("inf")
        return min(self.bandwidth, rate) if self.bandwidth > 0 else rate


NVME = DriveProfile(
    name="nvme",
    latency_us=65.0,
    bandwidth=6.0e9,
    channels=64,
    source="Samsung 980 PRO 1 TB data sheet (PCIe 4.0 x4): sequential read 7,000 MB/s, 4 KB random read 1,000K IOPS",
)

NVME_1M = replace(
    NVME,
    name="nvme-1m",
    max_read=MAX_READ_LIMIT,
    source=NVME.source + "; the mount's max_read at the kernel's FUSE limit, 1 MiB",
)

SATA = DriveProfile(
    name="sata",
    latency_us=70.0,
    bandwidth=560e6,
    channels=8,
    source="Samsung 870 EVO data sheet (SATA 6 Gb/s): sequential read 560 MB/s, 4 KB random read 13K IOPS QD1, "
    "98K IOPS QD32",
)

NVME_3G = replace(
    NVME,
    name="nvme-3g",
    bandwidth=3.0e9,
    source=NVME.source + "; the bus at 3 GB/s, the drive the seed's prototype simulated (its 5.47x)",
)

PROFILES: dict[str, DriveProfile] = {p.name: p for p in (NVME, NVME_1M, NVME_3G, SATA)}


def profile(name: str) -> DriveProfile:
    """The profile called ``name``; ValueError naming the known ones otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown drive profile {name!r}: known are {', '.join(sorted(PROFILES))}") from None
