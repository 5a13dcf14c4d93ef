"""The drive as a variable of a memory-limit run (llama/read_ahead.py): the model's block device found
from its st_dev, and its read_ahead_kb set for a run and restored on every exit path (the normal
end, an exception, SIGTERM and SIGINT mid-run), or refused (exit 2) where it cannot be written.

Nothing here writes a real device's read_ahead_kb: the setter is pointed at a temporary file
standing in for /sys/block/DEV/queue/read_ahead_kb, the discovery of a partition or a FUSE mount
at a temporary sysfs tree; only the discovery of this machine's own model file reads the real
/sys."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from onebit_predict.commands.bench import main as bench_main
from onebit_predict.constants import EXIT_USAGE, READ_AHEAD_KB_MAX
from onebit_predict.llama import read_ahead
from onebit_predict.llama.read_ahead import (
    DriveSetting,
    ReadAhead,
    ReadAheadError,
    block_device,
    read_ahead_value,
)
from onebit_predict.llama.run_state import journal

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "qwen3moe-tiny.gguf"


def _ra_file(tmp_path: Path, kb: int = 8192) -> Path:
    f = tmp_path / "read_ahead_kb"
    f.write_text(f"{kb}\n")
    return f


def _fake_sysfs(root: Path, target: Path, disk: str = "sdz", partition: str | None = "sdz2", kb: int = 4096) -> Path:
    """A sysfs tree under root in which target's st_dev is ``partition`` of ``disk`` (the whole disk
    where partition is None): /sys/dev/block/MAJ:MIN and /sys/block/DISK links, the disk's queue and device."""
    dev = os.stat(target).st_dev
    disk_dir = root / "devices" / "pci0000:00" / "ata1" / "block" / disk
    (disk_dir / "queue").mkdir(parents=True)
    (disk_dir / "device").mkdir()
    (disk_dir / "queue" / "read_ahead_kb").write_text(f"{kb}\n")
    (disk_dir / "queue" / "rotational").write_text("0\n")
    (disk_dir / "device" / "model").write_text("Fake SSD 1TB    \n")
    (disk_dir / "device" / "vendor").write_text("ATA\n")
    node = disk_dir
    if partition is not None:
        node = disk_dir / partition
        node.mkdir()
        (node / "partition").write_text("2\n")
    (root / "dev" / "block").mkdir(parents=True)
    (root / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(node)
    (root / "block").mkdir()
    (root / "block" / disk).symlink_to(disk_dir)
    return disk_dir / "queue" / "read_ahead_kb"


# --- the device -------------------------------------------------------------------------------


def test_the_device_of_this_machines_model():
    """The real model file: its st_dev resolved through /sys/dev/block, the whole disk for a partition."""
    dev = os.stat(MODEL).st_dev
    link = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    if not Path("/sys/dev/block").is_dir():
        pytest.skip("no /sys/dev/block here (not Linux, or sysfs not mounted)")
    if not link.exists():
        pytest.skip(f"{MODEL} is on {link.name}, no block device (tmpfs, overlay, btrfs?)")
    found = block_device(MODEL)
    node = link.resolve()
    disk = node.parent if (node / "partition").is_file() else node
    assert found.name == disk.name and found.major_minor == link.name
    assert found.partition == (node.name if disk != node else None)
    assert Path(found.read_ahead_file).is_file()
    assert found.read_ahead_kb == int(Path(found.read_ahead_file).read_text())
    assert found.read_ahead_kb == int((disk / "queue" / "read_ahead_kb").read_text())
    assert found.rotational in (True, False, None)
    assert found.describe().startswith(f"{disk.name} ({link.name}") and f"read_ahead_kb {found.read_ahead_kb}" in (
        found.describe()
    )
    # recorded without setting anything: the device's value is the one every row ran at
    setting = DriveSetting.of(MODEL)
    report = setting.report({"bandwidth_mb_s": 1000.0})
    assert report["device"]["name"] == disk.name and report["read_ahead_kb"] is None
    assert report["drive"] == {"bandwidth_mb_s": 1000.0, "read_ahead_kb": found.read_ahead_kb}
    assert setting.text() == f"drive {found.describe()}"


def test_a_partition_is_recorded_with_its_whole_disk(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    ra = _fake_sysfs(tmp_path / "sys", model)
    d = block_device(model, tmp_path / "sys")
    assert (d.name, d.partition, d.model, d.vendor, d.rotational, d.read_ahead_kb) == (
        "sdz",
        "sdz2",
        "Fake SSD 1TB",
        "ATA",
        False,
        4096,
    )
    assert d.read_ahead_file == str(tmp_path / "sys" / "block" / "sdz" / "queue" / "read_ahead_kb")
    assert Path(d.read_ahead_file).resolve() == ra.resolve()
    assert "partition sdz2, model Fake SSD 1TB, vendor ATA, non-rotational), read_ahead_kb 4096" in d.describe()


def test_a_filesystem_without_a_block_device(tmp_path, monkeypatch):
    """FUSE (the emulated drive): no /sys/dev/block entry, its readahead in /sys/class/bdi; nothing at
    all (tmpfs): recorded as unknown, refused where a value is to be set."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    dev = os.stat(model).st_dev
    mm = f"{os.major(dev)}:{os.minor(dev)}"
    sys_root = tmp_path / "sys"
    (sys_root / "dev" / "block").mkdir(parents=True)
    with pytest.raises(ReadAheadError, match=f"on device {mm}, which has neither"):
        block_device(model, sys_root)
    monkeypatch.setattr(read_ahead, "SYS", sys_root)
    assert DriveSetting.of(model).device is None  # recorded as unknown, the run goes on
    assert DriveSetting.of(model).report({})["device"] is None
    with pytest.raises(ReadAheadError, match=r"--read-ahead-kb: .*\(no block device\)"):
        DriveSetting.of(model, [128])
    bdi = sys_root / "class" / "bdi" / mm
    bdi.mkdir(parents=True)
    (bdi / "read_ahead_kb").write_text("128\n")
    d = block_device(model, sys_root)
    assert (d.name, d.read_ahead_kb, d.read_ahead_file) == (f"bdi {mm}", 128, str(bdi / "read_ahead_kb"))


def test_values_are_whole_pages():
    assert read_ahead_value("128") == 128 and read_ahead_value("0") == 0
    assert read_ahead_value(str(READ_AHEAD_KB_MAX)) == READ_AHEAD_KB_MAX == 1 << 20
    for bad in ("-4", "130", "big", "1.5"):
        with pytest.raises(ValueError):
            read_ahead_value(bad)
    # what a bdi takes and reads back rounded down to pages (999999996), or a block device refuses (2^32)
    for bad in ("999999999", "999999996", str(1 << 32), str(READ_AHEAD_KB_MAX + 4)):
        with pytest.raises(ValueError, match=r"read_ahead_kb is 0\.\.1048576 \(1 GiB\) and a multiple of"):
            read_ahead_value(bad)


def test_the_value_found_is_recorded_before_it_is_changed(tmp_path, caplog):
    """In a run's journal (llama/run_state.py): the value found is in the state file on entry, before any
    write of another; the log says a kill -9 is taken care of; dropped once restored. A file that goes
    with a mount (recorded=False) is not recorded."""
    f = _ra_file(tmp_path)
    (tmp_path / "bdi").mkdir()
    bdi = _ra_file(tmp_path / "bdi")
    with caplog.at_level(logging.INFO, logger="onebit_predict"), journal("onebit-bench", tmp_path / "state") as state:
        with ReadAhead(f, "vdz") as ra:
            assert json.loads(state.path.read_text())["settings"] == {str(f): "8192"}
            ra.set(128)
        assert json.loads(state.path.read_text())["settings"] == {}
        with ReadAhead(bdi, recorded=False) as ra:
            ra.set(256)
            assert json.loads(state.path.read_text())["settings"] == {}
    assert not state.path.exists()
    assert "set to 128 (found 8192; recorded: after a kill -9, the next onebit-bench run puts it back)" in caplog.text
    assert "set to 256 (found 8192; if this process is killed: echo 8192 >" in caplog.text


# --- set and restored on every exit path ------------------------------------------------------


def test_set_per_run_and_restored_at_the_end(tmp_path, caplog):
    f = _ra_file(tmp_path)
    with caplog.at_level(logging.INFO, logger="onebit_predict"), ReadAhead(f, "vdz") as ra:
        for kb in (128, 8192, 128):
            ra.set(kb)
            assert int(f.read_text()) == kb
        assert signal.getsignal(signal.SIGTERM) == ra._on_signal
    assert f.read_text() == "8192\n"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the handlers that were there are back
    text = caplog.text
    assert "read_ahead_kb of vdz set to 128 (found 8192; if this process is killed: echo 8192 >" in text
    assert text.count("restored to 8192") == 1


def test_restored_after_an_exception(tmp_path, caplog):
    f = _ra_file(tmp_path)
    with caplog.at_level(logging.INFO, logger="onebit_predict"):
        with pytest.raises(RuntimeError, match="a run failed"), ReadAhead(f, "vdz") as ra:
            ra.set(256)
            raise RuntimeError("a run failed")
    assert f.read_text() == "8192\n" and "read_ahead_kb of vdz restored to 8192" in caplog.text


def test_a_value_kept_as_found_is_still_logged(tmp_path, caplog):
    f = _ra_file(tmp_path)
    with caplog.at_level(logging.INFO, logger="onebit_predict"), ReadAhead(f) as ra:
        ra.set(8192)
    assert f.read_text() == "8192\n" and "restored to 8192" in caplog.text


CHILD = """
import itertools, logging, signal, sys, time
from onebit_predict.llama.read_ahead import ReadAhead
# the dispositions of a process started from a terminal, whatever the test runner's were (a runner
# started with nohup, or in the background of a script, ignores SIGHUP or SIGINT: the child inherits it)
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGHUP, signal.SIG_DFL)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
with ReadAhead(sys.argv[1], "vdz") as ra:
    for i in itertools.count():
        ra.set((128, 256)[i % 2])  # one value per run, as the benchmark sets them
        print(i, flush=True)
        time.sleep(0.02)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_mid_run_restores_then_ends_the_process(tmp_path, sig):
    f = _ra_file(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(f)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None
    for _ in range(5):  # a few runs in: the value is set
        assert proc.stdout.readline(), proc.stderr.read() if proc.stderr else ""
    assert int(f.read_text()) in (128, 256)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=30)
    assert f.read_text() == "8192\n", err
    assert "set to 128 (found 8192" in err and "restored to 8192" in err
    assert f"{signal.Signals(sig).name} received: restoring read_ahead_kb of vdz" in err
    # SIGINT: KeyboardInterrupt (Python ends by the signal); the others: exit 128 + signal
    assert proc.returncode in ((-sig, 128 + sig) if sig == signal.SIGINT else (128 + sig,)), err


def test_an_ignored_signal_stays_ignored(tmp_path):
    f = _ra_file(tmp_path)
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with ReadAhead(f) as ra:
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            ra.set(128)
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, previous)


