"""onebit-bench --memory-limit --drive native,nvme,sata: the drive as a dimension of the run.

Every configuration runs on each drive, side by side in one report: ``native`` reads the model where
it is, ``nvme`` and ``sata`` serve it from the emulated drive (onebit_predict/drive), mounted by the
bench before any worker joins its memory cgroup and kept mounted for all of that drive's runs. The
refusals need neither the build nor FUSE; the run through an emulated mount with a stand-in worker
needs FUSE (skipped with the reason without it); the real run needs both.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from onebit_predict.checks import bench_memory, rounds
from onebit_predict.checks.bench_memory import drives_mounted, drives_report, markdown_memory, memory_configs
from onebit_predict.checks.rounds import BenchOptions, Config, DriveRun, Sample, WorkerError, run_one, worker_json
from onebit_predict.commands.bench import main as bench_main
from onebit_predict.constants import EXIT_OK, EXIT_USAGE
from onebit_predict.costmodel.measured import load_measured
from onebit_predict.costmodel.row_config import DRIVES, RowConfig, from_name
from onebit_predict.drive import emudrive
from onebit_predict.drive.emudrive import EmuDriveError, unavailable_reason
from onebit_predict.drive.profiles import NVME
from onebit_predict.llama.cgroup import CgroupError, MemoryCgroup
from onebit_predict.llama.evict import expert_spans, resident_expert_bytes
from onebit_predict.llama.mounts import mounted_at

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "qwen3moe-tiny.gguf"


def _no_build():
    raise AssertionError("the build was looked for")


def _private_model(tmp_path: Path) -> Path:
    """A copy of the tiny model no other process maps (its pages would stay resident)."""
    model = tmp_path / "qwen3moe-tiny.gguf"
    shutil.copyfile(MODEL, model)
    return model


def _require_fuse() -> None:
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(f"the emulated drive cannot run here: {reason}")


def _require_cgroup() -> None:
    try:
        MemoryCgroup("onebit-test-probe", 64 << 20).remove()
    except CgroupError as e:
        pytest.skip(f"no memory cgroup here: {e}")


# --- refusals: exit 2 before the build is looked for --------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--drive", "nvme"], "--drive is a dimension of --memory-limit runs: give --memory-limit too"),
        (["--drive", "native"], "--drive is a dimension of --memory-limit runs"),
        (
            ["--memory-limit", "64MiB", "--drive", "floppy"],
            "unknown drive 'floppy': one of native, nvme, nvme-1m, nvme-3g, sata",
        ),
        (["--memory-limit", "64MiB", "--drive", "nvme,"], "empty item"),
        (["--memory-limit", "64MiB", "--drive", "native,native"], "'native,native' gives native twice"),
        (["--memory-limit", "64MiB", "--drive", "nvme,sata, nvme"], "gives nvme twice"),
    ],
)
def test_drive_arguments_are_refused(extra, message, monkeypatch, capsys):
    monkeypatch.setattr("onebit_predict.commands.bench.build_info", _no_build)
    assert bench_main([str(MODEL), *extra]) == EXIT_USAGE
    assert message in capsys.readouterr().err


def test_an_emulator_that_cannot_be_built_is_refused(monkeypatch, capsys, tmp_path):
    """No libfuse3 (pkg-config finds none) or a compile that fails: exit 2, the Debian packages named,
    before the build is looked for and before anything is mounted."""
    monkeypatch.setattr("onebit_predict.commands.bench.build_info", _no_build)
    (tmp_path / "fuse").touch()  # a /dev/fuse that opens, on any machine: the missing library is the reason
    monkeypatch.setattr(emudrive, "FUSE_DEVICE", tmp_path / "fuse")
    monkeypatch.setattr(emudrive, "mounted", lambda *a, **k: pytest.fail("a drive was mounted"))
    real_which = shutil.which
    monkeypatch.setattr(emudrive.shutil, "which", lambda name: None if name == "pkg-config" else real_which(name))
    argv = [str(MODEL), "--memory-limit", "64MiB", "--drive", "native,nvme"]
    assert bench_main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--drive nvme: the emulated drive cannot run here" in err and "apt-get install libfuse3-dev" in err, err
    monkeypatch.setattr(emudrive.shutil, "which", real_which)
    monkeypatch.setattr(emudrive, "unavailable_reason", lambda: None)

    def broken(*a, **k):
        raise EmuDriveError("could not compile onebit-emudrive.c: fuse_lowlevel.h: No such file")

    monkeypatch.setattr(emudrive, "build", broken)
    assert bench_main([*argv[:-1], "sata"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--drive sata" in err and "could not compile" in err and "libfuse3-dev" in err, err
    # native alone needs no emulator
    bench_memory.require_drives(["native"])


# --- the configuration's drive ------------------------------------------------------------------


def test_the_drive_is_a_field_of_the_configuration():
    c = RowConfig("block", "advise", drive="nvme")
    assert DRIVES == ("native", "nvme", "nvme-1m", "nvme-3g", "sata")
    assert c.name == "block + advise, nvme" and c.env() == RowConfig("block", "advise").env()
    assert RowConfig.from_fields(json.loads(json.dumps(c.fields()))) == c and from_name(c.name) == c
    both = RowConfig("router", "advise", oracle=True, read_ahead_kb=128, drive="sata")
    assert both.name == "oracle + advise, readahead 128, sata" and from_name(both.name) == both
    assert (
        RowConfig(drive="native").name == "patched off, native" and from_name("patched off, native").drive == "native"
    )
    # never a loss and vs patched off: on the same drive, at the same readahead
    assert c.consumer_off() == RowConfig("block", drive="nvme") and c.predictor_off() == RowConfig(drive="nvme")
    assert both.predictor_off() == RowConfig(read_ahead_kb=128, drive="sata")
    with pytest.raises(ValueError, match="drive 'floppy' is not one of native, nvme, nvme-1m, nvme-3g, sata"):
        RowConfig(drive="floppy")
    with pytest.raises(ValueError, match="drive 'floppy'"):
        RowConfig.from_fields(c.fields() | {"drive": "floppy"})
    assert from_name("block + advise, floppy") is None
    # a report written before the field: the drive unknown
    before = {k: v for k, v in c.fields().items() if k != "drive"}
    assert RowConfig.from_fields(before) == RowConfig("block", "advise") and RowConfig.from_fields(before).drive is None


def test_each_configuration_on_each_drive_side_by_side(tmp_path):
    base = memory_configs(tmp_path, 16)
    plans = memory_configs(tmp_path, 16, [128, 8192], ["native", "nvme"])
    assert len(plans) == 4 * len(base)
    for i, b in enumerate(base):
        got = plans[4 * i : 4 * i + 4]
        assert [(p.config.read_ahead_kb, p.config.drive) for p in got] == [
            (128, "native"), (128, "nvme"), (8192, "native"), (8192, "nvme")
        ]  # fmt: skip
        for p in got:
            assert p.name == f"{b.name}, readahead {p.config.read_ahead_kb}, {p.config.drive}" == p.config.name
            assert (p.run.drive, p.run.read_ahead_kb) == (p.config.drive, p.config.read_ahead_kb)
    assert len({p.env["ONEBIT_MOE_PREDICT_OUT"] for p in plans}) == len(plans)
    assert all(b.run.drive is None and b.config.drive is None for b in base)


def test_reports_read_back_each_rows_drive(tmp_path):
    """A row's drive: its config's, else the report's one drive; unknown in a report before ``drives``.
    An emulated drive's row ran at the mount's readahead, not the model's device's."""
    rows = [
        {"limit_bytes": 64 << 20, "name": c.name, "median_tok_s": 2.0, "config": c.fields()}
        for c in (RowConfig(drive="native"), RowConfig(drive="nvme"), RowConfig("block", "advise", drive="nvme"))
    ]
    drives = {"native": {"emulated": False}, "nvme": {"emulated": True, "read_ahead_kb": 128, "max_read": 131072}}
    doc = {"memory_limits": [64 << 20], "rows": rows, "drive": {"read_ahead_kb": 8192}, "drives": drives}
    (tmp_path / "r.json").write_text(json.dumps(doc))
    back = load_measured(tmp_path / "r.json")
    assert [(r.drive, r.read_ahead_kb) for r in back.rows] == [("native", 8192), ("nvme", 128), ("nvme", 128)]
    assert back.read_ahead_kb is None  # the rows ran at two values
    # without --drive: the rows name none, the report records the one drive they ran on
    plain = [{k: v for k, v in r.items() if k != "config"} | {"name": "patched off"} for r in rows[:1]]
    (tmp_path / "r.json").write_text(json.dumps(doc | {"rows": plain, "drives": {"native": {"emulated": False}}}))
    assert [(r.drive, r.read_ahead_kb) for r in load_measured(tmp_path / "r.json").rows] == [("native", 8192)]
    # written before drives: unknown
    (tmp_path / "r.json").write_text(json.dumps({"memory_limits": [64 << 20], "rows": plain}))
    assert [r.drive for r in load_measured(tmp_path / "r.json").rows] == [None]


def test_ratios_and_figures_per_drive(tmp_path, monkeypatch):
    """vs patched off and vs consumer off on the row's own drive; an emulated row's utilisation over its
    profile's bandwidth, its emulator's bytes and CPU seconds the medians of its runs; the table shows them."""
    monkeypatch.setattr(
        bench_memory, "memory_rows", lambda n: [RowConfig(), RowConfig("block"), RowConfig("block", "advise")]
    )
    plans = memory_configs(tmp_path, 4, None, ["native", "nvme"])
    speed = {"patched off": 10.0, "block": 9.0, "block + advise": 8.0}

    class _Mount:
        profile = NVME

    drives = {"native": DriveRun("native", MODEL), "nvme": DriveRun("nvme", MODEL, mount=_Mount())}

    def collect(model, runs, lib, pristine, opts):
        assert opts.drives is drives
        out = {}
        for r in runs:
            name, drive = r.name.rsplit(", ", 1)
            nvme = drive == "nvme"
            tok_s = speed[name] * (2 if nvme else 1)
            emu = {"drive_bytes": 3 << 20, "drive_cpu_s": 0.5, "drive_decode_cpu_s": 0.25} if nvme else {}
            out[r.name] = [Sample(tok_s * f, 0.0, 2, None, 60 << 20, 4, 1.0, **emu) for f in (0.9, 1.0, 1.1)]
        return out

    monkeypatch.setattr(bench_memory, "collect", collect)
    monkeypatch.setattr(bench_memory, "trace_figures", lambda path: (None, None, 0, 0, 0, 0, 0))
    opts = BenchOptions(rounds=3, drives=drives)
    rows = bench_memory.measure_memory(MODEL, plans, tmp_path, opts, [64 << 20], 1000.0)
    got = {r.name: r for r in rows}
    for drive in ("native", "nvme"):
        assert got[f"block + advise, {drive}"].ratio_to_off == pytest.approx(0.8)
        assert got[f"block + advise, {drive}"].ratio_to_consumer_off == pytest.approx(8 / 9)
    assert got["block, native"].drive_cpu_s is None and got["block, native"].drive_served_bytes is None
    assert got["block, nvme"].drive_served_bytes == 3 << 20 and got["block, nvme"].drive_cpu_s == 0.5
    assert got["block, native"].drive_utilisation == pytest.approx(60 * 2**20 / 1e9)  # over 1000 MB/s
    assert got["block, nvme"].drive_utilisation == pytest.approx(60 * 2**20 / 6e9)  # over the profile's 6 GB/s
    text = markdown_memory(rows, "header")
    assert "| 0.500 (0.250) |" in text and text.splitlines()[4].endswith("| - |")


# --- an emulated mount, a stand-in worker (FUSE, no build) ------------------------------------


class _NoGroup:
    def __init__(self, name, limit):
        self.path = Path("/nonexistent")

    def remove(self):
        pass


def test_a_run_on_the_emulated_drive(tmp_path, monkeypatch):
    """run_one on an nvme mount: the model's pages read in through the mount are dropped and proven gone
    (require_evicted on the FUSE file), the worker is given the mount's file and the emulator's stats,
    the emulator's counters before and after the run are recorded, its bytes and CPU seconds in the
    sample; the mount's read_ahead_kb is set and recorded, and the mount is gone on exit."""
    _require_fuse()
    model = _private_model(tmp_path)
    spans = expert_spans(model)  # read apart: reading the header through the mount reads pages around it
    seen = {}

    def worker(cmd, lib, what):
        seen["cmd"] = cmd
        path = Path(cmd[0])
        seen["resident"] = resident_expert_bytes(path, spans)
        pid, stats = cmd[cmd.index("--drive-stats") + 1].split(":", 1)
        from onebit_predict.checks.worker import _drive_snapshot

        d0 = _drive_snapshot((int(pid), Path(stats)))
        with open(path, "rb", buffering=0) as f:  # the "decode": reads through the device
            while f.read(1 << 20):
                pass
        d1 = _drive_snapshot((int(pid), Path(stats))).minus(d0)
        return {"tok_s": 5.0, "compute_mib": 1.0, "n_layer": 2, "read_bytes": 0, "major_faults": 0,
                "seconds": 1.0, "drive_read_bytes": d1.bytes, "drive_cpu_s": d1.serve_cpu_s}  # fmt: skip

    monkeypatch.setattr(rounds, "worker_json", worker)
    monkeypatch.setattr(rounds, "check_build", lambda *a: None)
    monkeypatch.setattr("onebit_predict.llama.cgroup.MemoryCgroup", _NoGroup)
    ra = 256 if os.geteuid() == 0 else None
    with drives_mounted(model, ["native", "nvme"], [ra] if ra else None) as drives:
        nvme = drives["nvme"]
        mountpoint = nvme.mount.mountpoint
        assert nvme.path.parent == mountpoint and mounted_at(mountpoint) and drives["native"].path == model
        rounds.read_through(nvme.path)  # resident: the bench's eviction check must drop it through the mount
        assert resident_expert_bytes(nvme.path, spans) > 0
        opts = BenchOptions(rounds=1, memory_limit=64 << 20, drives=drives)
        sample = run_one(model, Config("block + advise, nvme", {}, drive="nvme", read_ahead_kb=ra), tmp_path, opts)
        if ra:
            assert int((nvme.mount.bdi / "read_ahead_kb").read_text()) == ra
    assert not mounted_at(mountpoint)
    assert seen["cmd"][0] == str(nvme.path) and seen["resident"] == 0
    assert 0 < sample.read_bytes <= sample.drive_bytes and sample.drive_bytes >= model.stat().st_size
    assert sample.drive_cpu_s >= 0 and sample.drive_decode_cpu_s >= 0
    (run,) = nvme.runs
    assert run["name"] == "block + advise, nvme" and run["limit_bytes"] == 64 << 20
    assert run["after"]["bytes"] - run["before"]["bytes"] == sample.drive_bytes
    report = drives_report(drives, model)
    assert report["native"] == {"emulated": False, "path": str(model)}
    rec = report["nvme"]
    assert rec["emulated"] and rec["max_read"] == NVME.max_read and rec["profile"]["name"] == "nvme"
    assert rec["read_ahead_kb"] == (ra or rec["read_ahead_kb_initial"]) and rec["final"]["final"]
    assert rec["runs"] == nvme.runs and rec["emulator_cgroup"] == nvme.mount.cgroup
    assert drives_report(None, model) == {"native": {"emulated": False, "path": str(model)}}


