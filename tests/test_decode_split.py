"""Where each decoded token's time goes (issue 30): the /proc/diskstats parser and the model's device,
the worker's read counter, the compute/waiting split and the expert-level hit rate, their medians
over the rounds, the memory report's columns and ``decode`` object, and old reports still loading."""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from onebit_predict.checks import bench_memory, worker
from onebit_predict.checks.bench_memory import MemoryRow, markdown_memory, measure_memory
from onebit_predict.checks.decode_columns import DECODE_COLUMNS, decode_cells
from onebit_predict.checks.rounds import (
    BenchOptions,
    Sample,
    decode_split,
    expert_hit_rate,
    run_split,
    split_ms,
)
from onebit_predict.constants import COMPUTE_PROCESS, COMPUTE_THREAD, LARGEST_CAP, LARGEST_SEEN
from onebit_predict.costmodel.measured import DecodeSplit, load_measured
from onebit_predict.costmodel.row_config import RowConfig
from onebit_predict.llama import read_ahead
from onebit_predict.llama.diskstats import (
    DiskStats,
    ModelDisk,
    ReadRequests,
    model_disk,
    parse_diskstats,
    read_diskstats,
)

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "qwen3moe-tiny.gguf"
MIB = 2**20

# a made-up /proc/diskstats: major minor name, then reads, merged, sectors, ms reading, writes, merged,
# sectors, ms writing, in progress, io_ticks, weighted ms (and the discard and flush fields of newer kernels)
DISKSTATS = """\
   7       0 loop0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0 0
 254       0 vdz 1000 50 256000 3000 10 0 80 20 0 2500 3100 0 0 0 0 2 1
 254       1 vdz1 900 40 230400 2800 10 0 80 20 0 2400 2900
   8       0 old 1 2 3 4
 253       0 junk a b c d e f g h i j k
"""


def test_the_diskstats_parser_takes_the_fields_by_number(tmp_path):
    stats = parse_diskstats(DISKSTATS)
    assert set(stats) == {"loop0", "vdz", "vdz1"}  # a line without field 11, or not numbers, is skipped
    assert stats["vdz"] == DiskStats("vdz", 1000, 256000, 3000, 2500, 3100)
    assert stats["vdz1"] == DiskStats("vdz1", 900, 230400, 2800, 2400, 2900)
    f = tmp_path / "diskstats"
    f.write_text(DISKSTATS)
    assert read_diskstats(("vdz1", "vdz"), f).name == "vdz1"  # a partition's own line first
    assert read_diskstats(("vdz9", "vdz"), f).name == "vdz"  # ... else its disk's
    assert read_diskstats(("sda",), f) is None
    assert read_diskstats(("vdz",), tmp_path / "missing") is None
    later = DiskStats("vdz", 1100, 256000 + 2048 * 100, 3500, 2900, 3900)
    assert later.minus(stats["vdz"]) == DiskStats("vdz", 100, 204800, 500, 400, 800)


def test_requests_in_flight_busy_and_size_from_the_counts():
    """100 reads of 1 MiB (2048 sectors each) in 2 s of wall: 1024 KiB each, 5 ms each; 800 weighted ms over
    2000 ms: 0.4 in flight; io_ticks 400 ms: busy 20 %; the largest possible: the queue's cap."""
    r = ReadRequests.of_disk(DiskStats("vdz", 100, 204800, 500, 400, 800), 2.0, 1280)
    assert r.source == "diskstats vdz" and r.requests == 100 and r.bytes == 100 * MIB
    assert r.mean_bytes == MIB and r.mean_ms == pytest.approx(5.0)
    assert r.in_flight == pytest.approx(0.4) and r.busy == pytest.approx(0.2)
    assert (r.largest_bytes, r.largest_is) == (1280 * 1024, LARGEST_CAP)
    none = ReadRequests.of_disk(DiskStats("vdz", 0, 0, 0, 0, 0), 2.0, None)
    assert none.mean_bytes is None and none.mean_ms is None and none.largest_bytes is None and none.busy == 0.0
    emulated = ReadRequests("emulated", 10, 10 * 131072, 1.0, 131072, LARGEST_SEEN)
    assert emulated.in_flight is None and emulated.busy is None and emulated.mean_ms is None


