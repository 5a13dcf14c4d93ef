"""After ``kill -9`` of onebit-bench (llama/run_state.py): what the run changed on the machine is in its
state file before it is changed, and the next run (or ``onebit-bench --restore``) puts it back.

The bench runs for real in a child process, killed at each stage of a ``--memory-limit`` run: after
its temporary directory is made, after read_ahead_kb is set, after its cgroup is made, and mid-run
(a stand-in worker process inside the cgroup). The device's read_ahead_kb is a stand-in sysfs tree
and the cgroup root a stand-in directory (never the real ones), the build and the worker stand-ins
too; the state directory is a temporary one (``ONEBIT_RUN_STATE_DIR``). One test uses a real memory
cgroup (root, a memory controller: skipped otherwise), one a real FUSE mount of the emulated drive
(skipped without FUSE), and one the real build (needs_build).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from onebit_predict.atomic import sweep_partials, temp_name
from onebit_predict.commands.bench import main as bench_main
from onebit_predict.constants import ENV_RUN_STATE, EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from onebit_predict.llama import run_state
from onebit_predict.llama.cgroup import ROOT, CgroupError, MemoryCgroup
from onebit_predict.llama.run_state import RunRecord, journal, recover, running, start_time

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "qwen3moe-tiny.gguf"

# The bench's --memory-limit run in a child: the real command line, its real journal, the real
# ReadAhead and MemoryCgroup against stand-in roots; it stops (prints the stage, sleeps) at one stage.
CHILD = r"""
import os, signal, subprocess, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal, whatever pytest's was
stage, sys_root, cg_root, model, *argv = sys.argv[1:]
from onebit_predict.llama import cgroup, evict, read_ahead
from onebit_predict.checks import bench_memory, rounds
from onebit_predict.commands import bench
import onebit_predict.llama.drive as drive
read_ahead.SYS = Path(sys_root)
if cg_root != "real":
    cgroup.ROOT = Path(cg_root)
    os.geteuid = lambda: 0  # the stand-in cgroup root takes any user's mkdir
    remove = cgroup.MemoryCgroup.remove

    def as_cgroupfs(self):  # the kernel's rmdir of a cgroup takes its files with it: here they are plain files
        for f in self.path.glob("*"):
            f.unlink()
        remove(self)

    cgroup.MemoryCgroup.remove = as_cgroupfs

class Build:
    lib_dir = Path("/nonexistent")

drive.measure_drive = lambda directory: drive.DriveFigures("/", 1000.0, 50.0)
bench.build_info = lambda: Build()

def pause(name):
    print(name, flush=True)
    time.sleep(600)

if stage == "temp dir":  # the run's directory made, read_ahead_kb recorded, nothing set yet
    bench_memory.memory_configs = lambda *a, **k: pause("temp dir")
if stage == "read_ahead_kb":  # set for the first run, before its cgroup
    evict.require_evicted = lambda *a, **k: pause("read_ahead_kb")

