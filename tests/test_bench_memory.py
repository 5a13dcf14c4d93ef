"""onebit-bench --memory-limit: the limits it takes, the cgroup it makes (or why it cannot), and one
real run of every configuration confined to a memory cgroup."""

from __future__ import annotations

import json
import mmap
import os
import shutil
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from onebit_predict.checks import bench_memory, rounds
from onebit_predict.checks.bench import configs
from onebit_predict.checks.bench_memory import (
    ORACLE,
    RESIDENT,
    MemoryRow,
    OracleMismatch,
    check_oracle,
    markdown_memory,
    measure_memory,
    memory_configs,
    require_odd_rounds,
)
from onebit_predict.checks.memory_limits import limit_bytes
from onebit_predict.checks.rounds import BenchOptions, Config, Sample, read_through, run_one
from onebit_predict.commands.bench import main as bench_main
from onebit_predict.constants import ENV_OUT, EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, TRACE_RAM_DIR
from onebit_predict.costmodel.measured import load_measured
from onebit_predict.costmodel.row_config import RowConfig
from onebit_predict.llama import cgroup, evict, read_ahead
from onebit_predict.llama.cgroup import CgroupError, MemoryCgroup, drop_from_page_cache
from onebit_predict.llama.drive import DriveFigures
from onebit_predict.llama.evict import EvictionNotHeld, expert_spans, require_evicted, resident_expert_bytes
from onebit_predict.trace import TraceHeader
from onebit_predict.trace_writer import TraceWriter

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "qwen3moe-tiny.gguf"


def test_limits_are_shares_of_the_expert_bytes_or_sizes():
    assert limit_bytes(["50%", "25%"], 1 << 30) == [1 << 29, 1 << 28]
    assert limit_bytes(["resident", "50%"], 1 << 30) == [RESIDENT, 1 << 29]
    assert limit_bytes(["160MiB"], 1 << 30) == [160 << 20]
    for bad in ("half", "5%"):  # not a limit; 5 % of 256 MiB is under the 16 MiB a process needs
        with pytest.raises(ValueError):
            limit_bytes([bad], 256 << 20)


@pytest.mark.parametrize(
    "limits, message",
    [
        (
            "150%",
            "'150%': a limit is a share above 0 and below 100 % of the expert bytes (or 'resident', for no limit)",
        ),
        ("100%", "'100%': a limit is a share above 0 and below 100 %"),
        ("50%,inf%", "'inf%': a limit is a share above 0 and below 100 %"),
        ("0%", "'0%': a limit is a share above 0"),
        ("50%,resident,50%", "gives 50% twice (each value is a run of its own)"),
        ("resident,resident", "gives resident twice"),
        ("64MiB,67108864", "'67108864' is 67108864 bytes, given twice (each limit is a run of its own)"),
    ],
)
def test_a_limit_is_below_the_expert_bytes_and_given_once(limits, message, monkeypatch, capsys):
    """150 % of the experts is no limit (the report called it one); a limit given twice ran every row
    twice. Both exit 2, one line, before the build is looked for."""

    def no_build():
        raise AssertionError("the build was looked for")

    monkeypatch.setattr("onebit_predict.commands.bench.build_info", no_build)
    assert bench_main([str(MODEL), "--memory-limit", limits]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err, err


def test_no_cgroup_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroup, "ROOT", tmp_path)  # neither v1 memory/ nor a v2 memory controller
    monkeypatch.setattr(cgroup.os, "geteuid", lambda: 0)
    with pytest.raises(CgroupError, match="no memory cgroup controller"):
        MemoryCgroup("x", 64 << 20)
    monkeypatch.setattr(cgroup.os, "geteuid", lambda: 1000)
    with pytest.raises(CgroupError, match="needs root"):
        MemoryCgroup("x", 64 << 20)


def test_v2_cgroup_gets_memory_max(tmp_path, monkeypatch):
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    monkeypatch.setattr(cgroup, "ROOT", tmp_path)
    monkeypatch.setattr(cgroup.os, "geteuid", lambda: 0)
    group = MemoryCgroup("run", 64 << 20)
    assert (tmp_path / "run" / "memory.max").read_text() == str(64 << 20)
    (tmp_path / "run" / "memory.max").unlink()  # a real cgroup's files vanish with it
    group.remove()
    assert not (tmp_path / "run").exists()


