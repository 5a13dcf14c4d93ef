"""``onebit-drive mount|fio`` (commands/drive.py): argparse's and the command map's exit codes,
and a short fio run through the emulated drive (skipped where the emulator cannot run)."""

from __future__ import annotations

import json
import shutil

import pytest

from onebit_predict.commands.drive import main
from onebit_predict.constants import EXIT_OK, EXIT_USAGE
from onebit_predict.drive.emudrive import EmuDriveUnavailable, build, unavailable_reason


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["mount"], "mount needs a MODEL (or --binary)"),
        (["mount", "/nonexistent/model.gguf"], "/nonexistent/model.gguf"),
        (["mount", "m.gguf", "--profile", "floppy"], "invalid choice: 'floppy'"),
        (["fio", "--profiles", "nvme,floppy"], "--profiles: unknown floppy"),
        (["fio", "--modes", "mmap"], "--modes: buffered and direct"),
        (["fio", "--jobs", "1,x"], "is not a comma list of integers"),
        (["fio", "--size-mib", "0"], "--size-mib and --runtime must be positive"),
    ],
)
def test_usage_errors_exit_2(argv, words, capsys):
    assert main(argv) == EXIT_USAGE
    assert words in capsys.readouterr().err


def test_a_short_fio_check_writes_its_table(tmp_path, capsys):
    reason = unavailable_reason()
    if reason or shutil.which("fio") is None:
        pytest.skip(f"the emulated drive or fio cannot run here: {reason or 'no fio'}")
    try:
        build()
    except EmuDriveUnavailable as e:
        pytest.skip(f"the emulated drive cannot run here: {e}")
    md, js = tmp_path / "fio.md", tmp_path / "fio.json"
    argv = ["fio", "--profiles", "nvme", "--bs", "256", "--jobs", "1", "--modes", "buffered", "--size-mib", "32"]
    assert main([*argv, "--runtime", "1", "--markdown", str(md), "--json", str(js)]) == EXIT_OK
    rows = json.loads(js.read_text())
    assert rows and all(r["profile"] == "nvme" and r["bs"] == 256 * 1024 and r["mb_s"] > 0 for r in rows)
    assert "| nvme |" in md.read_text() and "| nvme |" in capsys.readouterr().out