# --- refused where it cannot be written -------------------------------------------------------


def test_refused_where_the_file_is_missing(tmp_path):
    with pytest.raises(ReadAheadError, match="no such file"):
        ReadAhead(tmp_path / "nope").probe()
    with pytest.raises(ReadAheadError, match="no such file"), ReadAhead(tmp_path / "nope"):
        pass


def test_refused_where_the_file_cannot_be_written(tmp_path, monkeypatch):
    """An immutable file: not even root writes it (as a non-root user cannot write sysfs)."""
    f = _ra_file(tmp_path)
    chattr = shutil.which("chattr")
    if chattr is None or subprocess.run([chattr, "+i", str(f)], capture_output=True).returncode != 0:
        pytest.skip("cannot make a file immutable here (chattr +i)")
    try:
        with pytest.raises(ReadAheadError, match=r"cannot write 8192 to .*read_ahead_kb \(vdz\): Operation not"):
            ReadAhead(f, "vdz").probe()
        monkeypatch.setattr(read_ahead.os, "geteuid", lambda: 1000)
        with pytest.raises(ReadAheadError, match="needs root"):
            ReadAhead(f, "vdz").probe()
    finally:
        subprocess.run([chattr, "-i", str(f)], check=True)
    assert f.read_text() == "8192\n"