def test_cold_and_memory_limit_are_two_settings(capsys):
    assert bench_main([str(MODEL), "--cold", "--memory-limit", "50%"]) == EXIT_USAGE
    assert "give one" in capsys.readouterr().err


def test_table_has_a_row_per_configuration_and_limit(tmp_path):
    names = [c.name for c in memory_configs(tmp_path, 16)]
    assert names == ["patched off", "router", "router + advise", "router + read", "block", "block + advise",
                     "block + read", "block + advise, guard 4", "block + advise, room 0", "block + advise, depth 16",
                     "block + advise, depth 16, room 0", "oracle + advise"]  # fmt: skip
    # never a loss compares each consumer with the same predictor, consumer off
    offs = [c.config.consumer_off().name for c in memory_configs(tmp_path, 16)]
    assert offs == ["patched off", "router", "router", "router", "block", "block",
                    "block", "block", "block", "block", "block", "router"]  # fmt: skip
    # the qualifiers are what the configurations run with; each name is its configuration's
    env = {c.name: c.env for c in memory_configs(tmp_path, 16)}
    assert all(c.name == c.config.name for c in memory_configs(tmp_path, 16))
    assert memory_configs(tmp_path, 16)[-2].config == RowConfig("block", "advise", depth=16, room=0.0)
    assert len({c.env["ONEBIT_MOE_PREDICT_OUT"] for c in memory_configs(tmp_path, 16)}) == len(names)
    assert env["block + advise, guard 4"]["ONEBIT_MOE_PREFETCH_GUARD"] == "4"
    assert env["block + advise, room 0"]["ONEBIT_MOE_PREFETCH_ROOM"] == "0"
    assert env["block + advise, depth 16, room 0"]["ONEBIT_MOE_PREDICT_DEPTH"] == "16"
    assert "ONEBIT_MOE_PREFETCH_ROOM" not in env["block + advise"]  # the default: the rule on
    row = MemoryRow(64 << 20, "block + advise", 2.0, 1.5, 2.5, 1.25, 1.1, 3.5, 40.0, 0.2, 0.8, 0.8, 5, 1 << 20, 0, 0, 0)
    resident = MemoryRow(RESIDENT, "block + advise", 9.0, 9.0, 9.0, 1.0, 0.995, 0, 0, 0, 0.8, 0.8, 5, 1 << 20, 0, 0, 0)
    text = markdown_memory([row, resident], "header")
    assert (
        "| 64 | block + advise | 2.00 | 1.50 | 2.50 | 1.250 | 1.100 | 3.50 | 40.0 | 20.0% | 80.0% | 5 | 1.0 | 0.0 | 0 |"
        in text
    )
    assert "| resident | block + advise | 9.00 |" in text
    assert row.config == RowConfig()  # the default; measure_memory writes each row's


def test_every_report_row_carries_its_configuration(tmp_path):
    """The report's rows (asdict of MemoryRow) carry the configuration's fields and its env, and
    costmodel/measured.py reads the configuration back from them, and the readahead each row ran at."""
    from dataclasses import asdict

    rows = []
    for c in memory_configs(tmp_path, 16):
        env = {k: v for k, v in c.env.items() if k != "ONEBIT_MOE_PREDICT_OUT"}
        rows.append(MemoryRow(64 << 20, c.name, 2.0, 1.5, 2.5, 1.0, 1.0, 3.5, 40.0, 0.2, None, None, 0, 0, 0, 0, 0, env,
                              c.config))  # fmt: skip
    report = {"memory_limits": [64 << 20], "rows": [asdict(r) for r in rows]}
    assert report["rows"][-1]["config"] == {"predictor": "router", "consumer": "advise", "oracle": True,
                                            "route": False, "random": False, "ahead": None, "depth": None,
                                            "guard": None, "room": None, "workers": None, "read_ahead_kb": None,
                                            "drive": None, "wait": None, "keep": None, "order": None,
                                            "layers": None, "handback": None, "copy": None}  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps(report))
    back = load_measured(tmp_path / "r.json")
    assert back.knobs_recorded and [r.config for r in back.rows] == [c.config for c in memory_configs(tmp_path, 16)]
    # no read_ahead_kb recorded: unknown, whatever this machine's is
    assert back.read_ahead_kb is None and {r.read_ahead_kb for r in back.rows} == {None} and back.device is None
    # recorded once for the run (the device's, as found): every row ran at it
    device = {"name": "vda", "read_ahead_kb": 8192}
    (tmp_path / "r.json").write_text(json.dumps(report | {"drive": {"read_ahead_kb": 8192}, "device": device}))
    back = load_measured(tmp_path / "r.json")
    assert back.read_ahead_kb == 8192 and {r.read_ahead_kb for r in back.rows} == {8192} and back.device == device


