"""Build, mount and stop the emulated drive (onebit-emudrive.c, a FUSE file system in C).

``mounted(model, profile, read_ahead_kb)`` serves one file (a GGUF model) from the emulator's own
memory through a device model (:mod:`onebit_predict.drive.profiles`) and yields a :class:`Mount`
whose ``path`` is the file inside the mount::

    with mounted(Path("model.gguf"), NVME, read_ahead_kb=128) as m:
        run_llama(m.path)          # mmap, faults, readahead, eviction: all the kernel's own
        print(m.stats())           # requests and bytes served so far, the emulator's CPU time
    print(m.stats())               # the final line, written when it unmounted

The emulator is a child process started before any cgroup move of the caller, so the file's bytes
(anonymous memory of the child) stay outside a memory cgroup the caller later enters; only the
page cache of the mount is charged there, as for a file on a disk. The binary is built on first use
into ``$ONEBIT_CACHE/emudrive/<sha256 of the source>/onebit-emudrive`` with the system's ``cc``
and libfuse3 (Debian: ``apt-get install libfuse3-dev fuse3 pkg-config gcc``).

The mount's directory (``onebit-emudrive-*`` in the temp dir) and the mount itself are listed in the
run's state file (llama/run_state.py) before they are made: after a ``kill -9`` of the process that
mounted it (the emulator, started with ``--die-with-parent``, unmounts on its own; one killed too
leaves a dead mount) the next ``onebit-bench`` run unmounts what is left and removes the directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..constants import CACHE_DIR_DEFAULT, ENV_CACHE
from ..llama import run_state
from ..llama.mounts import force_unmount, mounted_at
from .profiles import MAX_READ_LIMIT, DriveProfile

SOURCE = Path(__file__).resolve().with_name("onebit-emudrive.c")
BINARY_NAME = "onebit-emudrive"
INSTALL_HINT = "apt-get install libfuse3-dev fuse3 pkg-config gcc (Debian/Ubuntu)"
FUSE_DEVICE = Path("/dev/fuse")
STOP_TIMEOUT_S = 15.0  # SIGTERM, then SIGKILL and a lazy unmount
_SIGNALS = {s.value for s in signal.Signals}


class EmuDriveError(RuntimeError):
    """The emulated drive failed: it would not build, mount, answer or stop."""


class EmuDriveUnavailable(EmuDriveError):
    """This machine cannot run the emulated drive: no C compiler, no libfuse3, no usable /dev/fuse."""


# --- records ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DriveStats:
    """One stats line of the emulator (a snapshot on SIGUSR1, the final one when it unmounted)."""

    seq: int
    final: bool
    requests: int
    bytes: int
    user_s: float  # getrusage of the emulator, loading the file included
    sys_s: float
    serve_user_s: float  # ... since the mount came up
    serve_sys_s: float
    wall_s: float  # since the mount came up
    max_inflight: int  # requests received and not yet done in the device, the most at once
    window_max_inflight: int  # ... since the previous stats line (snapshot)
    queued: int  # requests that waited for a free channel
    queue_wait_s: float
    max_request: int  # bytes
    residence_s: float  # every request's arrival to its transfer's end in the device's schedule, summed
    busy_s: float  # the time at least one request was in the device (the union of those intervals)
    latency_us: float
    bandwidth: float
    channels: int
    max_read: int
    file_bytes: int

    @classmethod
    def parse(cls, line: str) -> DriveStats:
        words = line.split()
        if not words or words[0] != BINARY_NAME:
            raise EmuDriveError(f"not a stats line of {BINARY_NAME}: {line!r}")
        kv = dict(w.split("=", 1) for w in words[1:] if "=" in w)
        convert = {"bool": lambda v: bool(int(v)), "int": int, "float": float}
        try:
            return cls(**{name: convert[str(f.type)](kv[name]) for name, f in cls.__dataclass_fields__.items()})
        except (KeyError, ValueError) as e:
            raise EmuDriveError(f"malformed stats line of {BINARY_NAME} ({e}): {line!r}") from e

    @property
    def serve_cpu_s(self) -> float:
        """The emulator's CPU seconds (user + system) since the mount came up."""
        return self.serve_user_s + self.serve_sys_s

    def minus(self, before: DriveStats) -> DriveStats:
        """The counters between two snapshots (maxima and configuration: this one's; its
        ``window_max_inflight`` covers the interval when ``before`` was the previous snapshot)."""
        return DriveStats(
            seq=self.seq,
            final=self.final,
            requests=self.requests - before.requests,
            bytes=self.bytes - before.bytes,
            user_s=self.user_s - before.user_s,
            sys_s=self.sys_s - before.sys_s,
            serve_user_s=self.serve_user_s - before.serve_user_s,
            serve_sys_s=self.serve_sys_s - before.serve_sys_s,
            wall_s=self.wall_s - before.wall_s,
            max_inflight=self.max_inflight,
            window_max_inflight=self.window_max_inflight,
            queued=self.queued - before.queued,
            queue_wait_s=self.queue_wait_s - before.queue_wait_s,
            max_request=self.max_request,
            residence_s=self.residence_s - before.residence_s,
            busy_s=self.busy_s - before.busy_s,
            latency_us=self.latency_us,
            bandwidth=self.bandwidth,
            channels=self.channels,
            max_read=self.max_read,
            file_bytes=self.file_bytes,
        )