def _sysfs(root: Path, target: Path, partition: bool = True, cap: int | None = 512) -> None:
    """A sysfs tree in which target's st_dev is vdz1 of vdz (vdz itself without ``partition``)."""
    dev = os.stat(target).st_dev
    disk = root / "devices" / "virtual" / "block" / "vdz"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "read_ahead_kb").write_text("128\n")
    if cap is not None:
        (disk / "queue" / "max_sectors_kb").write_text(f"{cap}\n")
    node = disk
    if partition:
        node = disk / "vdz1"
        node.mkdir()
        (node / "partition").write_text("1\n")
    (root / "dev" / "block").mkdir(parents=True)
    (root / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(node)


def test_the_model_disk_is_its_partition_then_its_disk(tmp_path):
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    _sysfs(tmp_path / "sys", model)
    assert model_disk(model, tmp_path / "sys") == ModelDisk(("vdz1", "vdz"), 512)
    _sysfs(tmp_path / "sys2", model, partition=False, cap=None)
    assert model_disk(model, tmp_path / "sys2") == ModelDisk(("vdz",), None)
    assert model_disk(model, tmp_path / "empty") is None  # no block device: tmpfs, FUSE


def test_the_worker_counts_the_reads_over_its_decode(tmp_path, monkeypatch):
    """The worker's counter reads the model's device's line before and after the decode: the difference,
    over the interval's wall time; where the line is gone or there is no device, nothing."""
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    _sysfs(tmp_path / "sys", model)
    monkeypatch.setattr(read_ahead, "SYS", tmp_path / "sys")
    stats = tmp_path / "diskstats"
    stats.write_text(DISKSTATS)
    counter = worker.ReadCounter(model, None, stats)
    counter.start()
    time.sleep(0.01)
    stats.write_text(DISKSTATS.replace("vdz1 900 40 230400 2800", "vdz1 950 40 256000 3300"))
    reads, drive = counter.stop()
    assert drive is None and reads.source == "diskstats vdz1" and reads.requests == 50
    assert reads.bytes == 25600 * 512 and reads.mean_ms == pytest.approx(10.0) and reads.largest_bytes == 512 * 1024
    assert 0.01 <= reads.wall_s < 5.0
    stats.write_text("")
    counter.start()
    assert counter.stop() == (None, None)
    monkeypatch.setattr(read_ahead, "SYS", tmp_path / "nothing")
    counter = worker.ReadCounter(model, None, stats)
    counter.start()
    assert counter.disk is None and counter.stop() == (None, None)


def test_one_thread_is_timed_on_its_own_clock():
    """--threads 1: the calling thread's CPU clock (it computes the graph), which a sleep does not move;
    more threads: the process's, labelled."""
    clock, basis = worker.cpu_clock(1)
    assert basis == COMPUTE_THREAD and clock is time.thread_time
    c0 = clock()
    time.sleep(0.05)
    assert clock() - c0 < 0.02
    assert worker.cpu_clock(2) == (time.process_time, COMPUTE_PROCESS)


def test_the_split_and_the_hit_rate_arithmetic():
    # 10 tokens in 1.0 s of wall, 0.4 s of the thread's CPU: 40 ms compute, 60 ms waiting per token
    assert split_ms(1.0, 0.4, COMPUTE_THREAD, 10) == pytest.approx((40.0, 60.0))
    assert split_ms(1.0, 1.0000001, COMPUTE_THREAD, 10)[1] == 0.0  # clock reads apart: no negative wait
    assert split_ms(1.0, 1.6, COMPUTE_PROCESS, 10) == (pytest.approx(160.0), None)  # two threads: no split
    assert expert_hit_rate(3 * MIB, MIB) == 0.75
    assert expert_hit_rate(0, 5) == 0.0 and expert_hit_rate(5, 0) == 1.0
    assert expert_hit_rate(None, 5) is None and expert_hit_rate(5, None) is None and expert_hit_rate(0, 0) is None


def _sample(tok_s: float, cpu_s: float | None = 0.4, route: bool = True, **extra) -> Sample:
    reads = ReadRequests.of_disk(DiskStats("vdz", 200, 409600, 1000, 500, 1000), 1.0, 1280)
    fields = dict(
        cpu_s=cpu_s,
        cpu_basis=COMPUTE_THREAD,
        others_cpu_s=0.25,
        run_delay_s=0.05,
        reads=reads,
        route_missing_bytes=MIB if route else None,
        route_resident_bytes=3 * MIB if route else None,
        room_bytes=64 * MIB,
        room_need_bytes=-1,
    )
    return Sample(tok_s, 0.0, 2, None, 1 << 20, 4, 10 / tok_s, **(fields | extra))


def test_one_run_per_token_and_the_medians_over_the_rounds():
    one = run_split(_sample(10.0), 10)  # 1.0 s of wall over 10 tokens
    assert one == DecodeSplit(
        compute_ms=pytest.approx(40.0),
        wait_ms=pytest.approx(60.0),
        compute_basis=COMPUTE_THREAD,
        requests_from="diskstats vdz",
        requests=20.0,
        request_kib_mean=1024.0,
        request_kib_largest=1280.0,
        request_kib_largest_is=LARGEST_CAP,
        request_ms_mean=5.0,
        in_flight=1.0,
        busy=0.5,
        expert_hit=0.75,
        room_mib=64.0,
        room_need_mib=None,  # the rule's -1: unknown
        others_cpu_ms=pytest.approx(25.0),
        run_queue_ms=pytest.approx(5.0),
    )
    assert run_split(_sample(10.0, cpu_s=None), 10) is None  # a worker before the split
    assert run_split(_sample(10.0, route=False), 10).expert_hit is None  # no route time: no hit rate
    # three rounds: each figure's median, not the median run's
    runs = [_sample(10.0, 0.4), _sample(5.0, 0.2), _sample(8.0, 0.6)]
    med = decode_split(runs, 10)
    assert med.compute_ms == pytest.approx(40.0) and med.wait_ms == pytest.approx(65.0)
    assert decode_split([*runs, _sample(9.0, reads=None)], 10).requests is None  # a run without the counts
    assert decode_split([*runs, _sample(9.0, cpu_s=None)], 10) is None


def test_the_wait_and_the_lru_per_token():
    """route_wait_us (the route-time ops' wait), the LRU's evictions and its guesses skipped and unused
    are per token; its capacity as counted; None without them (a row without the wait or the LRU)."""
    split = run_split(_sample(10.0, route_wait_us=250_000, keep_evicted=35, keep_capacity=46), 10)
    assert split.route_wait_ms == pytest.approx(25.0)
    assert (split.keep_capacity, split.keep_evicted) == (46.0, pytest.approx(3.5))
    plain = run_split(_sample(10.0), 10)
    assert (plain.route_wait_ms, plain.keep_capacity, plain.keep_evicted) == (None, None, None)
    assert (plain.guesses_skipped, plain.guesses_unused) == (None, None)
    guessing = run_split(_sample(10.0, keep_evicted=35, keep_capacity=42, spec_skipped=120, spec_unused=7), 10)
    assert (guessing.guesses_skipped, guessing.guesses_unused) == (pytest.approx(12.0), pytest.approx(0.7))


def _fake_measure(tmp_path, monkeypatch, **extra) -> list[MemoryRow]:
    """measure_memory on made-up samples: off and route, three rounds each."""
    monkeypatch.setattr(bench_memory, "memory_rows", lambda n: [RowConfig(), RowConfig(route=True)])
    plans = bench_memory.memory_configs(tmp_path, 4)

    def collect(model, runs, lib, pristine, opts):
        return {r.name: [_sample(t, route=r.name == "route", **extra) for t in (9.0, 10.0, 11.0)] for r in runs}

    monkeypatch.setattr(bench_memory, "collect", collect)
    monkeypatch.setattr(bench_memory, "trace_figures", lambda path: (None, None, 0, 0, 0, 0, 0))
    return measure_memory(MODEL, plans, tmp_path, BenchOptions(rounds=3, generate=10), [64 << 20], 1000.0)


def test_the_rows_carry_the_split_into_the_table_and_the_json(tmp_path, monkeypatch):
    rows = _fake_measure(tmp_path, monkeypatch)
    off, route = rows
    assert off.decode.expert_hit is None and route.decode.expert_hit == 0.75
    assert route.decode.compute_ms == pytest.approx(40.0) and route.decode.wait_ms == pytest.approx(1e3 / 10 - 40)
    text = markdown_memory(rows, "header")
    head = [h.strip() for h in text.splitlines()[2].strip("|").split("|")]
    assert head[-9:] == list(DECODE_COLUMNS) == [
        "compute ms", "wait ms", "run queue ms", "workers CPU ms", "requests/token", "mean KiB", "in flight",
        "busy %", "expert hit %"
    ]  # fmt: skip
    assert len(text.splitlines()[3].strip("|").split("|")) == len(head)
    body = {r[1]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[4:6])}
    assert body["route"][-9:] == ["40.0", "60.0", "5.0", "25.0", "20.0", "1024", "1.00", "50.0%", "75.0%"]
    assert body["patched off"][-1] == "-"
    assert "wait ms, the rest of its wall time, off CPU" in text
    # --json: each row's decode object, its fields by name; read back as they were written
    doc = {"memory_limits": [64 << 20], "rows": [asdict(r) for r in rows]}
    assert list(doc["rows"][1]["decode"]) == [
        "compute_ms", "wait_ms", "compute_basis", "requests_from", "requests", "request_kib_mean",
        "request_kib_largest", "request_kib_largest_is", "request_ms_mean", "in_flight", "busy", "expert_hit",
        "room_mib", "room_need_mib", "route_wait_ms", "keep_capacity", "keep_evicted", "guesses_skipped",
        "guesses_unused", "layers_ops", "layers_mib", "layers_cut", "others_cpu_ms", "run_queue_ms",
    ]  # fmt: skip
    (tmp_path / "r.json").write_text(json.dumps(doc))
    back = load_measured(tmp_path / "r.json")
    assert [r.decode for r in back.rows] == [r.decode for r in rows]