def test_oracle_configuration_reads_the_recorded_trace(tmp_path):
    oracle = next(c for c in memory_configs(tmp_path, 16) if c.name == ORACLE)
    assert oracle.env["ONEBIT_MOE_PREFETCH_DEBUG_ORACLE"] == str(tmp_path / "oracle-source.bin")
    assert oracle.env["ONEBIT_MOE_PREFETCH_GUARD"] == "0" and oracle.env["ONEBIT_MOE_PREFETCH"] == "advise"
    assert oracle.env["ONEBIT_MOE_PREFETCH_ROOM"] == "0"  # the upper bound: issued whatever the room


def _trace(path, routes):
    header = TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=2, depth=2)
    with TraceWriter(path, header) as w:
        for pos, (a, b) in enumerate(routes):
            w.add(step=pos, seq_id=0, pos=pos, layer=0, actual=a)
            w.add(step=pos, seq_id=0, pos=pos, layer=1, actual=b)
    return path


def test_oracle_run_must_route_as_its_source(tmp_path):
    source = _trace(tmp_path / "s.bin", [([0, 1], [2, 3]), ([1, 2], [0, 3])])
    check_oracle(source, _trace(tmp_path / "same.bin", [([0, 1], [2, 3]), ([1, 2], [0, 3])]))
    with pytest.raises(OracleMismatch, match="1 routed differently"):
        check_oracle(source, _trace(tmp_path / "other.bin", [([0, 1], [2, 3]), ([1, 2], [0, 1])]))
    with pytest.raises(OracleMismatch, match="2 row"):
        check_oracle(source, _trace(tmp_path / "longer.bin", [([0, 1], [2, 3]), ([1, 2], [0, 3]), ([0, 1], [2, 3])]))


def _private_model(tmp_path: Path) -> Path:
    """A copy of the tiny model no other process maps (another test's run would keep its pages resident)."""
    model = tmp_path / "qwen3moe-tiny.gguf"
    shutil.copyfile(MODEL, model)
    return model


@contextmanager
def _resident(path: Path):
    """path's pages in the page cache and mapped here, where no drop can take them (another process using the model)."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        m.read()  # every page faulted in through the mapping
        yield


def _require_cgroup() -> None:
    try:
        MemoryCgroup("onebit-test-probe", 64 << 20).remove()
    except CgroupError as e:
        pytest.skip(f"no memory cgroup here: {e}")


def test_a_learned_row_needs_its_sidecar(monkeypatch, capsys, tmp_path):
    """A learned row of --rows without --learned, or with a file that does not exist, is exit 2 before the
    build is looked for; with it, the row's environment names the sidecar."""

    def no_build():
        raise AssertionError("the build was looked for")

    monkeypatch.setattr("onebit_predict.commands.bench.build_info", no_build)
    argv = [str(MODEL), "--memory-limit", "64MiB", "--rows", "learned + read + route"]
    for extra in ([], ["--learned", str(tmp_path / "missing.gguf")]):
        assert bench_main([*argv, *extra]) == EXIT_USAGE
        assert "needs --learned FILE" in capsys.readouterr().err
    sidecar = tmp_path / "s.gguf"
    sidecar.write_bytes(b"x")
    plans = memory_configs(tmp_path, 4, rows=("learned + read + route",), learned=sidecar)
    assert (
        plans[1].env["ONEBIT_MOE_PREDICT_LEARNED"] == str(sidecar) and "ONEBIT_MOE_PREDICT_LEARNED" not in plans[0].env
    )
    with pytest.raises(ValueError, match="needs the learned predictor's sidecar"):
        memory_configs(tmp_path, 4, rows=("learned + read + route",))