@dataclass(frozen=True)
class Mount:
    """A mounted emulated drive. ``path``: the model inside the mount."""

    path: Path
    mountpoint: Path
    profile: DriveProfile
    max_read: int  # FUSE's largest read request, bytes
    read_ahead_kb: int  # the mount's bdi read_ahead_kb in effect
    read_ahead_kb_initial: int  # ... as the kernel set it at mount time
    bdi: Path  # /sys/class/bdi/<major:minor>
    pid: int  # the emulator's
    cgroup: str  # the emulator's /proc/<pid>/cgroup, one line per hierarchy joined with ';'
    binary: Path
    stats_path: Path
    _proc: subprocess.Popen = field(repr=False, compare=False)
    _final: list = field(default_factory=list, repr=False, compare=False)

    def down(self) -> str | None:
        """Why the drive no longer serves its file (the emulator exited, the mount is gone), or None."""
        rc = self._proc.poll()
        if rc is not None:
            how = f"killed by {signal.Signals(-rc).name}" if rc < 0 and -rc in _SIGNALS else f"exit {rc}"
            return f"{BINARY_NAME} (pid {self.pid}) is no longer running ({how})"
        if not mounted_at(self.mountpoint):
            return f"{self.mountpoint} is no longer mounted"
        return None

    def stats(self, timeout_s: float = 5.0) -> DriveStats:
        """A snapshot of the emulator's counters (SIGUSR1) while mounted; its final line after."""
        if self._final:
            return self._final[0]
        if self._proc.poll() is not None:
            raise EmuDriveError(f"{BINARY_NAME} (pid {self.pid}) is no longer running (exit {self._proc.returncode})")
        return snapshot(self.pid, self.stats_path, timeout_s)


def snapshot(pid: int, stats_path: Path, timeout_s: float = 5.0) -> DriveStats:
    """A snapshot of a running emulator's counters: SIGUSR1 to ``pid``, then its next line in
    ``stats_path`` (``Mount.stats``; also from another process, such as a benchmark's worker timing
    its decode alone, given the mount's ``pid`` and ``stats_path``). Not for two callers at once."""
    stats_path = Path(stats_path)
    before = _read_stats(stats_path)
    seq = before.seq if before else 0
    try:
        os.kill(pid, signal.SIGUSR1)
    except ProcessLookupError:
        raise EmuDriveError(f"{BINARY_NAME} (pid {pid}) is no longer running") from None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = _read_stats(stats_path)
        if now is not None and now.seq > seq:
            return now
        time.sleep(0.002)
    raise EmuDriveError(f"{BINARY_NAME} (pid {pid}) wrote no stats within {timeout_s} s of SIGUSR1")


def _read_stats(path: Path) -> DriveStats | None:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return DriveStats.parse(lines[-1]) if lines else None


# --- build --------------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$ONEBIT_CACHE``, else ``~/.cache/onebit-predict``."""
    return Path(os.environ.get(ENV_CACHE) or Path.home() / CACHE_DIR_DEFAULT)


def _fuse3_flags() -> tuple[list[str], list[str], str]:
    """``(cflags, libs, version)`` of libfuse3 from pkg-config; EmuDriveUnavailable without it."""
    pkg = shutil.which("pkg-config")
    if pkg is None:
        raise EmuDriveUnavailable(f"{BINARY_NAME} needs pkg-config and libfuse3's headers: {INSTALL_HINT}")
    out = []
    for what in ("--cflags", "--libs", "--modversion"):
        r = subprocess.run([pkg, what, "fuse3"], capture_output=True, text=True)
        if r.returncode != 0:
            why = (r.stderr.strip().splitlines() or ["not found"])[0]  # pkg-config's first line says it
            raise EmuDriveUnavailable(
                f"{BINARY_NAME} needs libfuse3's headers (pkg-config fuse3: {why}): {INSTALL_HINT}"
            )
        out.append(r.stdout.strip())
    return out[0].split(), out[1].split(), out[2]