def test_several_threads_are_labelled_and_not_split(tmp_path, monkeypatch):
    # the worker leaves out the others' CPU and the run queue with several threads (DecodeClocks.as_json)
    one = dict(cpu_basis=COMPUTE_PROCESS, cpu_s=1.5, others_cpu_s=None, run_delay_s=None)
    rows = _fake_measure(tmp_path, monkeypatch, **one)
    d = rows[1].decode
    assert d.compute_basis == COMPUTE_PROCESS and d.compute_ms == pytest.approx(150.0) and d.wait_ms is None
    line = next(x for x in markdown_memory(rows, "h").splitlines() if x.startswith("| 64 | route |"))
    assert line.split("|")[-10:-6] == [" 150.0 (process) ", " - ", " - ", " - "]


def _bench_reports() -> list[str]:
    """The memory and cold reports of docs/measured (load_measured's two kinds). A plot-drives output, which
    names the ``reports`` it was drawn from, holds derived rows and is checked by test_plot_drives."""
    out = []
    for path in sorted((REPO / "docs" / "measured").glob("*.json")):
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "reports" in data:
            continue
        rows = data.get("rows") if isinstance(data, dict) else None
        if isinstance(rows, list) and rows and isinstance(rows[0], dict):
            if data.get("cold") or "memory_limits" in data or any("limit_bytes" in r for r in rows):
                out.append(path.name)
    return out