def test_the_bench_refuses_before_the_build(tmp_path, monkeypatch, capsys):
    """onebit-bench checks --read-ahead-kb with the other arguments: exit 2 and why, before the build is
    looked for and before any value is set."""
    model = tmp_path / "m.gguf"
    shutil.copyfile(MODEL, model)
    ra = _fake_sysfs(tmp_path / "sys", model, disk="vdz", partition=None, kb=4096)
    monkeypatch.setattr(read_ahead, "SYS", tmp_path / "sys")

    def no_build():
        raise AssertionError("the build was looked for")

    monkeypatch.setattr("onebit_predict.commands.bench.build_info", no_build)
    cases = [
        (["--read-ahead-kb", "128"], "is a dimension of --memory-limit"),
        (["--memory-limit", "64MiB", "--read-ahead-kb", "130"], "multiple of"),
        (["--memory-limit", "64MiB", "--read-ahead-kb", "128,"], "empty item"),
        (["--memory-limit", "64MiB", "--read-ahead-kb", "999999999"], "0..1048576 (1 GiB)"),
        (["--memory-limit", "64MiB", "--read-ahead-kb", "128,8192,128"], "gives 128 twice"),
        (["--memory-limit", "64MiB", "--read-ahead-kb", "128,0128"], "gives 128 twice"),
    ]
    for extra, message in cases:
        assert bench_main([str(model), *extra]) == EXIT_USAGE, extra
        assert message in capsys.readouterr().err, extra
    ra.unlink()
    assert bench_main([str(model), "--memory-limit", "64MiB", "--rounds", "1", "--read-ahead-kb", "128"]) == EXIT_USAGE
    assert "no such file" in capsys.readouterr().err


def test_drive_setting_report_with_values(tmp_path, monkeypatch):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    ra = _fake_sysfs(tmp_path / "sys", model, disk="vdz", partition=None, kb=4096)
    monkeypatch.setattr(read_ahead, "SYS", tmp_path / "sys")
    both = DriveSetting.of(model, [128, 8192])
    assert both.report({"x": 1}) | {"device": None} == {"drive": {"x": 1}, "device": None, "read_ahead_kb": [128, 8192]}
    assert both.text().endswith("read_ahead_kb 128 and 8192 (found 4096, restored after)")
    one = DriveSetting.of(model, [128])
    assert one.report({})["drive"] == {"read_ahead_kb": 128}  # every row ran at it
    with both.applied() as setter:
        setter.set(128)
        assert ra.read_text() == "128\n"
    assert ra.read_text() == "4096\n"
    with DriveSetting.of(model).applied() as setter:
        assert setter is None  # nothing to set: the device as found