def _fuse_use_version(version: str) -> int:
    """The FUSE_USE_VERSION to build with: 312 (the thread-limit API) from libfuse 3.12 on, else 35."""
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return 35
    if (major, minor) < (3, 2):
        raise EmuDriveUnavailable(f"{BINARY_NAME} needs libfuse >= 3.2, found {version}: {INSTALL_HINT}")
    return 312 if (major, minor) >= (3, 12) else 35


def build(source: Path = SOURCE) -> Path:
    """The emulator's binary, compiled on first use into the cache (atomic rename: a concurrent
    build sees all or nothing). EmuDriveUnavailable without a compiler or libfuse3,
    EmuDriveError with the compiler's message if it fails."""
    text = source.read_bytes()
    out = cache_root() / "emudrive" / hashlib.sha256(text).hexdigest() / BINARY_NAME
    if out.is_file() and os.access(out, os.X_OK):
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise EmuDriveUnavailable(f"{BINARY_NAME} needs a C compiler (cc): {INSTALL_HINT}")
    cflags, libs, version = _fuse3_flags()
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{BINARY_NAME}.")
    os.close(fd)
    cmd = [
        cc,
        "-O2",
        "-std=gnu11",
        "-Wall",
        f"-DFUSE_USE_VERSION={_fuse_use_version(version)}",
        *cflags,
        "-o",
        tmp,
        str(source),
        *libs,
        "-lm",
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise EmuDriveError(f"could not compile {source.name} ({' '.join(cmd)}):\n{r.stderr.strip()}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return out


def unavailable_reason() -> str | None:
    """Why the emulated drive cannot run here (no usable /dev/fuse, no compiler, no libfuse3), or None."""
    if not FUSE_DEVICE.exists():
        return f"{FUSE_DEVICE} is missing (no FUSE in this kernel or container)"
    try:
        os.close(os.open(FUSE_DEVICE, os.O_RDWR))
    except OSError as e:
        return f"{FUSE_DEVICE} cannot be opened ({e.strerror})"
    if os.geteuid() != 0 and shutil.which("fusermount3") is None:
        return f"fusermount3 is missing (mounting as a user needs it): {INSTALL_HINT}"
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        return f"no C compiler (cc): {INSTALL_HINT}"
    try:
        _fuse3_flags()
    except EmuDriveUnavailable as e:
        return str(e)
    return None


# --- mount ------------------------------------------------------------------------------------


def _bdi_of(path: Path) -> Path:
    st = os.stat(path)
    return Path("/sys/class/bdi") / f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def _wait_ready(proc: subprocess.Popen, timeout_s: float, err_path: Path) -> None:
    """Wait for the emulator's ``ready`` line; EmuDriveError with its stderr if it exits first."""
    deadline = time.monotonic() + timeout_s
    line = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], min(0.2, max(0.0, deadline - time.monotonic())))
        if ready:
            chunk = os.read(proc.stdout.fileno(), 4096)
            if not chunk:
                break
            line += chunk
            if line.startswith(b"ready") and b"\n" in line:
                return
    try:
        rc = proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        rc = None
    err = err_path.read_text(errors="replace").strip() if err_path.exists() else ""
    if rc is None:
        raise EmuDriveError(f"{BINARY_NAME} did not mount within {timeout_s:.0f} s: {err}")
    raise EmuDriveError(f"{BINARY_NAME} exited {rc} before mounting: {err}")