@pytest.mark.parametrize("name", _bench_reports())
def test_old_reports_still_load_without_the_split(name):
    """Every report in docs/measured loads: a row written before the split (no ``decode``) with decode None,
    a later one with its figures."""
    path = REPO / "docs" / "measured" / name
    written = [r.get("decode") for r in json.loads(path.read_text())["rows"]]
    m = load_measured(path)
    assert len(m.rows) == len(written) and m.rows
    for row, raw in zip(m.rows, written, strict=True):
        assert row.decode is None if raw is None else row.decode.compute_ms == raw["compute_ms"]


def test_an_old_row_shows_no_split_and_a_bad_one_is_refused(tmp_path):
    old = MemoryRow(64 << 20, "route", 2.0, 1.5, 2.5, 1.25, 1.1, 3.5, 40.0, 0.2, None, None, 0, 0, 0, 0, 0)
    line = markdown_memory([old], "h").splitlines()[4]
    assert line.endswith("| - | - | - | - | - | - | - |")
    row = asdict(old) | {"decode": {"wait_ms": 3.0}}
    (tmp_path / "r.json").write_text(json.dumps({"memory_limits": [64 << 20], "rows": [row]}))
    with pytest.raises(ValueError, match="row 0 .*decode is not an object with compute_ms"):
        load_measured(tmp_path / "r.json")
    row["decode"] = {"compute_ms": "fast"}
    (tmp_path / "r.json").write_text(json.dumps({"memory_limits": [64 << 20], "rows": [row]}))
    with pytest.raises(ValueError, match="not a number"):
        load_measured(tmp_path / "r.json")
    # a field a later report adds is ignored, one it lacks is None
    row["decode"] = {"compute_ms": 5, "new_figure": 1}
    (tmp_path / "r.json").write_text(json.dumps({"memory_limits": [64 << 20], "rows": [row]}))
    assert load_measured(tmp_path / "r.json").rows[0].decode == DecodeSplit(5.0)