def test_memory_limit_takes_odd_rounds(monkeypatch, capsys, tmp_path):
    """With 2 rounds the median is the mean: one warm run moved every ratio (issue 23). Refused, exit 2,
    before the build is looked for; the measurement refuses it too."""

    def no_build():
        raise AssertionError("the build was looked for")

    monkeypatch.setattr("onebit_predict.commands.bench.build_info", no_build)
    for n in ("2", "4"):
        assert bench_main([str(MODEL), "--memory-limit", "64MiB", "--rounds", n]) == EXIT_USAGE
        assert f"--memory-limit takes an odd --rounds (not {n})" in capsys.readouterr().err
    require_odd_rounds(3)
    with pytest.raises(ValueError, match="odd --rounds"):
        require_odd_rounds(2)

    def no_run(*a, **k):
        raise AssertionError("a worker ran")

    monkeypatch.setattr(bench_memory, "run_one", no_run)
    monkeypatch.setattr(bench_memory, "collect", no_run)
    with pytest.raises(ValueError, match="odd --rounds"):
        measure_memory(MODEL, memory_configs(tmp_path, 4), tmp_path, BenchOptions(rounds=2), [64 << 20], 1000.0)


def test_each_configuration_at_each_read_ahead_side_by_side(tmp_path):
    plans = memory_configs(tmp_path, 16, [128, 8192])
    base = memory_configs(tmp_path, 16)
    assert len(plans) == 2 * len(base)
    for i, b in enumerate(base):
        for j, kb in enumerate((128, 8192)):
            p = plans[2 * i + j]
            assert p.config == replace(b.config, read_ahead_kb=kb) and p.run.read_ahead_kb == kb
            assert p.name == f"{b.name}, readahead {kb}" and p.name == p.config.name
            assert {k: v for k, v in p.env.items() if k != "ONEBIT_MOE_PREDICT_OUT"} == {
                k: v for k, v in b.env.items() if k != "ONEBIT_MOE_PREDICT_OUT"
            }  # the drive is set on the device, not in the environment
    assert len({p.env["ONEBIT_MOE_PREDICT_OUT"] for p in plans}) == len(plans)
    assert all(b.run.read_ahead_kb is None for b in base)


def test_ratios_compare_at_the_same_read_ahead(tmp_path, monkeypatch):
    """vs patched off and vs consumer off: the baseline at the row's own read_ahead_kb; every oracle row's
    routing checked against the recorded trace."""
    rows = [RowConfig(), RowConfig("block"), RowConfig("block", "advise"), RowConfig("router", "advise", oracle=True)]
    monkeypatch.setattr(bench_memory, "memory_rows", lambda n: rows)
    plans = memory_configs(tmp_path, 4, [128, 8192])
    speed = {"patched off": 10.0, "block": 9.0, "block + advise": 8.0, "oracle + advise": 12.0}
    checked = []

    def collect(model, runs, lib, pristine, opts):
        assert opts.memory_limit == 64 << 20 and [r.read_ahead_kb for r in runs] == [128, 8192] * 4
        out = {}
        for r in runs:
            kb = r.read_ahead_kb
            tok_s = speed[r.name.rsplit(", readahead", 1)[0]] * (3 if kb == 128 else 1)
            out[r.name] = [Sample(tok_s * f, 0.0, 2, None, 1 << 20, 4, 1.0) for f in (0.9, 1.0, 1.1)]
        return out

    monkeypatch.setattr(bench_memory, "run_one", lambda *a, **k: None)  # the oracle's source
    monkeypatch.setattr(bench_memory, "collect", collect)
    monkeypatch.setattr(bench_memory, "check_oracle", lambda source, run: checked.append(run.name))
    monkeypatch.setattr(bench_memory, "trace_figures", lambda path: (None, None, 0, 0, 0, 0, 0))
    rows = measure_memory(MODEL, plans, tmp_path, BenchOptions(rounds=3), [64 << 20], 1000.0)
    got = {r.name: (round(r.ratio_to_off, 6), round(r.ratio_to_consumer_off, 6)) for r in rows}
    for kb in (128, 8192):
        assert got[f"patched off, readahead {kb}"] == (1.0, 1.0)
        assert got[f"block, readahead {kb}"] == (0.9, 1.0)
        assert got[f"block + advise, readahead {kb}"] == (0.8, round(8 / 9, 6))
        assert got[f"oracle + advise, readahead {kb}"] == (1.2, 1.0)  # router, consumer off: not run here
    assert sorted(checked) == ["oracle-advise-readahead-128.bin", "oracle-advise-readahead-8192.bin"]
    assert [r.config.read_ahead_kb for r in rows] == [128, 8192] * 4


