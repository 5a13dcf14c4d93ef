"""The drive a model lives on, and its readahead, as a variable of a measurement.

Every ``onebit-bench --memory-limit`` report records the block device holding the model file
(:func:`block_device`: the file's ``st_dev`` resolved through ``/sys/dev/block/MAJ:MIN``, the
whole disk where that is a partition: its name, model and vendor where the kernel exposes them,
whether it says it is rotational) and that device's ``queue/read_ahead_kb``, which decides how
much a major fault on the model's mapping reads (llama.cpp's ``POSIX_FADV_SEQUENTIAL`` doubles
it). A filesystem without a block device of its own (FUSE, the emulated drive) has its readahead
in ``/sys/class/bdi/MAJ:MIN/read_ahead_kb``: that is recorded instead.

``--read-ahead-kb 128,8192`` sets the value for each run (:class:`ReadAhead`) and restores the
one it found on every exit path: the end of the run, an exception, SIGINT, SIGTERM and SIGHUP
(handlers that restore, then hand the signal on: KeyboardInterrupt, or exit 128 + the signal).
SIGKILL runs no handler and leaves it set, but the value found is in the run's state file
(llama/run_state.py) before the first write: the next ``onebit-bench`` run writes it back before
it reads the device's value (so it never takes the killed run's value for the original), and so
does ``onebit-bench --restore``. Both the value set and the value restored are logged. Where the
file cannot be written (not root, no such file) :class:`ReadAheadError` (exit 2) says why, before
anything runs (:meth:`ReadAhead.probe`). A value is KiB, a whole number of pages, at most
:data:`READ_AHEAD_KB_MAX` (:func:`read_ahead_value`, at parse time: exit 2).

Everything takes the sysfs root (``sys_root``) or the file itself as a parameter, so that the
tests point it at a temporary tree and never touch a real device.
"""

from __future__ import annotations

import logging
import mmap
import os
import signal
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from ..constants import READ_AHEAD_KB_MAX
from . import run_state

logger = logging.getLogger("onebit_predict")

