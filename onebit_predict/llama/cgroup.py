"""A memory cgroup for one benchmark process: a limit below the model's expert bytes, so that
the kernel's own reclaim, not the benchmark, evicts expert pages (onebit-bench --memory-limit).

Detects cgroup v1 (``/sys/fs/cgroup/memory``, ``memory.limit_in_bytes``) or v2 (a ``memory``
controller in ``/sys/fs/cgroup/cgroup.controllers``, ``memory.max``); where neither can be
used (not root, not mounted, no memory controller) :class:`CgroupError` says why. The page
cache of a file is charged to the group that first touched its pages, so the worker drops
the model file from the page cache once it has joined its group, and checks with mincore that
no expert page of it is left (:func:`drop_from_page_cache`).

A group is listed in the run's state file (llama/run_state.py) before it is made and dropped from it
once removed, so that the next run removes one a ``kill -9`` left behind. The cgroup root is a
parameter (``root``, default :data:`ROOT`) for the tests' stand-in trees.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import run_state

ROOT = Path("/sys/fs/cgroup")
# memory.stat's names, by the version's events file, for (shmem: keep anon's memfd slots; the page cache, shmem
# included; anonymous memory), returned under v1's names
STAT_NAMES = {"memory.oom_control": ("shmem", "cache", "rss"), "memory.events": ("shmem", "file", "anon")}


class CgroupError(RuntimeError):
    """No memory cgroup can be made here, or one could not be set up (the reason is the message)."""


class MemoryCgroup:
    """A fresh memory cgroup with a limit; :meth:`remove` when its processes have exited."""

    def __init__(self, name: str, limit_bytes: int, root: Path | None = None) -> None:
        root = ROOT if root is None else Path(root)
        if os.geteuid() != 0:
            raise CgroupError("a memory cgroup needs root (the benchmark creates and removes one per run)")
        if (root / "memory" / "memory.limit_in_bytes").is_file():
            self.path, limit_file = root / "memory" / name, "memory.limit_in_bytes"
            self.events_file = "memory.oom_control"
        elif "memory" in _read(root / "cgroup.controllers").split():
            self.path, limit_file = root / name, "memory.max"
            self.events_file = "memory.events"
        else:
            raise CgroupError(f"no memory cgroup controller under {root} (neither v1 memory/ nor v2 memory)")
        run_state.note("cgroups", self.path)  # before the mkdir: a kill -9 after it leaves nothing unlisted
        try:
            self.path.mkdir()
            (self.path / limit_file).write_text(str(limit_bytes))
        except OSError as e:
            self.remove()
            raise CgroupError(f"cannot set up {self.path}: {e}") from None
        self.limit_bytes = limit_bytes

    def oom_kills(self) -> int:
        """How many processes the group's OOM killer has killed (``oom_kill`` in memory.events, v1's
        memory.oom_control); 0 where the kernel does not count them."""
        for line in _read(self.path / self.events_file).splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
        return 0

    def memory_mib(self) -> dict[str, int]:
        """The group's ``shmem``, ``cache`` (the page cache, shmem included) and ``rss`` (anonymous) now, in MiB
        (v2's ``shmem``, ``file`` and ``anon``); CgroupError where its memory.stat lacks one."""
        stat_file = self.path / "memory.stat"
        stat = dict(line.split()[:2] for line in _read(stat_file).splitlines() if line.strip())
        names = STAT_NAMES[self.events_file]
        missing = [n for n in names if n not in stat]
        if missing:
            raise CgroupError(f"{stat_file} has no {', '.join(missing)}")
        return {k: int(stat[n]) // 2**20 for k, n in zip(STAT_NAMES["memory.oom_control"], names)}

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except FileNotFoundError:
            pass
        run_state.forget("cgroups", self.path)


def join(path: Path) -> None:
    """Move this process into the cgroup at ``path``."""
    (path / "cgroup.procs").write_text(str(os.getpid()))


def drop_from_page_cache(path: Path) -> None:
    """Drop ``path`` from the page cache (so this process's group reads it anew) and prove it: no
    expert page of the model left resident before the model is mapped (llama/evict.py
    ``require_evicted``: EvictionNotHeld, exit 1, where one is)."""
    from .evict import require_evicted

    require_evicted(path, f"pid {os.getpid()}, in its memory cgroup")


def io_read_bytes() -> int:
    """Bytes this process caused to be read from storage (/proc/self/io read_bytes)."""
    for line in _read(Path("/proc/self/io")).splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