def test_a_copy_of_off_measures_the_spread_of_identical_runs(tmp_path, monkeypatch):
    """The A/A control: ``patched off, copy 2`` runs as a row of its own, with its own trace, and its
    ``vs patched off`` is its median over the first copy's; every other row is still taken against the first."""
    rows = [RowConfig(), RowConfig(copy=2), RowConfig(route=True)]
    monkeypatch.setattr(bench_memory, "memory_rows", lambda n: rows)
    plans = memory_configs(tmp_path, 4)
    assert len({p.run.env[ENV_OUT] for p in plans}) == 3  # a trace each
    speed = {"patched off": 10.0, "patched off, copy 2": 9.5, "route": 12.0}

    def collect(model, runs, lib, pristine, opts):
        return {
            r.name: [Sample(speed[r.name] * f, 0.0, 2, None, 1 << 20, 4, 1.0) for f in (0.9, 1.0, 1.1)] for r in runs
        }

    monkeypatch.setattr(bench_memory, "collect", collect)
    monkeypatch.setattr(bench_memory, "trace_figures", lambda path: (None, None, 0, 0, 0, 0, 0))
    got = {
        r.name: r.ratio_to_off for r in measure_memory(MODEL, plans, tmp_path, BenchOptions(rounds=3), [64 << 20], 1e3)
    }
    assert got == pytest.approx({"patched off": 1.0, "patched off, copy 2": 0.95, "route": 1.2})


def test_the_eviction_check_refuses_a_warm_run(tmp_path, monkeypatch):
    """Before the first token of a confined run no expert page of the model may be resident (mincore):
    a run whose pages are resident is refused, naming the row and the bytes, before a worker starts."""
    model = _private_model(tmp_path)
    spans = expert_spans(model)  # read apart: parsing the header reads pages in around it

    def no_worker(*a, **k):
        raise AssertionError("a worker was started")

    monkeypatch.setattr(rounds, "worker_json", no_worker)
    opts = BenchOptions(rounds=1, memory_limit=64 << 20)
    # another process holds the model mapped: no drop takes its pages
    with _resident(model):
        assert resident_expert_bytes(model, spans) == sum(s.size for s in spans)
        with pytest.raises(EvictionNotHeld, match=r"^block \+ advise: \d+ bytes \(.* resident before its first token"):
            run_one(model, Config("block + advise", {}), tmp_path, opts)
        with pytest.raises(EvictionNotHeld, match=r"pid \d+, in its memory cgroup: \d+ bytes"):
            drop_from_page_cache(model)  # the worker's own check, once it has joined its cgroup
    # the file read into the page cache just before the check, by a drop that did not hold
    read_through(model)
    monkeypatch.setattr(evict, "drop_file", read_through)
    with pytest.raises(EvictionNotHeld, match="patched off: "):
        require_evicted(model, "patched off", tries=2, wait_s=0.0)
    monkeypatch.undo()
    # read in but not held: the drop holds, and nothing is left
    read_through(model)
    require_evicted(model, "patched off")
    assert resident_expert_bytes(model, spans) == 0


def test_a_refused_run_is_exit_1(tmp_path, monkeypatch, capsys):
    model = _private_model(tmp_path)
    monkeypatch.setattr(rounds, "worker_json", lambda *a, **k: pytest.fail("a worker was started"))
    monkeypatch.setattr(bench_memory, "run_one", lambda *a, **k: None)  # no oracle source run
    monkeypatch.setattr("onebit_predict.llama.drive.measure_drive", lambda d: DriveFigures("/", 1000.0, 50.0))
    monkeypatch.setattr("onebit_predict.llama.cgroup.MemoryCgroup", _NoGroup)
    monkeypatch.setattr("onebit_predict.commands.bench.build_info", lambda: _Build(tmp_path))
    with _resident(model):
        assert bench_main([str(model), "--memory-limit", "64MiB", "--rounds", "1"]) == EXIT_CHECK_FAILED
    err = capsys.readouterr().err
    assert "patched off: " in err and "expert pages resident before its first token" in err


class _NoGroup:
    def __init__(self, name, limit):
        self.path = Path("/nonexistent")

    def remove(self):
        pass


