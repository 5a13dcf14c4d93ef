"""Writing a file so that it is whole or absent: the one way every writer of the package writes.

A writer that writes straight to its final name leaves half a file there when the disk fills
(or the process dies) and, where a short write goes unchecked, exits 0 with it. Here a
writer writes to a temporary name in the same directory (same filesystem, so the rename is
atomic), the file is flushed to the drive (fsync), its size checked where it is known, and
only then renamed onto the final name with ``os.replace``. On any error the temporary file is
removed and the error raised: ``OSError`` (exit 2 through commands/common.py) unless the
caller maps it to its own.

- :func:`atomic_path`: a context manager that yields the temporary path, for writers that
  open the file themselves (gguf-py's GGUFWriter, matplotlib's savefig, a C tool);
- :func:`atomic_write_bytes`, :func:`atomic_write_text`: one buffer, written and checked;
- :func:`sweep_partials`: the temporary files of writers that died (``kill -9``) before the rename.

A temporary name holds its writer's pid (``.NAME.PID-XXXXXXXX.partial.SUFFIX``), so that a later run
can tell a file whose writer is gone from one still being written.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

PARTIAL = ".partial"  # in every temporary name: `.NAME.PID-XXXXXXXX.partial.SUFFIX`
PARTIAL_NAME = re.compile(r"^\..*\.(?P<pid>\d+)-[0-9a-f]{8}\.partial(\.[^/]*)?$")


def temp_name(final: Path) -> Path:
    """A fresh name next to ``final`` that keeps its suffix (matplotlib picks the format by it) and
    names this process (:func:`sweep_partials` removes it once this process is gone)."""
    return final.with_name(f".{final.stem}.{os.getpid()}-{secrets.token_hex(4)}{PARTIAL}{final.suffix}")


def sweep_partials(directory: str | Path) -> list[Path]:
    """Remove the temporary files in ``directory`` whose writer is no longer running (a writer
    killed before its rename); returns those removed. A writer's pid taken by another process since
    keeps its file: a file is only ever left, never removed while written."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = PARTIAL_NAME.match(name)
        if m is None or _running(int(m.group("pid"))):
            continue
        path = Path(directory) / name
        try:
            path.unlink()
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


def _running(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts as gone: it writes nothing more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:
        return True  # cannot tell: keep its file
    return stat[stat.rindex(")") + 2 :].split()[0] != "Z"


def create_temp(final: Path) -> Path:
    """Create a fresh empty file next to ``final`` (:func:`temp_name`, the umask's mode); an OSError
    names ``final`` (a missing directory, no permission)."""
    while True:
        tmp = temp_name(final)
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue
        except OSError as e:
            raise OSError(e.errno, f"cannot write it: {e.strerror}", str(final)) from None


def fsync_file(path: Path) -> None:
    """Flush ``path``'s data to the drive (a full disk can fail here, after every write succeeded)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    """Make a rename in ``path`` durable; a filesystem that cannot fsync a directory is not an error."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def check_size(path: Path, expected: int) -> None:
    """OSError (ENOSPC, naming ``path``) unless the file holds exactly ``expected`` bytes: a short write."""
    size = path.stat().st_size
    if size != expected:
        raise OSError(errno.ENOSPC, f"short write: {size} of {expected} bytes written (is the disk full?)", str(path))


@contextmanager
def atomic_path(final: str | Path) -> Iterator[Path]:
    """Yield a temporary path next to ``final``; on a clean exit fsync it and rename it onto ``final``.

    The temporary file exists (empty, with the umask's mode) when the body starts. On any
    exception, in the body or in the fsync and rename, it is removed and the exception raised,
    and ``final`` is left as it was.
    """
    final = Path(final)
    tmp = create_temp(final)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(final.parent)


def atomic_write_bytes(final: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``final`` whole or not at all (OSError naming the file on a short write)."""
    final = Path(final)
    with atomic_path(final) as tmp:
        with tmp.open("wb") as f:
            f.write(data)
        check_size(tmp, len(data))
    return final


def atomic_write_text(final: str | Path, text: str, encoding: str = "utf-8") -> Path:
    """Write ``text`` to ``final`` whole or not at all (OSError naming the file on a short write)."""
    return atomic_write_bytes(final, text.encode(encoding))
