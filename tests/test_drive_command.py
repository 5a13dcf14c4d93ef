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


def test_a_read_ahead_the_kernel_would_not_keep_is_a_usage_error(tmp_path, monkeypatch, capsys):
    """999999999 KiB: a FUSE bdi reads back 999999996 (whole pages) and the mount failed, exit 1; refused
    at parse time now, exit 2, before anything is mounted."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    monkeypatch.setattr("onebit_predict.commands.drive.mounted", lambda *a, **k: pytest.fail("a drive was mounted"))
    for value, words in (("999999999", "0..1048576 (1 GiB)"), ("130", "a multiple of"), ("-4", "0..1048576")):
        assert main(["mount", str(model), "--read-ahead-kb", value]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert f"argument --read-ahead-kb: {value} KiB: read_ahead_kb is " in err and words in err, err


def test_a_missing_system_package_is_exit_2(tmp_path, monkeypatch, capsys):
    """No libfuse3 (pkg-config finds none): exit 2 as onebit-bench --drive gives, one line with the apt-get
    command, for mount and mount --binary; no fio: exit 2 with its apt-get command."""
    from onebit_predict.drive import emudrive

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    (tmp_path / "fuse").touch()  # a /dev/fuse on any machine: the missing library is the reason
    monkeypatch.setattr(emudrive, "FUSE_DEVICE", tmp_path / "fuse")
    monkeypatch.setenv("ONEBIT_CACHE", str(tmp_path / "cache"))  # no emulator built before
    real_which = shutil.which
    monkeypatch.setattr(
        emudrive.shutil, "which", lambda name: None if name in ("pkg-config", "fio") else real_which(name)
    )
    for argv in (["mount", str(model)], ["mount", "--binary"]):
        assert main(argv) == EXIT_USAGE, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "apt-get install libfuse3-dev fuse3" in err and "Traceback" not in err, err
    assert main(["fio", "--profiles", "nvme"]) == EXIT_USAGE
    assert capsys.readouterr().err == "onebit-drive: ERROR: fio is missing: apt-get install fio\n"


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