def _raise_exit(signum, frame) -> None:  # noqa: ARG001 (a signal handler's signature)
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _exit_on_signals() -> Iterator[None]:
    """SIGTERM and SIGHUP raise SystemExit while mounted (so the mount is taken down), where their
    action is the default one and this is the main thread; SIGINT raises KeyboardInterrupt anyway."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is signal.SIG_DFL:
                previous[sig] = signal.signal(sig, _raise_exit)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextlib.contextmanager
def mounted(
    model: Path,
    profile: DriveProfile,
    read_ahead_kb: int | None = None,
    *,
    max_read: int | None = None,
    name: str | None = None,
    binary: Path | None = None,
    ready_timeout_s: float | None = None,
) -> Iterator[Mount]:
    """Serve ``model`` through an emulated drive of ``profile``; yields the :class:`Mount`.

    ``read_ahead_kb``: the mount's bdi read_ahead_kb (None: the kernel's, usually 128; setting it
    needs root). ``max_read``: FUSE's largest read request (default: the profile's). ``name``: the
    file's name in the mount (default: the model's). On exit, an exception or SIGTERM/SIGHUP/SIGINT
    included, the emulator is stopped, the mount taken down and its final stats kept
    (``Mount.stats()``). Start it before moving into a memory cgroup: the emulator stays where it
    was started. Raises EmuDriveUnavailable (no compiler, libfuse3 or /dev/fuse) or EmuDriveError.
    """
    model = Path(model)
    if not model.is_file():
        raise EmuDriveError(f"no such file: {model}")
    max_read = profile.max_read if max_read is None else int(max_read)
    if not (4096 <= max_read <= MAX_READ_LIMIT) or max_read % 4096:
        raise ValueError(f"max_read must be a multiple of 4096 in 4096..{MAX_READ_LIMIT}, got {max_read}")
    if read_ahead_kb is not None and read_ahead_kb < 0:
        raise ValueError(f"read_ahead_kb must be >= 0, got {read_ahead_kb}")
    if not FUSE_DEVICE.exists():
        raise EmuDriveUnavailable(f"{FUSE_DEVICE} is missing: the emulated drive needs FUSE")
    binary = build() if binary is None else binary
    name = name or model.name
    size = model.stat().st_size
    timeout = ready_timeout_s if ready_timeout_s is not None else 60.0 + size / 100e6

    work = run_state.make_temp_dir("onebit-emudrive-")  # listed before it is made: a kill -9 leaves it listed
    mountpoint = work / "mnt"
    mountpoint.mkdir()
    stats_path = work / "stats"
    err_path = work / "stderr"
    cmd = [
        str(binary),
        f"--latency-us={profile.latency_us}",
        f"--bandwidth={profile.bandwidth:.0f}",
        f"--channels={profile.channels}",
        f"--max-read={max_read}",
        f"--name={name}",
        f"--stats={stats_path}",
        "--die-with-parent",
        str(model),
        str(mountpoint),
    ]
    mount: Mount | None = None
    run_state.note_mount(mountpoint)
    with _exit_on_signals(), open(err_path, "wb") as err:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=err, start_new_session=True
        )
        try:
            run_state.note_mount(mountpoint, proc.pid)
            _wait_ready(proc, timeout, err_path)
            path = mountpoint / name
            st = os.stat(path)  # answered once the FUSE loop runs
            if st.st_size != size:
                raise EmuDriveError(f"{path} has {st.st_size} bytes, the model {size}")
            bdi = _bdi_of(mountpoint)
            ra_file = bdi / "read_ahead_kb"
            ra_initial = int(ra_file.read_text())
            if read_ahead_kb is not None and read_ahead_kb != ra_initial:
                try:
                    ra_file.write_text(f"{read_ahead_kb}\n")
                except OSError as e:
                    raise EmuDriveError(f"cannot set {ra_file} to {read_ahead_kb} ({e.strerror}; needs root)") from e
            ra_now = int(ra_file.read_text())
            if read_ahead_kb is not None and ra_now != read_ahead_kb:
                raise EmuDriveError(f"{ra_file} reads {ra_now} after writing {read_ahead_kb}")
            try:
                cgroup = ";".join(Path(f"/proc/{proc.pid}/cgroup").read_text().split())
            except OSError:
                cgroup = ""
            mount = Mount(
                path=path,
                mountpoint=mountpoint,
                profile=profile,
                max_read=max_read,
                read_ahead_kb=ra_now,
                read_ahead_kb_initial=ra_initial,
                bdi=bdi,
                pid=proc.pid,
                cgroup=cgroup,
                binary=binary,
                stats_path=stats_path,
                _proc=proc,
            )
            yield mount
        finally:
            final = _stop(proc, mountpoint, stats_path, err_path)
            run_state.forget_mount(mountpoint)
            if mount is not None and final is not None:
                mount._final.append(final)
            run_state.remove_temp_dir(work)


def _stop(proc: subprocess.Popen, mountpoint: Path, stats_path: Path, err_path: Path) -> DriveStats | None:
    """SIGTERM the emulator (it unmounts and writes its final line), SIGKILL and a lazy unmount if it
    does not; the final stats, or None if it left none."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
    if mounted_at(mountpoint):
        force_unmount(mountpoint)
    if mounted_at(mountpoint):
        raise EmuDriveError(f"{mountpoint} is still mounted after {BINARY_NAME} stopped")
    stats = _read_stats(stats_path)
    if proc.returncode not in (0, None) and proc.returncode != -signal.SIGKILL:
        err = err_path.read_text(errors="replace").strip() if err_path.exists() else ""
        print(f"{BINARY_NAME} exited {proc.returncode}: {err}", file=sys.stderr)
    return stats if stats is not None and stats.final else None


# --- command line: mount a model by hand ------------------------------------------------------