# --- a worker that dies of a signal -------------------------------------------------------------

# a worker whose last stderr line says nothing of why it died, then SIGBUS (a fault on a dead FUSE mapping)
SIGBUS_WORKER = (
    "import os, signal, sys; print('n_exps.input_scale', file=sys.stderr, flush=True); "
    "os.kill(os.getpid(), signal.SIGBUS)"
)


def _worker_run(monkeypatch, worker) -> None:
    """subprocess.run as rounds.py starts a worker: ``worker(cmd, **kw)`` instead (any other command runs)."""
    real_run = subprocess.run

    def run(cmd, **kw):
        return worker(cmd, **kw) if cmd[1:3] == ["-m", rounds.WORKER_MODULE] else real_run(cmd, **kw)

    monkeypatch.setattr(rounds.subprocess, "run", run)


def _dies_of_sigbus(monkeypatch) -> None:
    _worker_run(monkeypatch, lambda cmd, **kw: subprocess.run([sys.executable, "-c", SIGBUS_WORKER], **kw))


class _StandInMount:
    """An emulated drive's Mount as run_one uses it, up or down."""

    def __init__(self, down: str | None) -> None:
        self.pid, self.stats_path, self._down = 1, Path("/nonexistent"), down

    def stats(self):
        return None

    def down(self) -> str | None:
        return self._down