class _Build:
    def __init__(self, lib):
        self.lib_dir = lib


@pytest.mark.needs_build
def test_a_run_whose_pages_are_resident_is_refused(tmp_path, monkeypatch, capsys):
    """The real run, on the tiny model under a cgroup: the model held resident by this process, the
    first confined row ("patched off", round 1) is refused, exit 1, with its resident bytes: by the
    bench before the worker starts, and by the worker once it has joined its cgroup."""
    _require_cgroup()
    model = _private_model(tmp_path)
    argv = [str(model), "--memory-limit", "64MiB", "--rounds", "1", "--generate", "2", "--prompt", "4"]
    with _resident(model):
        assert bench_main(argv) == EXIT_CHECK_FAILED
    err = capsys.readouterr().err
    assert "patched off: " in err and "bytes" in err and "resident before its first token" in err, err[-2000:]
    # the worker's own check, once it has joined its cgroup (the bench's own check skipped here)
    monkeypatch.setattr(evict, "require_evicted", lambda *a, **k: None)
    with _resident(model):
        assert bench_main(argv) == EXIT_CHECK_FAILED
    err = capsys.readouterr().err
    assert "patched off: the worker failed" in err and "in its memory cgroup: " in err, err[-2000:]
    assert "resident before its first token" in err


@pytest.mark.needs_build
def test_each_configuration_runs_at_each_read_ahead(tmp_path, monkeypatch, capsys):
    """--read-ahead-kb on a stand-in for the device's file (a temporary sysfs tree, never the real one):
    each configuration at each value side by side in one report, the value set before each run and
    the one found restored after, both logged; the device recorded."""
    _require_cgroup()
    model = _private_model(tmp_path)
    dev = os.stat(model).st_dev
    disk = tmp_path / "sys" / "devices" / "virtual" / "block" / "vdz"  # the stand-in sysfs tree
    (disk / "queue").mkdir(parents=True)
    ra = disk / "queue" / "read_ahead_kb"
    ra.write_text("4096\n")
    (tmp_path / "sys" / "dev" / "block").mkdir(parents=True)
    (tmp_path / "sys" / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(disk)
    monkeypatch.setattr(read_ahead, "SYS", tmp_path / "sys")
    monkeypatch.setattr(
        bench_memory, "memory_rows", lambda n: [RowConfig(), RowConfig("router", "advise", oracle=True)]
    )
    seen = []
    real_run_one = rounds.run_one

    def run_one_seen(model, cfg, lib, opts):
        got = real_run_one(model, cfg, lib, opts)
        seen.append((cfg.name, int(ra.read_text())))
        return got

    monkeypatch.setattr(rounds, "run_one", run_one_seen)
    argv = [str(model), "--memory-limit", "64MiB", "--rounds", "1", "--generate", "2", "--prompt", "4"]
    assert bench_main([*argv, "--read-ahead-kb", "128,256", "--json"]) == EXIT_OK
    out = capsys.readouterr()
    doc = json.loads(out.out)
    assert ra.read_text() == "4096\n"
    assert "read_ahead_kb of vdz set to 128 (found 4096" in out.err and "set to 256" in out.err
    assert "read_ahead_kb of vdz restored to 4096" in out.err
    names = ["patched off, readahead 128", "patched off, readahead 256", "oracle + advise, readahead 128",
             "oracle + advise, readahead 256"]  # fmt: skip
    assert [r["name"] for r in doc["rows"]] == names
    assert [r["config"]["read_ahead_kb"] for r in doc["rows"]] == [128, 256, 128, 256]
    assert dict(seen) == {n: int(n.rsplit(" ", 1)[1]) for n in names}  # each ran at its own value
    assert doc["read_ahead_kb"] == [128, 256] and "read_ahead_kb" not in doc["drive"]
    assert doc["device"]["name"] == "vdz" and doc["device"]["read_ahead_kb"] == 4096
    assert doc["rows"][0]["ratio_to_off"] == doc["rows"][1]["ratio_to_off"] == 1.0
    (tmp_path / "r.json").write_text(out.out)
    back = load_measured(tmp_path / "r.json")
    assert [r.read_ahead_kb for r in back.rows] == [128, 256, 128, 256] and back.read_ahead_kb is None


def test_the_rows_traces_are_written_in_memory(tmp_path, monkeypatch, capsys, caplog):
    """A confined worker writes its trace inside its cgroup: the traces lie on a memory filesystem
    (/dev/shm), not the temp dir's disk, where under cgroup v1 their dirty pages paused the run's
    reclaim 100 ms at a time. Where there is none, the run says so and uses the temp dir."""
    _require_cgroup()
    if evict.filesystem_type(Path(TRACE_RAM_DIR)) not in evict.MEMORY_FILESYSTEMS:
        pytest.skip(f"{TRACE_RAM_DIR} is not a memory filesystem here")
    model = _private_model(tmp_path)
    monkeypatch.setattr(bench_memory, "memory_rows", lambda n: [RowConfig()])
    where = []
    real_run_one = rounds.run_one

    def run_one_seen(model, cfg, lib, opts):
        where.append(evict.filesystem_type(Path(cfg.env[ENV_OUT]).parent))
        return real_run_one(model, cfg, lib, opts)

    monkeypatch.setattr(rounds, "run_one", run_one_seen)
    argv = [str(model), "--memory-limit", "64MiB", "--rounds", "1", "--generate", "2", "--prompt", "4", "--json"]
    assert bench_main(argv) == EXIT_OK
    assert where and set(where) <= set(evict.MEMORY_FILESYSTEMS), where
    assert "no memory filesystem" not in capsys.readouterr().err
    disk = tmp_path / "not-ram"
    disk.mkdir()
    if evict.filesystem_type(disk) not in evict.MEMORY_FILESYSTEMS:
        assert bench_memory.trace_base(disk) is None
        assert f"no memory filesystem at {disk}" in caplog.text
    assert bench_memory.trace_base(Path(TRACE_RAM_DIR)) == Path(TRACE_RAM_DIR)


@pytest.mark.needs_build
def test_route_rows_measure_what_the_routed_experts_lacked(tmp_path, capsys):
    """--rows by name: route time alone and with a prediction run side by side with off; a route row
    reports the bytes per token its routed experts lacked when routed (the floor), others none."""
    _require_cgroup()
    model = _private_model(tmp_path)
    rows = "route; block + read + route, workers 4"
    argv = [str(model), "--memory-limit", "64MiB", "--rounds", "1", "--generate", "4", "--prompt", "8", "--json"]
    assert bench_main([*argv, "--rows", rows]) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    got = {r["name"]: r for r in doc["rows"]}
    assert list(got) == ["patched off", "route", "block + read + route, workers 4"]
    assert got["patched off"]["route_missing_per_token"] is None
    for name in ("route", "block + read + route, workers 4"):
        assert got[name]["route_missing_per_token"] is not None and got[name]["route_missing_per_token"] >= 0
        assert got[name]["env"]["ONEBIT_MOE_PREFETCH_ROUTE"] == "1"
    assert RowConfig.from_fields(got["route"]["config"]) == RowConfig(route=True)
    assert bench_main([*argv, "--rows", "route + route"]) == EXIT_USAGE
    assert "--rows: 'route + route'" in capsys.readouterr().err


@pytest.mark.needs_build
def test_each_row_says_where_its_tokens_time_went(tmp_path, capsys):
    """A real run on the tiny model with one compute thread: each row's compute (the decoding thread's CPU)
    and waiting add up to its token's wall time, its reads are counted on the model's device (where the
    temporary directory has one), and route's expert-level hit rate is a share (off has none). The route
    row runs without the room rule (room 0): at a readahead of 8192 KiB the rule holds route off under any
    limit on this model, and a route op held off looks at nothing (no hit rate)."""
    _require_cgroup()
    model = _private_model(tmp_path)
    argv = [str(model), "--memory-limit", "64MiB", "--rounds", "1", "--generate", "8", "--prompt", "8",
            "--threads", "1", "--rows", "route, room 0", "--json"]  # fmt: skip
    assert bench_main(argv) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    got = {r["name"]: r for r in doc["rows"]}
    assert list(got) == ["patched off", "route, room 0"]
    for name, r in got.items():
        d = r["decode"]
        wall_ms = 1e3 / r["median_tok_s"]  # one round: the run's own
        assert d["compute_basis"] == "thread" and 0 < d["compute_ms"] <= 1.01 * wall_ms, (name, d, wall_ms)
        assert d["compute_ms"] + d["wait_ms"] == pytest.approx(wall_ms, rel=0.10), (name, d, wall_ms)
        # the calling thread computes a one-thread graph: its clock sees the compute, not ~0 (some other thread's)
        assert d["compute_ms"] >= 0.1 * wall_ms, (name, d, wall_ms)
        if doc["device"] is not None:  # the model's block device: its /proc/diskstats line
            assert d["requests_from"].startswith("diskstats ") and d["requests"] >= 0, d
            assert d["in_flight"] >= 0 and 0 <= d["busy"] <= 1.05 and d["request_kib_largest_is"] == "max_sectors_kb"
            assert d["request_kib_mean"] is None if d["requests"] == 0 else d["request_kib_mean"] > 0
    route = got["route, room 0"]["decode"]
    assert got["patched off"]["decode"]["expert_hit"] is None and got["patched off"]["decode"]["room_mib"] is None
    assert route["expert_hit"] is not None and 0.0 <= route["expert_hit"] <= 1.0, route
    assert route["room_mib"] is None and route["room_need_mib"] > 0  # the rule off: its room unknown (-1)
    back = load_measured(_write(tmp_path / "r.json", doc))
    assert back.rows[1].decode.expert_hit == route["expert_hit"]


def _write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path


@pytest.mark.needs_build
def test_every_configuration_runs_in_a_cgroup(tmp_path, capsys):
    _require_cgroup()
    model = _private_model(tmp_path)
    argv = [str(model), "--memory-limit", "64MiB", "--rounds", "1", "--generate", "4", "--prompt", "8", "--json"]
    assert bench_main(argv) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["memory_limits"] == [64 << 20] and len(doc["rows"]) == 12
    if doc["device"] is not None:  # the model's drive, and the readahead every row ran at, recorded
        assert doc["drive"]["read_ahead_kb"] == doc["device"]["read_ahead_kb"] and doc["read_ahead_kb"] is None
    for row in doc["rows"]:
        assert row["median_tok_s"] > 0 and row["read_mib_per_token"] >= 0
        assert (row["read_recall"] is None) == (row["name"] == "patched off")
        # each row carries the knobs it ran with, for the cost model (simulate --measured): its
        # configuration's fields, and their environment
        assert "ONEBIT_MOE_PREDICT_OUT" not in row["env"]
        config = RowConfig.from_fields(row["config"])
        oracle = row["env"].get("ONEBIT_MOE_PREFETCH_DEBUG_ORACLE")
        assert config.name == row["name"] and config.env(oracle) == row["env"]
        assert (row["env"].get("ONEBIT_MOE_PREFETCH_ROOM") == "0") == (
            row["name"].endswith("room 0") or row["name"] == "oracle + advise"
        )


def test_a_compensator_goes_to_every_row(capsys, tmp_path):
    """--compensator FILE: a missing file, or --cold, is exit 2 before any work; with --memory-limit every
    row (the predictor off included) runs with ONEBIT_MOE_COMPENSATOR set to it; warm, it is one more row."""
    missing = tmp_path / "missing.gguf"
    assert bench_main([str(MODEL), "--memory-limit", "64MiB", "--compensator", str(missing)]) == EXIT_USAGE
    assert "no such file" in capsys.readouterr().err
    sidecar = tmp_path / "comp.gguf"
    sidecar.write_bytes(b"GGUF")
    assert bench_main([str(MODEL), "--cold", "--compensator", str(sidecar)]) == EXIT_USAGE
    assert "not of --cold" in capsys.readouterr().err
    warm = configs(tmp_path, "1-2", sidecar)
    assert [c.name for c in warm][-1] == "compensator" and warm[-1].env == {"ONEBIT_MOE_COMPENSATOR": str(sidecar)}
    assert all("ONEBIT_MOE_COMPENSATOR" not in c.env for c in warm[:-1])
    assert "compensator" not in [c.name for c in configs(tmp_path, "1-2")]
    plans = memory_configs(tmp_path, 4, rows=("route",), compensator=sidecar)
    assert [p.name for p in plans] == ["patched off", "route"]
    assert all(p.env["ONEBIT_MOE_COMPENSATOR"] == str(sidecar) for p in plans)
    assert all("ONEBIT_MOE_COMPENSATOR" not in p.env for p in memory_configs(tmp_path, 4, rows=("route",)))
