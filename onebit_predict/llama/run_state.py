"""What a run of onebit-bench changes on the machine, written down before it changes it, so that a run
killed by SIGKILL (no handler runs, no ``finally``) is undone by the next one.

A run opens a journal (:func:`journal`): one JSON file in the state directory (:func:`state_dir`:
``$ONEBIT_RUN_STATE_DIR``, else ``/run/onebit-predict`` as root, else ``$XDG_RUNTIME_DIR/onebit-predict``
or the temp dir's ``onebit-predict-UID``), named by its program and pid, rewritten atomically
(atomic.py) *before* each change, listing:

- ``settings``: each sysfs file it writes (read_ahead_kb) -> the value found before its first write;
- ``cgroups``: the memory cgroups it makes (llama/cgroup.py), listed before the mkdir;
- ``temp_dirs``: its temporary directories (:func:`temp_dir`), listed before the mkdir;
- ``mounts``: the emulated drive's FUSE mounts (drive/emudrive.py), listed before the emulator starts,
  with the emulator's pid once it runs;
- ``scratch``: directories it writes scratch files of a known prefix in (llama/drive.py's
  ``.onebit-drive-*``, 256 MiB next to the model).

Each entry is dropped again once the run has undone it itself, and a clean exit (an exception and
SIGINT, SIGTERM, SIGHUP included: their handlers end in ``finally`` blocks) undoes what is still
listed and removes the file. Only a run that could not clean up leaves one.

:func:`recover` (every ``onebit-bench`` run, before it reads any setting, and ``onebit-bench --restore``)
reads the files of runs that are no longer running (their pid gone, or taken by a process that started
at another time: ``/proc/PID/stat`` field 22) and puts back what they left, newest run first so that
the oldest original is the one written last: each setting written back, each FUSE mount unmounted
(``fusermount3 -u -z``, else ``umount -l``), each cgroup removed (one with live processes is left and
reported, for a later run), each temporary directory removed (never one with a mount inside), each
scratch file of theirs removed; one line on stderr each. What cannot be undone stays in the file.
The atomic writer's temporary files of dead writers in the state directory go too.

Only what a run of this package made can be removed: cgroups and directories whose names start with
``onebit-``, settings in files named ``read_ahead_kb``, state files this user owns.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_text, sweep_partials
from ..constants import ENV_RUN_STATE, RUN_OWNED_PREFIX, RUN_STATE_DIR
from .mounts import force_unmount, mounted_at, unescape

logger = logging.getLogger("onebit_predict")

SETTING_NAMES = ("read_ahead_kb",)  # the only sysfs files a state file may name
EMULATOR_STOP_S = 5.0  # a dead run's emulator still running: SIGTERM, then this long for it to unmount


class RunStateError(OSError):
    """The run's state cannot be recorded (exit 2): nothing is changed that could not be put back."""


def state_dir() -> Path:
    """Where every run keeps its state file (``$ONEBIT_RUN_STATE_DIR`` overrides)."""
    if os.environ.get(ENV_RUN_STATE):
        return Path(os.environ[ENV_RUN_STATE])
    if os.geteuid() == 0:
        return Path(RUN_STATE_DIR)
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "onebit-predict"
    return Path(tempfile.gettempdir()) / f"onebit-predict-{os.getuid()}"


# --- processes ----------------------------------------------------------------------------------


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks after boot, /proc/PID/stat field 22); None: no such
    process, or a zombie (it runs no more code)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the name in parentheses may hold spaces: field 3 on
    return None if fields[0] == "Z" else int(fields[19])