def worker(cmd, lib, what):
    group = cmd[cmd.index("--cgroup") + 1] if "--cgroup" in cmd else None
    if stage == "cgroup":
        pause("cgroup")
    # mid-run: a worker process in the cgroup (it outlives the bench, as a real worker would for a while)
    code = ("import os, sys, time; open(sys.argv[1], 'a').write(str(os.getpid()) + chr(10)); "
            "print(os.getpid(), flush=True); time.sleep(600)")
    procs = (Path(group) / "cgroup.procs") if group else Path(os.devnull)
    p = subprocess.Popen([sys.executable, "-c", code, str(procs)], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == str(p.pid), "the stand-in worker did not start"
    pause("mid-run")

rounds.worker_json = worker
sys.exit(bench.main([model, *argv]))
"""

ARGV = ["--memory-limit", "64MiB", "--rounds", "1", "--rows", "patched off", "--read-ahead-kb", "256"]


class Env:
    """A stand-in machine: the model's device (read_ahead_kb 4096), a v1 memory cgroup root, a state dir."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.model = tmp_path / "qwen3moe-tiny.gguf"
        shutil.copyfile(MODEL, self.model)
        dev = os.stat(self.model).st_dev
        disk = tmp_path / "sys" / "devices" / "virtual" / "block" / "vdz"
        (disk / "queue").mkdir(parents=True)
        self.ra = disk / "queue" / "read_ahead_kb"
        self.ra.write_text("4096\n")
        (tmp_path / "sys" / "dev" / "block").mkdir(parents=True)
        (tmp_path / "sys" / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(disk)
        self.cg_root = tmp_path / "cgroup"
        (self.cg_root / "memory").mkdir(parents=True)
        (self.cg_root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
        self.state = tmp_path / "state"
        self.children: list[subprocess.Popen] = []

    def start(self, stage: str, argv: list[str] = ARGV, cg_root: str | None = None) -> tuple[subprocess.Popen, Path]:
        """The bench in a child, stopped at ``stage``: (the process, its stderr file)."""
        err = self.tmp / f"stderr-{len(self.children)}"
        env = {**os.environ, "PYTHONPATH": str(REPO), ENV_RUN_STATE: str(self.state)}
        args = [stage, str(self.tmp / "sys"), cg_root or str(self.cg_root), str(self.model), *argv]
        with open(err, "w") as f:
            proc = subprocess.Popen(
                [sys.executable, "-c", CHILD, *args], stdout=subprocess.PIPE, stderr=f, text=True, env=env
            )
        self.children.append(proc)
        assert proc.stdout is not None
        lines = []
        while True:
            line = proc.stdout.readline()
            assert line, f"the bench ended before {stage!r} (rc {proc.wait()}):\n{err.read_text()}"
            lines.append(line.strip())
            if line.strip() == stage:
                return proc, err

    def kill9(self, proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()

    def states(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.state.glob("*.json"))]

    def group(self, pid: int) -> Path:
        return self.cg_root / "memory" / f"onebit-bench-{pid}"

    def as_cgroupfs(self, group: Path) -> None:
        """What the kernel does on rmdir of a cgroup: its files go with it (here they are plain files)."""
        for f in group.iterdir():
            f.unlink()

    def close(self) -> None:
        """A test that failed half way leaves nothing either: its benches and their workers killed, then
        what they left put back."""
        for p in self.children:
            if p.poll() is None:
                p.kill()
                p.wait()
        for procs in self.cg_root.glob("memory/onebit-bench-*/cgroup.procs"):
            for pid in map(int, procs.read_text().split()):
                if start_time(pid) is not None:
                    os.kill(pid, signal.SIGKILL)
            self.as_cgroupfs(procs.parent)
        for state in self.states():
            for group in state["cgroups"]:
                if Path(group).is_dir() and not str(group).startswith(str(ROOT)):
                    self.as_cgroupfs(Path(group))
        recover(self.state)


@pytest.fixture
def env(tmp_path, monkeypatch):
    e = Env(tmp_path)
    monkeypatch.setenv(ENV_RUN_STATE, str(e.state))
    yield e
    e.close()


def _temp_dirs(state: dict) -> list[Path]:
    return [Path(d) for d in state["temp_dirs"]]


def _restore(capsys) -> tuple[int, list[str]]:
    rc = bench_main(["--restore"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err.splitlines()


# --- kill -9 at each stage ----------------------------------------------------------------------


def test_killed_after_its_temp_dir_is_made(env, capsys):
    proc, _ = env.start("temp dir")
    (state,) = env.states()
    assert state["pid"] == proc.pid and state["start_time"] == start_time(proc.pid)
    assert state["settings"] == {str(env.ra): "4096"}  # recorded before any write
    (tmp,) = _temp_dirs(state)
    assert tmp.name.startswith("onebit-bench-") and tmp.is_dir()
    env.kill9(proc)
    assert tmp.is_dir() and env.ra.read_text() == "4096\n"  # what a kill -9 leaves
    rc, lines = _restore(capsys)
    assert rc == EXIT_OK and not tmp.exists() and env.states() == [] and env.ra.read_text() == "4096\n"
    assert lines == [f"onebit-bench: removed temporary directory {tmp} (left by onebit-bench pid {proc.pid}, "
                     "no longer running)"]  # fmt: skip
    assert _restore(capsys) == (EXIT_OK, [])  # nothing left to do


def test_killed_after_read_ahead_kb_is_set(env, capsys):
    """The value found is put back, and the next run finds it (not the killed run's) as the original."""
    proc, err = env.start("read_ahead_kb")
    assert env.ra.read_text() == "256\n"
    assert "read_ahead_kb of vdz set to 256 (found 4096; recorded: after a kill -9, the next" in err.read_text()
    env.kill9(proc)
    assert env.ra.read_text() == "256\n"  # the value the bench set stays: no handler runs on SIGKILL
    (state,) = env.states()
    assert state["settings"] == {str(env.ra): "4096"} and state["cgroups"] == []
    # the next run puts it back first, then reads the device
    nxt, err2 = env.start("temp dir")
    text = err2.read_text()
    line = f"restored {env.ra} to 4096 (left at 256 by onebit-bench pid {proc.pid}, no longer running)"
    assert f"onebit-bench: {line}" in text.splitlines()
    found = next(t for t in text.splitlines() if "model on vdz" in t)  # what the new run takes as the original
    assert text.index(line) < text.index(found) and "read_ahead_kb 4096" in found
    (state,) = env.states()  # the killed run's file gone, the new run's with the right original
    assert state["pid"] == nxt.pid and state["settings"] == {str(env.ra): "4096"}
    env.kill9(nxt)
    rc, lines = _restore(capsys)
    assert rc == EXIT_OK and len(lines) == 1 and "removed temporary directory" in lines[0] and env.states() == []


def test_killed_after_its_cgroup_is_made(env, capsys):
    proc, _ = env.start("cgroup")
    group = env.group(proc.pid)
    (state,) = env.states()
    assert state["cgroups"] == [str(group)] and group.is_dir() and env.ra.read_text() == "256\n"
    env.kill9(proc)
    env.as_cgroupfs(group)
    rc, lines = _restore(capsys)
    assert rc == EXIT_OK and not group.exists() and env.ra.read_text() == "4096\n" and env.states() == []
    who = f"onebit-bench pid {proc.pid}, no longer running"
    (tmp,) = _temp_dirs(state)
    assert sorted(lines) == sorted([
        f"onebit-bench: restored {env.ra} to 4096 (left at 256 by {who})",
        f"onebit-bench: removed cgroup {group} (left by {who})",
        f"onebit-bench: removed temporary directory {tmp} (left by {who})",
    ])  # fmt: skip


def test_killed_mid_run_leaves_its_worker_cgroup_until_it_exits(env, capsys):
    """The worker outlives the bench: its cgroup is left and reported (exit 1), everything else put back;
    once the worker has exited, the next --restore removes the cgroup."""
    proc, _ = env.start("mid-run")
    group = env.group(proc.pid)
    worker = int((group / "cgroup.procs").read_text().split()[0])
    assert running(worker, start_time(worker))
    env.kill9(proc)
    rc, lines = _restore(capsys)
    assert rc == EXIT_CHECK_FAILED and env.ra.read_text() == "4096\n" and group.is_dir()
    assert (
        f"onebit-bench: WARNING: left cgroup {group} (made by onebit-bench pid {proc.pid}, no longer running): "
        f"1 process(es) still in it (pid {worker}); onebit-bench --restore removes it once they have exited" in lines
    )
    (state,) = env.states()
    assert state["cgroups"] == [str(group)] and state["settings"] == {} and state["temp_dirs"] == []
    os.kill(worker, signal.SIGKILL)
    while start_time(worker) is not None:  # reaped by init once its parent, the bench, is gone
        time.sleep(0.01)
    env.as_cgroupfs(group)
    rc, lines = _restore(capsys)
    assert rc == EXIT_OK and lines == [f"onebit-bench: removed cgroup {group} (left by onebit-bench pid {proc.pid}, "
                                       "no longer running)"] and env.states() == []  # fmt: skip


def test_every_run_recovers_first(env, capsys, monkeypatch):
    """Not only --restore: a run that fails on its arguments has put back what a killed run left."""
    proc, _ = env.start("read_ahead_kb")
    env.kill9(proc)
    assert bench_main([str(env.model), "--memory-limit", "64MiB", "--rounds", "2"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert f"restored {env.ra} to 4096 (left at 256" in err and "odd --rounds" in err
    assert env.ra.read_text() == "4096\n" and env.states() == []


def test_a_running_bench_is_left_alone(env, capsys):
    proc, _ = env.start("read_ahead_kb")
    assert _restore(capsys) == (EXIT_OK, [])
    assert env.ra.read_text() == "256\n" and len(env.states()) == 1  # its own to restore
    proc.send_signal(signal.SIGTERM)  # the handler restores, the finally blocks remove the rest
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert env.ra.read_text() == "4096\n" and env.states() == []


def test_a_pid_taken_by_another_process_is_a_dead_run(env, capsys):
    """The state names pid P started at time T: a process P that started at another time is not the run."""
    tmp = env.tmp / "onebit-bench-leftover"
    tmp.mkdir()
    rec = RunRecord("onebit-bench", os.getpid(), (start_time(os.getpid()) or 0) + 1, time.time(), temp_dirs=[str(tmp)])
    env.state.mkdir()
    (env.state / "onebit-bench-1.json").write_text(json.dumps(rec.__dict__))
    rc, lines = _restore(capsys)
    assert rc == EXIT_OK and not tmp.exists()
    assert lines == [f"onebit-bench: removed temporary directory {tmp} (left by onebit-bench pid {os.getpid()}, "
                     "no longer running)"]  # fmt: skip


def test_only_what_the_package_made_is_removed(env, capsys):
    """A state file naming someone else's directory or cgroup, or a file other than read_ahead_kb, is left
    as it is (reported, exit 1)."""
    other = env.tmp / "precious"
    other.mkdir()
    sysctl = env.tmp / "swappiness"
    sysctl.write_text("60\n")
    rec = RunRecord("onebit-bench", 1 << 30, None, time.time(), settings={str(sysctl): "10"},
                    cgroups=[str(env.cg_root / "memory" / "system.slice")], temp_dirs=[str(other)])  # fmt: skip
    env.state.mkdir()
    (env.state / "onebit-bench-9.json").write_text(json.dumps(rec.__dict__))
    rc, lines = _restore(capsys)
    assert rc == EXIT_CHECK_FAILED and other.is_dir() and sysctl.read_text() == "60\n"
    assert len(lines) == 3 and all("left as it is" in line for line in lines)


def test_the_emulated_drives_dead_mount_is_unmounted(env, capsys):
    """--drive nvme, the bench and its emulator both killed: the dead FUSE mount is unmounted and its
    directory removed (needs FUSE and libfuse3)."""
    from onebit_predict.drive.emudrive import build, unavailable_reason
    from onebit_predict.llama.mounts import mounted_at

    if (reason := unavailable_reason()) is not None:
        pytest.skip(f"the emulated drive cannot run here: {reason}")
    build()
    argv = ["--memory-limit", "64MiB", "--rounds", "1", "--rows", "patched off", "--drive", "nvme"]
    proc, _ = env.start("cgroup", argv)
    (state,) = env.states()
    (mount,) = state["mounts"]
    mountpoint = Path(mount["mountpoint"])
    assert mounted_at(mountpoint) and running(mount["pid"], mount["start_time"])
    os.kill(mount["pid"], signal.SIGKILL)  # the emulator first: a dead mount stays
    env.kill9(proc)
    assert mounted_at(mountpoint)
    env.as_cgroupfs(env.group(proc.pid))
    rc, lines = _restore(capsys)
    assert rc == EXIT_OK and not mounted_at(mountpoint) and not mountpoint.parent.exists() and env.states() == []
    assert f"onebit-bench: unmounted {mountpoint} (left by onebit-bench pid {proc.pid}, no longer running)" in lines
    assert f"onebit-bench: removed temporary directory {mountpoint.parent} (left by" in "\n".join(lines)


def test_a_real_cgroup_left_by_a_killed_run(env, capsys):
    """The real memory cgroup (root, cgroup v1 or v2 with a memory controller): removed by the next run."""
    try:
        MemoryCgroup("onebit-test-probe", 64 << 20).remove()
    except CgroupError as e:
        pytest.skip(f"no memory cgroup here: {e}")
    proc, _ = env.start("cgroup", cg_root="real")
    (state,) = env.states()
    (group,) = map(Path, state["cgroups"])
    assert group.is_dir() and str(group).startswith(str(ROOT)) and group.name == f"onebit-bench-{proc.pid}"
    env.kill9(proc)
    assert group.is_dir()
    rc, lines = _restore(capsys)
    assert rc == EXIT_OK and not group.exists() and env.states() == []
    assert f"onebit-bench: removed cgroup {group} (left by onebit-bench pid {proc.pid}, no longer running)" in lines


# --- clean exits and interruptions --------------------------------------------------------------


def test_sigint_mid_run_puts_everything_back_and_exits_130(env):
    """Ctrl-C mid-run: read_ahead_kb restored, the temporary directory and the state file removed, one line
    ("interrupted"), exit 130, no traceback."""
    proc, err = env.start("read_ahead_kb")
    (state,) = env.states()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == EXIT_INTERRUPTED
    text = err.read_text()
    assert "Traceback" not in text and text.splitlines()[-1] == "onebit-bench: ERROR: interrupted"
    assert env.ra.read_text() == "4096\n" and env.states() == [] and not any(p.exists() for p in _temp_dirs(state))


def test_a_clean_run_leaves_no_state(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_RUN_STATE, str(tmp_path / "state"))
    with journal("onebit-bench") as state:
        with run_state.temp_dir("onebit-bench-") as tmp:
            assert json.loads(state.path.read_text())["temp_dirs"] == [str(tmp)]
        assert json.loads(state.path.read_text())["temp_dirs"] == []
        leftover = run_state.make_temp_dir("onebit-bench-")  # a clean-up that never ran: the exit does it
    assert not leftover.exists() and not state.path.exists()
    with journal("onebit-bench", tmp_path / "quiet") as state:
        pass
    assert not (tmp_path / "quiet").exists()  # nothing recorded: no file, not even the directory


def test_nothing_is_changed_when_the_state_cannot_be_recorded(tmp_path, monkeypatch):
    """The record comes first: where it cannot be written (exit 2, OSError), the change is not made."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(ENV_RUN_STATE, str(blocker / "state"))  # under a file: never a directory
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with journal("onebit-bench"), pytest.raises(OSError, match="cannot record what this run changes"):
        run_state.make_temp_dir("onebit-bench-")
    assert list((tmp_path / "tmp").iterdir()) == []


# --- the atomic writer's temporary files ------------------------------------------------------


def test_partial_files_of_dead_writers_are_swept(tmp_path):
    """A temporary name holds its writer's pid: a killed writer's file goes, a live one's stays."""
    final = tmp_path / "onebit-bench-1.json"
    mine = temp_name(final)
    assert f".{os.getpid()}-" in mine.name and mine.name.endswith(".partial.json")
    mine.write_text("{")
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = final.with_name(f".onebit-bench-1.{child.stdout.strip()}-0123abcd.partial.json")
    dead.write_text("{")
    other = tmp_path / ".notes.partial.txt"  # not the writer's pattern: not ours
    other.write_text("x")
    assert sweep_partials(tmp_path) == [dead]
    assert mine.exists() and other.exists() and not dead.exists()


def test_recover_sweeps_the_state_directorys_partial_files(env, capsys):
    env.state.mkdir()
    child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = env.state / f".onebit-bench-7.{child.stdout.strip()}-0123abcd.partial.json"
    dead.write_text('{"pid":')
    rc, lines = _restore(capsys)
    assert rc == EXIT_OK and not dead.exists()
    assert lines == [f"onebit-bench: removed {dead} (a state file half written by a run that was killed)"]


def test_a_scratch_file_of_a_killed_run_is_removed(env, capsys):
    """measure_drive's scratch file next to the model (256 MiB): removed when no older than the killed run."""
    old = env.tmp / ".onebit-drive-old"
    old.write_bytes(b"x")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    left = env.tmp / ".onebit-drive-abc123"
    left.write_bytes(b"x" * 4096)
    rec = RunRecord("onebit-bench", 1 << 30, None, time.time() - 60, scratch=[{"dir": str(env.tmp),
                    "prefix": ".onebit-drive-"}])  # fmt: skip
    env.state.mkdir()
    (env.state / "onebit-bench-5.json").write_text(json.dumps(rec.__dict__))
    rc, lines = _restore(capsys)
    assert rc == EXIT_OK and not left.exists() and old.exists()
    assert lines == [f"onebit-bench: removed the scratch file {left} (0 MiB, left by onebit-bench pid {1 << 30}, "
                     "no longer running)"]  # fmt: skip


def test_restore_takes_no_model(capsys, env):
    assert bench_main(["--restore", str(env.model)]) == EXIT_USAGE
    assert "--restore takes no MODEL.gguf" in capsys.readouterr().err
    assert bench_main([]) == EXIT_USAGE
    assert "MODEL.gguf (or --restore)" in capsys.readouterr().err


# --- the real bench, interrupted (needs the build) --------------------------------------------


@pytest.mark.needs_build
def test_the_real_bench_interrupted_mid_run(tmp_path):
    """onebit-bench on the tiny model, SIGINT once its first configuration has run: exit 130, one line,
    no traceback, no state and no temporary directory left."""
    err = tmp_path / "stderr"
    env = {**os.environ, ENV_RUN_STATE: str(tmp_path / "state"), "TMPDIR": str(tmp_path)}
    script = textwrap.dedent("""
        import signal, sys
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from onebit_predict.commands.bench import main
        sys.exit(main(sys.argv[1:]))
    """)
    argv = [str(MODEL), "--rounds", "3", "--generate", "16", "--prompt", "8"]
    with open(err, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", script, *argv], stderr=f, stdout=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 300
    while "round 1/3" not in err.read_text():
        assert proc.poll() is None, err.read_text()
        assert time.monotonic() < deadline, err.read_text()
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=120)
    text = err.read_text()
    assert rc == EXIT_INTERRUPTED and "Traceback" not in text, text
    assert text.splitlines()[-1] == "onebit-bench: ERROR: interrupted"
    assert not list(tmp_path.glob("onebit-bench-*")) and not list((tmp_path / "state").glob("*.json"))