SYS = Path("/sys")
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
KB_STEP = max(1, mmap.PAGESIZE // 1024)  # the kernel keeps read_ahead_kb in pages


class ReadAheadError(ValueError):
    """The model's device or its read_ahead_kb cannot be found, read or written (exit 2: why)."""


@dataclass(frozen=True)
class BlockDevice:
    """The device holding a file, as a report records it."""

    name: str  # the whole disk (vda, nvme0n1, sda), or "bdi MAJ:MIN" for a filesystem without one
    major_minor: str  # the file's st_dev (a partition's own where it is on one)
    partition: str | None  # sda1: the file is on this partition of ``name``
    model: str | None  # the device's model string, where the kernel exposes one
    vendor: str | None
    rotational: bool | None  # queue/rotational (virtio disks say 1 whatever backs them)
    read_ahead_kb: int  # as found
    read_ahead_file: str  # the sysfs file it was read from (and is set through)

    def fields(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self, read_ahead: bool = True) -> str:
        """``vda (254:0, vendor 0x1af4, rotational), read_ahead_kb 8192`` (without its last part)."""
        what = [self.major_minor]
        if self.partition:
            what.append(f"partition {self.partition}")
        what += [f"{k} {v}" for k, v in (("model", self.model), ("vendor", self.vendor)) if v]
        if self.rotational is not None:
            what.append("rotational" if self.rotational else "non-rotational")
        head = f"{self.name} ({', '.join(what)})"
        return f"{head}, read_ahead_kb {self.read_ahead_kb}" if read_ahead else head


def _text(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def read_kb(file: Path) -> int:
    """The value of a read_ahead_kb file; ReadAheadError saying why it cannot be read."""
    try:
        return int(Path(file).read_text().strip())
    except FileNotFoundError:
        raise ReadAheadError(f"{file}: no such file") from None
    except (OSError, ValueError) as e:
        raise ReadAheadError(f"cannot read {file}: {e}") from None


def block_device(path: str | Path, sys_root: Path | None = None) -> BlockDevice:
    """The device holding ``path`` (sysfs under ``sys_root``, default :data:`SYS`); ReadAheadError
    where none is found."""
    sys_root = SYS if sys_root is None else sys_root
    try:
        dev = os.stat(path).st_dev
    except OSError as e:
        raise ReadAheadError(f"cannot stat {path}: {e.strerror}") from None
    mm = f"{os.major(dev)}:{os.minor(dev)}"
    link = sys_root / "dev" / "block" / mm
    if not link.exists():
        bdi = sys_root / "class" / "bdi" / mm / "read_ahead_kb"
        if bdi.is_file():  # FUSE and other filesystems with a backing device of their own, no block device
            return BlockDevice(f"bdi {mm}", mm, None, None, None, None, read_kb(bdi), str(bdi))
        raise ReadAheadError(f"{path} is on device {mm}, which has neither {link} nor {bdi} (no block device)")
    disk = link.resolve()
    partition = None
    if (disk / "partition").is_file():  # a partition shares its disk's queue
        partition, disk = disk.name, disk.parent
    file = sys_root / "block" / disk.name / "queue" / "read_ahead_kb"
    if not file.is_file():
        file = disk / "queue" / "read_ahead_kb"
    rotational = _text(disk / "queue" / "rotational")
    return BlockDevice(
        disk.name,
        mm,
        partition,
        _text(disk / "device" / "model"),
        _text(disk / "device" / "vendor"),
        None if rotational is None else rotational == "1",
        read_kb(file),
        str(file),
    )


def read_ahead_value(text: str) -> int:
    """One ``--read-ahead-kb`` value: KiB, 0..READ_AHEAD_KB_MAX, a whole number of pages (the kernel
    keeps pages, and reads back a value rounded down to them)."""
    try:
        kb = int(text)
    except ValueError:
        raise ValueError(f"'{text}' is not a whole number of KiB") from None
    if not 0 <= kb <= READ_AHEAD_KB_MAX or kb % KB_STEP:
        raise ValueError(
            f"{kb} KiB: read_ahead_kb is 0..{READ_AHEAD_KB_MAX} (1 GiB) and a multiple of {KB_STEP} (a page)"
        )
    return kb


class ReadAhead:
    """A read_ahead_kb file, set run by run (:meth:`set`) and restored to the value found on entry
    on every exit path (``with ReadAhead(file) as ra``); the value found is recorded in the run's state
    file on entry (``recorded``; False for a file that goes with a mount: the emulated drive's bdi,
    whose number a later mount may take)."""

    def __init__(
        self, file: str | Path, what: str | None = None, signals: Sequence[int] = SIGNALS, recorded: bool = True
    ) -> None:
        self.file = Path(file)
        self.what = what or str(self.file)
        self.signals = tuple(signals)
        self.recorded = recorded
        self.original: int | None = None
        self.current: int | None = None
        self._previous: dict[int, Any] = {}
        self._restored = True
        self._hinted = False

    def probe(self) -> int:
        """The value now, written back unchanged: ReadAheadError (exit 2) where the file cannot be
        written (not root, no such file), before anything runs."""
        kb = read_kb(self.file)
        self._write(kb)
        return kb

    def _write(self, kb: int) -> None:
        try:
            with open(self.file, "w") as f:
                f.write(f"{kb}\n")
        except OSError as e:
            root = "" if os.geteuid() == 0 else "; setting read_ahead_kb needs root"
            raise ReadAheadError(f"cannot write {kb} to {self.file} ({self.what}): {e.strerror or e}{root}") from None

    def __enter__(self) -> ReadAhead:
        self.original = self.current = self.probe()
        if self.recorded:  # before any write of another value: a kill -9 leaves it set, the next run puts it back
            run_state.note_setting(self.file, str(self.original))
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                previous = signal.getsignal(sig)
                if previous is not signal.SIG_IGN:  # an ignored signal stays ignored
                    self._previous[sig] = previous
                    signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.restore()
            if self.recorded:
                run_state.forget_setting(self.file)
        finally:
            self._uninstall()

    def set(self, kb: int) -> None:
        """Set the value for the next run (logged with the value found on entry)."""
        if self.original is None:
            raise RuntimeError("ReadAhead.set outside its with block")
        self._restored = False  # the exit logs the value restored, even where every run kept the one found
        if kb == self.current:
            return
        self._write(kb)
        now = read_kb(self.file)
        self.current = now
        if now != kb:
            raise ReadAheadError(f"{self.file} reads {now} after {kb} was written to it")
        if self._hinted:
            hint = ""
        elif self.recorded and run_state.recorded():
            hint = f" (found {self.original}; recorded: after a kill -9, the next onebit-bench run puts it back)"
        else:
            hint = f" (found {self.original}; if this process is killed: echo {self.original} > {self.file})"
        self._hinted = True
        logger.info("read_ahead_kb of %s set to %d%s", self.what, kb, hint)

    def restore(self) -> None:
        """Write back the value found on entry, where it differs now (logged once after a :meth:`set`)."""
        if self.original is None or self._restored:
            return
        if read_kb(self.file) != self.original:
            self._write(self.original)
        self.current = read_kb(self.file)
        self._restored = True
        logger.info("read_ahead_kb of %s restored to %d", self.what, self.current)

    def _uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Restore, then hand the signal on: the handler that was there (SIGINT's raises
        KeyboardInterrupt), else exit 128 + signum (finally blocks run: cgroups removed, workers killed)."""
        previous = self._previous.get(signum)
        logger.info("%s received: restoring read_ahead_kb of %s", signal.Signals(signum).name, self.what)
        try:
            self.restore()
        finally:
            self._uninstall()
        if callable(previous):
            previous(signum, frame)
            return
        raise SystemExit(128 + signum)


@dataclass(frozen=True)
class DriveSetting:
    """The drive of one ``--memory-limit`` run: the model's device (None: on none, not recorded) and the
    read_ahead_kb values every configuration runs at (None: not set, the device's as found)."""

    device: BlockDevice | None
    read_ahead_kb: tuple[int, ...] | None = None

    @classmethod
    def of(cls, model: Path, read_ahead_kb: Sequence[int] | None = None) -> DriveSetting:
        """The device under ``model``, logged; with values to set, its read_ahead_kb proven writable
        (ReadAheadError, exit 2, otherwise: before anything runs)."""
        values = tuple(read_ahead_kb) if read_ahead_kb else None
        try:
            device = block_device(model)
        except ReadAheadError as e:
            if values:
                raise ReadAheadError(f"--read-ahead-kb: {e}") from None
            logger.warning("the model's drive is not recorded: %s", e)
            return cls(None)
        logger.info("model on %s (%s)", device.describe(), device.read_ahead_file)
        if values:
            ReadAhead(device.read_ahead_file, device.name).probe()
        return cls(device, values)

    @contextmanager
    def applied(self) -> Iterator[ReadAhead | None]:
        """The :class:`ReadAhead` each run sets its value through, restored on every exit path (None:
        nothing to set)."""
        if not self.read_ahead_kb or self.device is None:
            yield None
            return
        with ReadAhead(self.device.read_ahead_file, self.device.name) as ra:
            yield ra

    def in_force(self) -> int | None:
        """The read_ahead_kb every row ran at (None: several, each row's ``config`` has its own, or unknown)."""
        if self.read_ahead_kb:
            return self.read_ahead_kb[0] if len(self.read_ahead_kb) == 1 else None
        return None if self.device is None else self.device.read_ahead_kb

    def report(self, figures: dict[str, Any]) -> dict[str, Any]:
        """The report's fields: ``drive`` (the measured figures, and ``read_ahead_kb`` where one value was in
        force for every row), ``device`` (:class:`BlockDevice`, its read_ahead_kb as found) and
        ``read_ahead_kb`` (the values set, one run of every configuration each; None: not set)."""
        drive = dict(figures)
        if self.in_force() is not None:
            drive["read_ahead_kb"] = self.in_force()
        device = None if self.device is None else self.device.fields()
        return {
            "drive": drive,
            "device": device,
            "read_ahead_kb": None if self.read_ahead_kb is None else list(self.read_ahead_kb),
        }

    def text(self) -> str:
        """The table header's words: ``drive vda (254:0, ...), read_ahead_kb 8192`` or, with values set,
        ``..., read_ahead_kb 128 and 8192 (found 8192, restored after)``: each row's name says its own."""
        if self.device is None:
            return "drive not recorded (no block device under the model)"
        if not self.read_ahead_kb:
            return f"drive {self.device.describe()}"
        values = " and ".join(str(v) for v in self.read_ahead_kb)
        found = self.device.read_ahead_kb
        return f"drive {self.device.describe(read_ahead=False)}, read_ahead_kb {values} (found {found}, restored after)"
