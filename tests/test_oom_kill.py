"""A run its memory cgroup's OOM killer stopped is named so (not "killed by SIGKILL"): the group's
oom_kill count, read from memory.events (v2) or memory.oom_control (v1), in a stand-in tree and in a
real group whose process outgrows it."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from onebit_predict.checks.rounds import WorkerError, why_killed
from onebit_predict.llama import cgroup
from onebit_predict.llama.cgroup import CgroupError, MemoryCgroup


class _Group:
    def __init__(self, kills: int) -> None:
        self.kills, self.limit_bytes = kills, 174 << 20

    def oom_kills(self) -> int:
        return self.kills


def test_a_sigkill_with_an_oom_kill_counted_is_named_by_it():
    killed = WorkerError("route, prefill 512, ubatch 512: the worker failed: killed by SIGKILL", -signal.SIGKILL)
    got = why_killed(killed, "route, prefill 512, ubatch 512", None, _Group(1))
    assert str(got).startswith(
        "route, prefill 512, ubatch 512: killed by its memory cgroup's OOM killer (1 oom_kill in its memory.events) "
        "at 174 MiB: the run's own memory"
    )
    assert str(got).endswith("give a larger --memory-limit or a smaller --ubatch") and got.signal == signal.SIGKILL
    assert why_killed(killed, "x", None, _Group(0)) is killed  # killed, but not by the group: as it was
    assert why_killed(killed, "x", None, None) is killed  # no limit, no group
    bus = WorkerError("x: the worker failed: killed by SIGBUS", -signal.SIGBUS)
    assert why_killed(bus, "x", None, _Group(1)) is bus  # another signal is not the OOM killer's


def stand_in_group(root: Path, monkeypatch: pytest.MonkeyPatch, layout: str) -> MemoryCgroup:
    """A group made under a stand-in cgroup tree of ``layout`` (v1 or v2) at ``root``, as root."""
    monkeypatch.setattr(cgroup.os, "geteuid", lambda: 0)
    if layout == "v2":
        (root / "cgroup.controllers").write_text("cpu memory io\n")
    else:
        (root / "memory").mkdir()
        (root / "memory" / "memory.limit_in_bytes").write_text("max\n")
    return MemoryCgroup("onebit-bench-1", 64 << 20, root=root)


@pytest.mark.parametrize(
    "layout, events, text",
    [
        ("v2", "memory.events", "low 0\nhigh 0\nmax 12\noom 1\noom_kill 2\noom_group_kill 0\n"),
        ("v1", "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"),
    ],
)
def test_oom_kills_read_from_the_groups_events(tmp_path, monkeypatch, layout, events, text):
    group = stand_in_group(tmp_path, monkeypatch, layout)
    assert group.oom_kills() == 0  # no events file yet: none counted
    (group.path / events).write_text(text)
    assert group.oom_kills() == 2


@pytest.mark.parametrize(
    "layout, text",
    [
        ("v2", "anon 33554432\nfile 157286400\nshmem 16777216\n"),
        ("v1", "cache 157286400\nrss 33554432\nshmem 16777216\nmapped_file 0\n"),
    ],
)
def test_memory_read_from_the_groups_stat_by_v1_names(tmp_path, monkeypatch, layout, text):
    group = stand_in_group(tmp_path, monkeypatch, layout)
    (group.path / "memory.stat").write_text(text)
    assert group.memory_mib() == {"shmem": 16, "cache": 150, "rss": 32}
    (group.path / "memory.stat").write_text(text.replace("shmem", "shmem_other"))
    with pytest.raises(CgroupError, match="has no shmem"):
        group.memory_mib()


def test_a_real_group_counts_the_kill_of_a_process_that_outgrows_it():
    """Root, a memory controller: a process that allocates 256 MiB in a 32 MiB group is killed, and the
    group says its OOM killer did it."""
    try:
        group = MemoryCgroup("onebit-test-oom", 32 << 20)
    except CgroupError as e:
        pytest.skip(f"no memory cgroup here: {e}")
    grow = (
        "import os, sys; open(sys.argv[1] + '/cgroup.procs', 'w').write(str(os.getpid())); "
        "b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096])"
    )
    try:
        proc = subprocess.run([sys.executable, "-c", grow, str(group.path)], capture_output=True)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        assert group.oom_kills() >= 1
        got = why_killed(WorkerError("w: killed by SIGKILL", proc.returncode), "w", None, group)
        assert "killed by its memory cgroup's OOM killer" in str(got) and "at 32 MiB" in str(got)
    finally:
        group.remove()