def running(pid: int | None, started: int | None) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs (a pid taken since by a
    process started at another time does not count)."""
    if pid is None:
        return False
    now = start_time(pid)
    return now is not None and (started is None or now == started)


# --- the record ---------------------------------------------------------------------------------


@dataclass
class RunRecord:
    """One run's state file: who it is, and what it changed (the module's docstring)."""

    prog: str
    pid: int
    start_time: int | None  # /proc/PID/stat field 22
    started: float  # wall clock (time.time()): scratch files of the run are no older
    settings: dict[str, str] = field(default_factory=dict)  # sysfs file -> the value found before the run
    cgroups: list[str] = field(default_factory=list)
    temp_dirs: list[str] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)  # {"mountpoint", "pid", "start_time"}
    scratch: list[dict[str, str]] = field(default_factory=list)  # {"dir", "prefix"}

    def empty(self) -> bool:
        return not (self.settings or self.cgroups or self.temp_dirs or self.mounts or self.scratch)

    def who(self) -> str:
        return f"{self.prog} pid {self.pid}"

    @classmethod
    def load(cls, path: Path) -> RunRecord:
        """A state file; ValueError saying why it cannot be read."""
        try:
            doc = json.loads(path.read_text())
            rec = cls(**doc)
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a state file of this package ({e})") from None
        if not isinstance(rec.pid, int) or not isinstance(rec.settings, dict):
            raise ValueError(f"{path}: not a state file of this package")
        return rec


class RunState:
    """The journal of the running process: each change recorded before it is made, forgotten once undone."""

    def __init__(self, prog: str, directory: Path | None = None) -> None:
        self.directory = state_dir() if directory is None else Path(directory)
        pid = os.getpid()
        self.record = RunRecord(prog, pid, start_time(pid), time.time())
        self.path = self.directory / f"{prog}-{pid}-{secrets.token_hex(2)}.json"  # a run in-process again: its own
        self._written = False

    def _save(self, strict: bool = True) -> None:
        """Write the record (``strict``: RunStateError where it cannot be; otherwise, as after an undo, the
        file keeps an entry of something already gone, which a later run finds gone)."""
        if self.record.empty() and not self._written:
            return
        try:
            self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(asdict(self.record), indent=1) + "\n")
        except OSError as e:
            if not strict:
                return
            raise RunStateError(
                e.errno, f"cannot record what this run changes ({e.strerror}), so it changes nothing", str(self.path)
            ) from None
        self._written = True

    # each ``note`` before the change, each ``forget`` once the run has undone it

    def note_setting(self, file: str | Path, original: str) -> None:
        """``file`` is about to be written; ``original`` is what it held before this run (the first one kept)."""
        if str(file) not in self.record.settings:
            self.record.settings[str(file)] = original
            self._save()

    def forget_setting(self, file: str | Path) -> None:
        if self.record.settings.pop(str(file), None) is not None:
            self._save(strict=False)

    def note(self, kind: str, value: Any) -> None:
        """``kind`` (cgroups, temp_dirs, mounts, scratch) gets ``value`` (a path, or the entry's dict)."""
        items = getattr(self.record, kind)
        value = str(value) if isinstance(value, Path) else value
        if value not in items:
            items.append(value)
            self._save()

    def forget(self, kind: str, value: Any) -> None:
        items = getattr(self.record, kind)
        value = str(value) if isinstance(value, Path) else value
        if value in items:
            items.remove(value)
            self._save(strict=False)

    def note_mount(self, mountpoint: Path, pid: int | None = None) -> None:
        """The emulator is about to mount at ``mountpoint`` (``pid``: it runs, as this pid)."""
        entry = {"mountpoint": str(mountpoint), "pid": pid, "start_time": None if pid is None else start_time(pid)}
        self.record.mounts = [m for m in self.record.mounts if m["mountpoint"] != str(mountpoint)] + [entry]
        self._save()

    def forget_mount(self, mountpoint: Path) -> None:
        before = len(self.record.mounts)
        self.record.mounts = [m for m in self.record.mounts if m["mountpoint"] != str(mountpoint)]
        if len(self.record.mounts) != before:
            self._save(strict=False)

    def close(self) -> bool:
        """A clean exit: undo what is still listed (a clean-up that failed) and remove the file; False where
        something is left (the file is kept for a later run)."""
        if not self._written:
            return True
        try:
            left = undo(self.record, "this run")
        except Exception as e:  # noqa: BLE001 - on the way out of an error: never mask it; the file stays
            logger.warning("%s: could not undo what is left (%s): the next onebit-bench run tries again", self.path, e)
            return False
        if self.record.empty():
            self.path.unlink(missing_ok=True)
            return True
        self._save(strict=False)
        logger.warning(
            "%s keeps the %d thing(s) this run could not undo: the next onebit-bench run, or onebit-bench "
            "--restore, tries again",
            self.path,
            len(left),
        )
        return False


_ACTIVE: list[RunState] = []


def active() -> RunState | None:
    """The journal of the command running in this process (None: nothing records, as in most tests)."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextmanager
def journal(prog: str, directory: Path | None = None) -> Iterator[RunState]:
    """Record what the body changes (:class:`RunState`); on exit, undo what is left and remove the file."""
    state = RunState(prog, directory)
    _ACTIVE.append(state)
    try:
        yield state
    finally:
        _ACTIVE.remove(state)
        state.close()


# --- what the components call -------------------------------------------------------------------


def note_setting(file: str | Path, original: str) -> None:
    if (s := active()) is not None:
        s.note_setting(file, original)


def forget_setting(file: str | Path) -> None:
    if (s := active()) is not None:
        s.forget_setting(file)


def note(kind: str, value: Any) -> None:
    if (s := active()) is not None:
        s.note(kind, value)


def forget(kind: str, value: Any) -> None:
    if (s := active()) is not None:
        s.forget(kind, value)


def note_mount(mountpoint: Path, pid: int | None = None) -> None:
    if (s := active()) is not None:
        s.note_mount(mountpoint, pid)


def forget_mount(mountpoint: Path) -> None:
    if (s := active()) is not None:
        s.forget_mount(mountpoint)


def recorded() -> bool:
    """Whether a journal records this process's changes (a later run undoes them after a SIGKILL)."""
    return active() is not None


def make_temp_dir(prefix: str, base: Path | None = None) -> Path:
    """A fresh directory in ``base``, else the temp dir (mode 0700), recorded before it is made."""
    while True:
        path = Path(base or tempfile.gettempdir()) / f"{prefix}{secrets.token_hex(4)}"
        note("temp_dirs", path)
        try:
            path.mkdir(mode=0o700)
            return path
        except FileExistsError:
            forget("temp_dirs", path)


def remove_temp_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    if not path.exists():
        forget("temp_dirs", path)


@contextmanager
def temp_dir(prefix: str, base: Path | None = None) -> Iterator[Path]:
    """``tempfile.TemporaryDirectory`` (in ``base`` where given) that a later run removes if this one is killed."""
    path = make_temp_dir(prefix, base)
    try:
        yield path
    finally:
        remove_temp_dir(path)


@contextmanager
def scratch(directory: Path, prefix: str) -> Iterator[None]:
    """The body writes scratch files named ``prefix*`` in ``directory`` (and removes them itself): a later
    run removes those this one leaves, the ones no older than its start."""
    entry = {"dir": str(directory), "prefix": prefix}
    note("scratch", entry)
    try:
        yield
    finally:
        forget("scratch", entry)


# --- undoing a record ---------------------------------------------------------------------------


def undo(rec: RunRecord, whose: str, live_scratch: set[tuple[str, str]] = frozenset()) -> list[str]:
    """Put back what ``rec`` lists, each thing done logged (one line), dropped from ``rec``; returns what is
    left, each with why. ``whose``: the words after "left by" ("onebit-bench pid 12, no longer running")."""
    left: list[str] = []
    left += _undo_mounts(rec, whose)
    left += _undo_settings(rec, whose)
    left += _undo_cgroups(rec, whose)
    left += _undo_temp_dirs(rec, whose)
    left += _undo_scratch(rec, whose, live_scratch)
    for line in left:
        logger.warning("%s", line)
    return left


def _undo_settings(rec: RunRecord, whose: str) -> list[str]:
    left = []
    for file, original in list(rec.settings.items()):
        path = Path(file)
        if path.name not in SETTING_NAMES:
            left.append(f"{file}: not a setting this package writes; left as it is")
            continue
        try:
            now = path.read_text().strip()
        except FileNotFoundError:  # the device (a mount's bdi) is gone, and its setting with it
            del rec.settings[file]
            continue
        except OSError as e:
            left.append(f"cannot read {file} ({e.strerror}) to restore it to {original} (left by {whose})")
            continue
        if now != original:
            try:
                path.write_text(f"{original}\n")
                back = path.read_text().strip()
            except OSError as e:
                root = "" if os.geteuid() == 0 else "; it needs root"
                left.append(f"cannot restore {file} to {original} (left at {now} by {whose}): {e.strerror}{root}")
                continue
            if back != original:
                left.append(f"{file} reads {back} after {original} was written to it (left at {now} by {whose})")
                continue
            logger.info("restored %s to %s (left at %s by %s)", file, original, now, whose)
        del rec.settings[file]
    return left


def _cgroup_pids(path: Path) -> list[int]:
    """The live processes in a cgroup (cgroup.procs)."""
    try:
        text = (path / "cgroup.procs").read_text()
    except OSError:
        return []
    return [int(w) for w in text.split() if w.isdigit() and start_time(int(w)) is not None]


def _undo_cgroups(rec: RunRecord, whose: str) -> list[str]:
    left = []
    for group in list(rec.cgroups):
        path = Path(group)
        if not path.name.startswith(RUN_OWNED_PREFIX):
            left.append(f"{group}: not a cgroup this package makes; left as it is")
            continue
        if not path.is_dir():
            rec.cgroups.remove(group)
            continue
        pids = _cgroup_pids(path)
        if pids:
            left.append(
                f"left cgroup {group} (made by {whose}): {len(pids)} process(es) still in it "
                f"(pid {', '.join(map(str, pids))}); onebit-bench --restore removes it once they have exited"
            )
            continue
        try:
            path.rmdir()
        except FileNotFoundError:
            pass
        except OSError as e:
            left.append(f"cannot remove cgroup {group} (left by {whose}): {e.strerror}")
            continue
        rec.cgroups.remove(group)
        logger.info("removed cgroup %s (left by %s)", group, whose)
    return left


def _undo_mounts(rec: RunRecord, whose: str) -> list[str]:

    left = []
    for entry in list(rec.mounts):
        mountpoint = Path(entry["mountpoint"])
        pid = entry.get("pid")
        if running(pid, entry.get("start_time")):  # its emulator outlived the run: SIGTERM unmounts
            with _suppress_lookup():
                os.kill(pid, signal.SIGTERM)
            deadline = time.monotonic() + EMULATOR_STOP_S
            while running(pid, entry.get("start_time")) and time.monotonic() < deadline:
                time.sleep(0.05)
            logger.info("stopped the emulator pid %d of %s (left by %s)", pid, mountpoint, whose)
        if mounted_at(mountpoint):
            force_unmount(mountpoint)
            if mounted_at(mountpoint):
                left.append(f"cannot unmount {mountpoint} (left by {whose}): umount -l {mountpoint}")
                continue
            logger.info("unmounted %s (left by %s)", mountpoint, whose)
        rec.mounts.remove(entry)
    return left


@contextmanager
def _suppress_lookup() -> Iterator[None]:
    try:
        yield
    except ProcessLookupError:
        pass


def _mounts_under(path: Path) -> list[str]:
    """Mount points at or under ``path`` (/proc/self/mountinfo)."""

    root = os.path.realpath(path)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    points = (unescape(line.split()[4]) for line in lines if len(line.split()) > 4)
    return [p for p in points if p == root or p.startswith(root + os.sep)]


def _undo_temp_dirs(rec: RunRecord, whose: str) -> list[str]:
    left = []
    for d in list(rec.temp_dirs):
        path = Path(d)
        if not path.name.startswith(RUN_OWNED_PREFIX) or path.is_symlink():
            left.append(f"{d}: not a temporary directory this package makes; left as it is")
            continue
        if not path.exists():
            rec.temp_dirs.remove(d)
            continue
        if mounts := _mounts_under(path):
            left.append(f"left {d} (made by {whose}): {mounts[0]} is mounted in it")
            continue
        try:
            shutil.rmtree(path)
        except OSError as e:
            left.append(f"cannot remove {d} (left by {whose}): {e.filename}: {e.strerror or e}")
            continue
        rec.temp_dirs.remove(d)
        logger.info("removed temporary directory %s (left by %s)", d, whose)
    return left


def _undo_scratch(rec: RunRecord, whose: str, live: set[tuple[str, str]]) -> list[str]:
    left = []
    for entry in list(rec.scratch):
        directory, prefix = entry["dir"], entry["prefix"]
        if (directory, prefix) in live:  # a live run writes the same files there: whose is whose cannot be told
            continue
        failed = False
        try:
            names = (
                [n for n in os.listdir(directory) if n.startswith(prefix)]
                if prefix.startswith("." + RUN_OWNED_PREFIX)
                else []
            )
        except OSError:
            names = []
        for name in names:
            path = Path(directory) / name
            try:
                st = path.lstat()
                if st.st_mtime < rec.started - 1:  # older than the run: not its own
                    continue
                path.unlink()
            except FileNotFoundError:
                continue
            except OSError as e:
                left.append(f"cannot remove the scratch file {path} (left by {whose}): {e.strerror}")
                failed = True
                continue
            logger.info("removed the scratch file %s (%.0f MiB, left by %s)", path, st.st_size / 2**20, whose)
        if not failed:
            rec.scratch.remove(entry)
    return left


# --- recovering the runs that were killed -------------------------------------------------------


def recover(directory: Path | None = None) -> list[str]:
    """Put back what every run no longer running left (the module's docstring), newest run first; returns
    what could not be put back (each logged). The state files of runs still running are left alone."""
    directory = state_dir() if directory is None else Path(directory)
    if not directory.is_dir():
        return []
    mine = {s.path for s in _ACTIVE}
    dead: list[tuple[Path, RunRecord]] = []
    live_scratch: set[tuple[str, str]] = set()
    left: list[str] = []
    for path in sorted(directory.glob("*.json")):
        if path in mine or path.name.startswith("."):  # a temporary name of the atomic writer: swept below
            continue
        try:
            if path.stat().st_uid != os.geteuid():
                continue  # another user's run: theirs to restore
            rec = RunRecord.load(path)
        except FileNotFoundError:
            continue  # its run ended meanwhile
        except ValueError as e:
            left.append(f"{e}; left as it is")
            logger.warning("%s; left as it is", e)
            continue
        if running(rec.pid, rec.start_time):
            live_scratch |= {(s["dir"], s["prefix"]) for s in rec.scratch}
            continue
        dead.append((path, rec))
    for path, rec in sorted(dead, key=lambda d: d[1].started, reverse=True):
        rest = undo(rec, f"{rec.who()}, no longer running", live_scratch)
        left += rest
        try:
            if rec.empty():
                path.unlink(missing_ok=True)
            else:
                atomic_write_text(path, json.dumps(asdict(rec), indent=1) + "\n")
        except OSError as e:
            left.append(f"cannot update {path}: {e.strerror}")
            logger.warning("cannot update %s: %s", path, e.strerror)
    for partial in sweep_partials(directory):
        logger.info("removed %s (a state file half written by a run that was killed)", partial)
    return left
