"""FUSE mounts as /proc/self/mountinfo shows them, and their lazy unmount: what the emulated drive
(drive/emudrive.py) and the recovery of a killed run's mounts (llama/run_state.py) share."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def mounted_at(mountpoint: Path) -> bool:
    """Whether something is mounted at ``mountpoint`` (/proc/self/mountinfo, octal escapes undone)."""
    target = os.path.realpath(mountpoint)
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return False
    for line in lines:
        parts = line.split()
        if len(parts) > 4 and unescape(parts[4]) == target:
            return True
    return False


def unescape(s: str) -> str:
    """A /proc/self/mountinfo field with its octal escapes (\\040 for a space) undone."""
    return s.encode().decode("unicode_escape") if "\\" in s else s


def force_unmount(mountpoint: Path) -> None:
    """A lazy unmount of a mount whose emulator is gone (fusermount3 -u -z, else umount -l)."""
    for cmd in (["fusermount3", "-u", "-z", str(mountpoint)], ["umount", "-l", str(mountpoint)]):
        if shutil.which(cmd[0]) and subprocess.run(cmd, capture_output=True).returncode == 0:
            return