def _drive_stats(requests: int, nbytes: int, max_request: int, residence_s: float = 0.0, busy_s: float = 0.0):
    from onebit_predict.drive.emudrive import DriveStats

    return DriveStats(
        seq=1, final=False, requests=requests, bytes=nbytes, user_s=0.0, sys_s=0.0, serve_user_s=0.0,
        serve_sys_s=0.0, wall_s=0.0, max_inflight=8, window_max_inflight=8, queued=0, queue_wait_s=0.0,
        max_request=max_request, residence_s=residence_s, busy_s=busy_s, latency_us=65.0, bandwidth=6e9,
        channels=64, max_read=131072, file_bytes=1 << 30,
    )  # fmt: skip


def test_an_emulated_drive_counts_its_own_requests(tmp_path, monkeypatch):
    """On an emulated drive the emulator's counters are the requests (FUSE reads have no diskstats line):
    their count and bytes over the decode, the largest it served since mounted, and its schedule's times:
    60 requests that spent 0.3 s in the device in all (5 ms each) over 1 s of wall (0.3 in flight), the
    device busy 0.25 s of it (25 %)."""
    snaps = iter([_drive_stats(100, 100 * 65536, 131072, 1.0, 0.75),
                  _drive_stats(160, 100 * 65536 + 60 * 131072, 131072, 1.3, 1.0)])  # fmt: skip
    monkeypatch.setattr(worker, "_drive_snapshot", lambda drive_stats: next(snaps))
    clock = iter([10.0, 11.0])
    monkeypatch.setattr(worker.time, "perf_counter", lambda: next(clock))
    counter = worker.ReadCounter(tmp_path / "mnt" / "m.gguf", (1234, tmp_path / "stats"))
    assert counter.disk is None
    counter.start()
    reads, drive = counter.stop()
    assert (reads.source, reads.requests, reads.bytes) == ("emulated", 60, 60 * 131072) and drive.requests == 60
    assert (reads.largest_bytes, reads.largest_is, reads.mean_bytes) == (131072, LARGEST_SEEN, 131072)
    assert reads.wall_s == 1.0 and reads.mean_ms == pytest.approx(5.0)
    assert reads.in_flight == pytest.approx(0.3) and reads.busy == pytest.approx(0.25)
    d = run_split(_sample(10.0, reads=reads), 10)
    assert (d.requests_from, d.requests, d.request_kib_mean, d.request_kib_largest) == ("emulated", 6.0, 128.0, 128.0)
    assert d.request_ms_mean == pytest.approx(5.0)
    assert decode_cells(d)[4:8] == ["6.0", "128", "0.30", "25.0%"]


def test_the_clocks_split_the_decoding_threads_cpu_from_the_workers(tmp_path):
    """Around a call in which another thread of the process burns CPU while this one sleeps, that CPU is the
    others' and not the compute's; the run queue's wait is read from schedstat, and a kernel without
    schedstat gives None, not 0."""
    import threading

    def burn(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    clocks = worker.DecodeClocks(1)
    clocks.start()
    t = threading.Thread(target=burn, args=(0.2,))
    t.start()
    t.join()
    clocks.stop()
    assert clocks.others >= 0.19 and clocks.cpu < 0.05
    got = clocks.as_json()
    assert got["others_cpu_s"] == clocks.others and got["cpu_basis"] == COMPUTE_THREAD
    if worker.run_delay_s() is not None:
        assert got["run_delay_s"] is not None and got["run_delay_s"] >= 0
    (tmp_path / "schedstat").write_text("1000 250000000 3\n")
    assert worker.run_delay_s(tmp_path / "schedstat") == 0.25
    absent = worker.DecodeClocks(1, tmp_path / "absent")
    absent.start()
    absent.stop()
    assert absent.as_json()["run_delay_s"] is None and worker.run_delay_s(tmp_path / "absent") is None
    several = worker.DecodeClocks(2)  # the process's CPU is the compute's: no others, no one thread's wait
    several.start()
    several.stop()
    assert several.as_json()["others_cpu_s"] is None and several.as_json()["run_delay_s"] is None