def test_a_worker_killed_by_a_signal_is_named_by_it(monkeypatch):
    """Not "the worker failed (-7): n_exps.input_scale": the signal's name; on an emulated drive that is
    down, "the emulated drive stopped"."""
    _dies_of_sigbus(monkeypatch)
    with pytest.raises(WorkerError) as e:
        worker_json(["m.gguf"], Path("/lib"), "block: the worker failed")
    assert str(e.value) == "block: the worker failed: killed by SIGBUS" and e.value.signal == signal.SIGBUS
    monkeypatch.setattr(rounds, "check_build", lambda *a: None)
    for down, message in [
        ("onebit-emudrive (pid 1) is no longer running (killed by SIGKILL)",
         "block, nvme: the emulated drive stopped (SIGBUS in the worker; onebit-emudrive (pid 1) is no longer "
         "running (killed by SIGKILL))"),
        (None, "block, nvme: the worker failed: killed by SIGBUS"),  # the drive is up: the worker's own fault
    ]:  # fmt: skip
        drives = {"nvme": DriveRun("nvme", MODEL, mount=_StandInMount(down))}
        with pytest.raises(WorkerError) as e:
            run_one(MODEL, Config("block, nvme", {}, drive="nvme"), Path("/lib"), BenchOptions(drives=drives))
        assert str(e.value) == message


