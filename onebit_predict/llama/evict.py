"""Keep a model's expert weights on the drive: evict their pages between tokens.

The bundled models fit in memory many times over, so a benchmark of the prefetch consumer
must make every token read its experts from the drive, as it would for a model that does
not fit. In the process that runs llama.cpp, this module finds the GGUF's mapping in
``/proc/self/maps`` (llama.cpp maps the whole file from offset 0), the byte ranges of every
routed-expert tensor (``blk.N.ffn_{gate,up,gate_up,down}_exps``, read by onebit_predict/gguf_experts.py),
and:

- marks them ``MADV_RANDOM``, so a fault reads the page it needs rather than a readahead
  window holding the neighbouring experts too (which would make every prediction look free);
- evicts them with one of two methods, whichever works on the machine (``detect``):
  ``dontneed`` (``madvise(MADV_DONTNEED)``
  to unmap, then ``posix_fadvise(POSIX_FADV_DONTNEED)`` to drop the page cache) or ``pageout``
  (``madvise(MADV_PAGEOUT)``, Linux 5.4+, which skips pages it finds busy);
- measures how much of them is resident (``mincore``), to prove the eviction worked.

:func:`require_evicted` is the same proof for a file no process maps yet (onebit-bench
--memory-limit, before each run's first token): the file dropped from the page cache, no expert
page of it may be left resident (:func:`resident_expert_bytes`, mincore on a mapping of its own),
else :class:`EvictionNotHeld` (exit 1) names the run and the bytes.

:func:`random_read_kib` reads which of a process's mappings of a file carry the random-read advice
(smaps' ``rr``): where a fault reads a page at a time.

Linux only; everything else raises EvictError with the reason.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..gguf_experts import ModelError, read_experts

MADV_RANDOM = 1
MADV_DONTNEED = 4
MADV_PAGEOUT = 21
POSIX_FADV_DONTNEED = 4
METHODS = ("dontneed", "pageout")  # dontneed first: pageout leaves pages it finds busy (seen here)
# a method works when at most this fraction of the expert pages stays resident (a page an expert
# tensor shares with a tensor used every token may come back at once)
EVICTED_ENOUGH = 0.05

PAGE = mmap.PAGESIZE
_MAPS_LINE = re.compile(r"^([0-9a-f]+)-([0-9a-f]+) (\S+) ([0-9a-f]+) \S+ \d+\s+(.*)$")


class EvictError(RuntimeError):
    """The expert pages cannot be located or evicted on this machine."""


class EvictionNotHeld(EvictError):
    """Expert pages of the model were resident as a run that must start with none began (exit 1)."""


@dataclass(frozen=True)
class Span:
    """A page-aligned byte range of the file: [start, start + size)."""

    start: int
    size: int


def expert_spans(gguf_path: Path) -> list[Span]:
    """The page-aligned file ranges of the routed-expert tensors, merged where they touch."""
    try:
        raw = read_experts(gguf_path).spans()
    except ModelError as e:
        raise EvictError(str(e)) from None
    spans: list[Span] = []
    for off, n in raw:
        start = off // PAGE * PAGE
        end = -(-(off + n) // PAGE) * PAGE
        if spans and start <= spans[-1].start + spans[-1].size:
            last = spans.pop()
            start, end = last.start, max(end, last.start + last.size)
        spans.append(Span(start, end - start))
    return spans


def mapping_base(gguf_path: Path) -> int:
    """The address of file offset 0 in this process's mapping of gguf_path (llama.cpp's).

    llama.cpp maps the whole file in one piece and then unmaps the fragments no tensor uses
    (the header page among them), so a line of /proc/self/maps may start past offset 0:
    the base is its start minus its offset, the same for every fragment.
    """
    target = os.path.realpath(gguf_path)
    bases = set()
    with open("/proc/self/maps") as f:
        for line in f:
            m = _MAPS_LINE.match(line.rstrip("\n"))
            if m and m.group(5) == target and "s" in m.group(3):
                bases.add(int(m.group(1), 16) - int(m.group(4), 16))
    if len(bases) == 1:
        return bases.pop()
    if len(bases) > 1:
        raise EvictError(f"{target} is mapped {len(bases)} times in this process; cannot tell which is llama.cpp's")
    raise EvictError(f"{target} is not mapped in this process (was the model loaded with mmap?)")


def filesystem_type(path: Path) -> str:
    """The type of the filesystem holding path (the longest mount point above it in /proc/mounts)."""
    target = os.path.realpath(path)
    best, fstype = "", "?"
    with open("/proc/mounts") as f:
        for line in f:
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1].replace("\\040", " ")
            inside = target == mount or target.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, fstype = mount, fields[2]
    return fstype


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


class ExpertPages:
    """The expert pages of one mapped GGUF in this process."""

    def __init__(self, gguf_path: Path) -> None:
        if not Path("/proc/self/maps").exists():
            raise EvictError("no /proc/self/maps: page eviction needs Linux")
        self.path = Path(gguf_path)
        self.spans = expert_spans(self.path)
        self.base = mapping_base(self.path)
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        self.libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
        self.libc.posix_fadvise.argtypes = (ctypes.c_int, ctypes.c_long, ctypes.c_long, ctypes.c_int)
        self.fd = os.open(self.path, os.O_RDONLY)
        # a freshly written model still has dirty pages, which neither method evicts: write them back first
        os.fsync(self.fd)

    @property
    def nbytes(self) -> int:
        return sum(s.size for s in self.spans)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def _madvise(self, span: Span, advice: int, name: str) -> None:
        if self.libc.madvise(self.base + span.start, span.size, advice) != 0:
            err = ctypes.get_errno()
            raise EvictError(f"madvise({name}) failed: {os.strerror(err)} (errno {err})")

    def random_access(self) -> None:
        """No readahead on fault: a fault reads its own page, not the neighbouring experts."""
        for s in self.spans:
            self._madvise(s, MADV_RANDOM, "MADV_RANDOM")

    def evict(self, method: str) -> None:
        for s in self.spans:
            if method == "pageout":
                self._madvise(s, MADV_PAGEOUT, "MADV_PAGEOUT")
            elif method == "dontneed":
                self._madvise(s, MADV_DONTNEED, "MADV_DONTNEED")
                rc = self.libc.posix_fadvise(self.fd, s.start, s.size, POSIX_FADV_DONTNEED)
                if rc != 0:
                    raise EvictError(f"posix_fadvise(POSIX_FADV_DONTNEED) failed: {os.strerror(rc)} (errno {rc})")
            else:
                raise ValueError(f"unknown eviction method {method!r}")

    def resident_fraction(self) -> float:
        """The fraction of the expert pages in memory now (mincore)."""
        resident = total = 0
        for s in self.spans:
            n = s.size // PAGE
            vec = (ctypes.c_ubyte * n)()
            if self.libc.mincore(self.base + s.start, s.size, vec) != 0:
                err = ctypes.get_errno()
                raise EvictError(f"mincore failed: {os.strerror(err)} (errno {err})")
            resident += sum(b & 1 for b in vec)
            total += n
        return resident / total

    def detect(self, methods: Sequence[str] = METHODS) -> tuple[str, list[str]]:
        """The first method that leaves at most EVICTED_ENOUGH resident, and what each tried did.

        Raises EvictError (with every attempt) when none works.
        """
        notes = []
        for method in methods:
            try:
                self.evict(method)
            except EvictError as exc:
                notes.append(f"{method}: {exc}")
                continue
            left = self.resident_fraction()
            notes.append(f"{method}: {100 * left:.1f}% of {self.nbytes} expert bytes still resident after it")
            if left <= EVICTED_ENOUGH:
                return method, notes
        fstype = filesystem_type(self.path)
        hint = (
            (
                f" ({self.path} is on {fstype}, whose pages live in memory and cannot be evicted: put the model on a"
                " disk-backed filesystem)"
            )
            if fstype in MEMORY_FILESYSTEMS
            else ""
        )
        raise EvictError("no eviction method works here: " + "; ".join(notes) + hint)


def random_read_kib(path: Path, pid: int | str = "self") -> int:
    """KiB of process ``pid``'s mappings of ``path`` that carry the random-read advice (smaps' VmFlags "rr")."""
    total, mapped, size, target = 0, False, 0, Path(path).resolve()
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            mapped = len(fields) >= 6 and Path(fields[5]) == target
        elif mapped and fields[0] == "Size:":
            size = int(fields[1])
        elif mapped and fields[0] == "VmFlags:" and "rr" in fields[1:]:
            total += size
    return total


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))
    return libc


def resident_expert_bytes(gguf_path: Path, spans: Sequence[Span]) -> int:
    """The bytes of the expert pages ``spans`` (:func:`expert_spans`) of ``gguf_path`` in the page cache
    now: mincore on a mapping of its own, which faults nothing in (a file mapping's mincore reads the
    page cache). The spans are read first, apart: reading a GGUF's header faults it in through a
    mapping, and the fault's read-around (2 x read_ahead_kb) brings in the pages around it."""
    libc = _libc()
    fd = os.open(gguf_path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            err = ctypes.get_errno()
            raise EvictError(f"mmap of {gguf_path} failed: {os.strerror(err)} (errno {err})")
        try:
            resident = 0
            for s in spans:
                n = -(-min(s.size, size - s.start) // PAGE)
                vec = (ctypes.c_ubyte * n)()
                if libc.mincore(addr + s.start, n * PAGE, vec) != 0:
                    err = ctypes.get_errno()
                    raise EvictError(f"mincore failed: {os.strerror(err)} (errno {err})")
                resident += sum(b & 1 for b in vec)
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return resident * PAGE


def drop_file(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (written back first: a dirty page is not dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def require_evicted(gguf_path: Path, what: str, tries: int = 5, wait_s: float = 0.1) -> None:
    """Drop the file from the page cache and prove it: no expert page of it resident (mincore), after
    up to ``tries`` drops ``wait_s`` apart (a process that just exited may still be unmapping it);
    else EvictionNotHeld naming ``what`` (the run) and the resident bytes."""
    spans = expert_spans(gguf_path)  # before the drop: reading the header brings pages in (above)
    total = sum(s.size for s in spans)
    for i in range(tries):
        drop_file(gguf_path)
        left = resident_expert_bytes(gguf_path, spans)
        if left == 0:
            return
        if i + 1 < tries:
            time.sleep(wait_s)
    fstype = filesystem_type(gguf_path)
    why = f"{fstype} keeps its pages in memory" if fstype in MEMORY_FILESYSTEMS else "another process mapping it?"
    raise EvictionNotHeld(
        f"{what}: {left} bytes ({left / 2**20:.1f} MiB, {100 * left / total:.1f} %) of {Path(gguf_path).name}'s "
        f"expert pages resident before its first token, after {tries} drops from the page cache ({why}): the "
        "eviction did not hold, the run would start warm; refused"
    )