# the worker: maps the model, drops its pages, says so, and touches every page once told to (stdin)
MAPPING_WORKER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
print("mapped", flush=True)
sys.stdin.readline()
print(sum(m[i] for i in range(0, len(m), 4096)))
"""


def test_the_emulated_drive_stopping_mid_decode(tmp_path, monkeypatch):
    """The emulator killed while the worker has the model mapped from its mount: the worker's next fault
    is a SIGBUS, and the row's error says the emulated drive stopped (FUSE, no build)."""
    _require_fuse()
    model = _private_model(tmp_path)

    def run(cmd, **kw):
        path = cmd[3]  # python -m onebit_predict.commands.bench_worker MODEL ...
        worker = subprocess.Popen([sys.executable, "-c", MAPPING_WORKER, path], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        assert worker.stdout.readline() == "mapped\n", worker.communicate()
        os.kill(drives["nvme"].mount.pid, signal.SIGKILL)
        drives["nvme"].mount._proc.wait()
        out, err = worker.communicate("go\n", timeout=60)
        return subprocess.CompletedProcess(cmd, worker.returncode, out, err)

    _worker_run(monkeypatch, run)
    with drives_mounted(model, ["nvme"], None) as drives:
        with pytest.raises(WorkerError) as e:
            run_one(model, Config("block + advise, nvme", {}, drive="nvme"), tmp_path, BenchOptions(drives=drives))
    assert e.value.signal == signal.SIGBUS
    assert str(e.value) == (
        f"block + advise, nvme: the emulated drive stopped (SIGBUS in the worker; onebit-emudrive (pid "
        f"{drives['nvme'].mount.pid}) is no longer running (killed by SIGKILL))"
    )


# --- the real run ---------------------------------------------------------------------------------


@pytest.mark.needs_build
def test_native_and_nvme_side_by_side(tmp_path, capsys):
    """The tiny model on its own drive and on the emulated nvme, every configuration on each, in one
    report. (64 MiB, as test_bench_memory's runs: ``50%`` of this model's 3 MiB of experts is under
    the 16 MiB floor a confined process needs, and is refused.)"""
    _require_fuse()
    _require_cgroup()
    model = _private_model(tmp_path)
    argv = [str(model), "--memory-limit", "64MiB", "--drive", "native,nvme", "--rounds", "1", "--generate", "8"]
    assert bench_main([*argv, "--json"]) == EXIT_OK
    out = capsys.readouterr()
    doc = json.loads(out.out)
    rows = doc["rows"]
    names = [r["name"] for r in rows]
    assert len(rows) == 24 and names[:2] == ["patched off, native", "patched off, nvme"]
    assert {r["config"]["drive"] for r in rows} == {"native", "nvme"}
    for native, nvme in zip(rows[::2], rows[1::2], strict=True):
        assert nvme["name"] == native["name"].replace(", native", ", nvme")
        assert native["drive_served_bytes"] is None and native["drive_cpu_s"] is None
        assert nvme["drive_served_bytes"] > 0 and nvme["drive_cpu_s"] is not None and nvme["drive_cpu_s"] >= 0
        assert nvme["drive_decode_cpu_s"] is not None and nvme["median_tok_s"] > 0
    assert sum(r["drive_cpu_s"] for r in rows[1::2]) > 0
    rec = doc["drives"]["nvme"]
    assert rec["emulated"] and rec["max_read"] == NVME.max_read and rec["read_ahead_kb"] > 0
    assert len(rec["runs"]) == 12 and all(r["after"]["bytes"] > r["before"]["bytes"] for r in rec["runs"])
    assert "onebit-bench-" not in rec["emulator_cgroup"]  # outside every run's memory cgroup
    assert doc["drives"]["native"] == {"emulated": False, "path": str(model)}
    assert not mounted_at(Path(rec["mountpoint"])) and not Path(rec["mountpoint"]).exists()
    (tmp_path / "r.json").write_text(out.out)
    back = load_measured(tmp_path / "r.json")
    assert [r.drive for r in back.rows] == ["native", "nvme"] * 12
