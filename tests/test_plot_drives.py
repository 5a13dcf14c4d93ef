"""onebit-stats plot-drives: the drive matrix's cells (drive x expert size x limit) from onebit-bench
--memory-limit --drive reports: the ratios per cell, the floor and the physical limit, the "gain from"
rule, the drive labels, --json/--csv, one PNG per drive, and exit 2 on bad input; where each token's time
went (the rows' decode) as a table and stacked bars, and the retention-aware limit of a Belady replay.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from onebit_predict.commands.plot_drives import png_name
from onebit_predict.commands.stats import main as stats_main
from onebit_predict.constants import EXIT_OK, EXIT_USAGE
from onebit_predict.costmodel.drive_cells import (
    GAIN_BYTES,
    GAIN_FLIGHT,
    NO_GAIN,
    drive_cells,
    gain_from,
    load_replay,
    physical_limit,
    with_belady,
)
from onebit_predict.costmodel.measured import load_measured

MIB = 2**20
EXPERTS = 400 * MIB  # the model's expert bytes
HALF = EXPERTS // 2
PROFILES = {
    "nvme": {"latency_us": 65.0, "bandwidth": 6e9, "channels": 64, "max_read": 131072},
    "sata": {"latency_us": 70.0, "bandwidth": 5.6e8, "channels": 8, "max_read": 131072},
}
OFF: dict[str, object] = {}
ROUTE = {"route": True}
BLOCK_READ = {"predictor": "block", "consumer": "read"}
BLOCK_ADVISE = {"predictor": "block", "consumer": "advise"}
ROUTE_GUARD = {"route": True, "guard": 4}


def row(limit: int, config: dict, drive: str, ra: int, tok: float, read: float, missing: float | None = None) -> dict:
    """A report row: ``missing`` the route-time misses in MiB per token (None: no route)."""
    full = {"predictor": None, "consumer": "off", "oracle": False, "route": False, "random": False}
    full |= {"ahead": None, "depth": None, "guard": None, "room": None, "workers": None}
    full |= config | {"read_ahead_kb": ra, "drive": drive}
    return {
        "limit_bytes": limit,
        "name": "x",  # the config object decides, not the name
        "median_tok_s": tok,
        "min_tok_s": tok * 0.9,
        "max_tok_s": tok * 1.2,
        "ratio_to_off": 99.0,  # the cell's own off decides (this is never used when off is there)
        "read_mib_per_token": read,
        "major_faults_per_token": 1.0,
        "config": full,
        "route_missing_per_token": None if missing is None else missing * MIB,
    }


def report(path: Path, rows: list[dict], drives: tuple[str, ...] = ("native", "nvme", "sata"), **extra) -> Path:
    data = {
        "model": "/nowhere/w21504-q4_k_m.gguf",
        "rounds": 1,
        "prompt": 16,
        "generate": 24,
        "threads": 1,
        "expert_bytes": EXPERTS,
        "memory_limits": sorted({r["limit_bytes"] for r in rows}),
        "drive": {"bandwidth_mb_s": 1000.0, "page_read_us": 70.0, "read_ahead_kb": 128},
        "drives": {
            d: {"emulated": False} if d == "native" else {"emulated": True, "profile": PROFILES[d]} for d in drives
        },
        "rows": rows,
    } | extra
    path.write_text(json.dumps(data))
    return path


def matrix_rows(ra: int = 128, drives: tuple[str, ...] = ("native", "nvme", "sata"), resident: bool = True) -> list:
    rows = []
    for d in drives:
        if resident:
            rows += [row(0, OFF, d, ra, 50.0, 0.0), row(0, ROUTE, d, ra, 51.0, 0.0, 0.0)]
        rows += [
            row(HALF, OFF, d, ra, 8.0, 80.0),
            row(HALF, ROUTE, d, ra, 10.0, 70.0, 60.0),  # 1.25x, 0.875x the bytes: fewer bytes
            row(HALF, BLOCK_READ, d, ra, 12.0, 90.0),  # 1.5x with more bytes: reads in flight
            row(HALF, BLOCK_ADVISE, d, ra, 8.3, 60.0),  # 1.0375x: under 5 %, no gain
            row(HALF, ROUTE_GUARD, d, ra, 9.0, 75.0, 40.0),  # a route row with a knob: not the floor
        ]
    return rows


@pytest.fixture
def matrix(tmp_path):
    return report(tmp_path / "m.json", matrix_rows())


def run(capsys, *args):
    rc = stats_main(["plot-drives", *(str(a) for a in args)])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return rc, out, err


def cell(cells, drive, limit):
    return next(c for c in cells if c.drive_label == drive and c.limit_bytes == limit)


def test_floor_and_physical_limit_arithmetic(matrix):
    cells = drive_cells([load_measured(matrix)])
    nvme, sata, native = (cell(cells, d, HALF) for d in ("nvme", "sata", "native @128"))
    for c in (nvme, sata, native):
        assert c.floor_mib == pytest.approx(60.0)  # the plain route row's, not route, guard 4's 40
        assert c.compute_s == pytest.approx(1 / 50.0)  # the resident patched off of the same drive
    assert nvme.bandwidth == 6e9 and sata.bandwidth == 5.6e8 and native.bandwidth == pytest.approx(1e9)
    # nvme: 60 MiB / 6 GB/s = 10.5 ms < 20 ms of compute: the compute bound, 50 tok/s
    assert nvme.drive_s == pytest.approx(60 * MIB / 6e9)
    assert nvme.physical_limit_tok_s == pytest.approx(50.0)
    # sata: 60 MiB / 560 MB/s = 112 ms: the drive bound
    assert sata.physical_limit_tok_s == pytest.approx(5.6e8 / (60 * MIB))
    assert native.physical_limit_tok_s == pytest.approx(1e9 / (60 * MIB))
    assert physical_limit(0.02, 60 * MIB, 6e9) == pytest.approx(50.0)
    assert physical_limit(None, 60 * MIB, 6e9) is None  # no resident off: unknown
    assert physical_limit(0.02, None, 6e9) is None  # no route-alone row: unknown
    resident = cell(cells, "nvme", 0)
    assert resident.floor_mib == 0.0 and resident.physical_limit_tok_s == pytest.approx(50.0)
    assert resident.row("route").read_over_floor is None  # 0 / 0: no figure
    assert nvme.row("patched off").read_over_floor == pytest.approx(80.0 / 60.0)


def test_the_native_limit_takes_the_drives_random_reads(tmp_path):
    """A report with the drive's 1 MiB random reads at the workers' depth (since 2026-12-05): the native
    cell's physical limit is at their bandwidth, below or above the sequential one (a token's misses are
    random slices); a report without them keeps the sequential; the emulated cells keep their profile's."""
    slow = {"bandwidth_mb_s": 1000.0, "random_mb_s": 400.0, "page_read_us": 70.0, "read_ahead_kb": 128}
    cells = drive_cells([load_measured(report(tmp_path / "r.json", matrix_rows(), drive=slow))])
    native, nvme = cell(cells, "native @128", HALF), cell(cells, "nvme", HALF)
    assert native.bandwidth == pytest.approx(4e8)
    assert native.physical_limit_tok_s == pytest.approx(4e8 / (60 * MIB))  # 2.5x below the sequential's
    assert nvme.bandwidth == 6e9
    fast = slow | {"random_mb_s": 3000.0}  # a sequential probe slower than the random reads at depth
    cells = drive_cells([load_measured(report(tmp_path / "f.json", matrix_rows(), drive=fast))])
    assert cell(cells, "native @128", HALF).bandwidth == pytest.approx(3e9)
    cells = drive_cells([load_measured(report(tmp_path / "o.json", matrix_rows()))])  # before: sequential
    assert cell(cells, "native @128", HALF).bandwidth == pytest.approx(1e9)


def test_ratios_are_per_cell(tmp_path):
    rows = matrix_rows(drives=("nvme", "sata"))
    rows = [r | {"median_tok_s": r["median_tok_s"] * 2} if r["config"]["drive"] == "sata" else r for r in rows]
    rows[-5]["median_tok_s"] = 4.0  # sata's off at 50 %: 4, not 16
    cells = drive_cells([load_measured(report(tmp_path / "r.json", rows, drives=("nvme", "sata")))])
    nvme, sata = cell(cells, "nvme", HALF), cell(cells, "sata", HALF)
    assert nvme.off_tok_s == 8.0 and sata.off_tok_s == 4.0
    assert nvme.row("route").ratio_to_off == pytest.approx(10.0 / 8.0)
    assert sata.row("route").ratio_to_off == pytest.approx(20.0 / 4.0)
    assert nvme.row("patched off").ratio_to_off == 1.0
    r = nvme.row("block + read")
    assert r.ratio_min == pytest.approx(12.0 * 0.9 / 8.0) and r.ratio_max == pytest.approx(12.0 * 1.2 / 8.0)
    assert cell(cells, "nvme", 0).row("route").ratio_to_off == pytest.approx(51.0 / 50.0)


def test_gain_from_rule(matrix):
    assert gain_from(1.05, 72.0, 80.0) == GAIN_BYTES  # exactly 5 % faster, exactly 0.9x the bytes
    assert gain_from(1.05, 72.1, 80.0) == GAIN_FLIGHT
    assert gain_from(1.049, 10.0, 80.0) == NO_GAIN  # under 5 %
    assert gain_from(0.8, 10.0, 80.0) == NO_GAIN
    assert gain_from(1.5, 0.0, 0.0) == NO_GAIN  # off read nothing (resident): no bytes to save
    assert gain_from(1.5, None, 80.0) == NO_GAIN
    c = cell(drive_cells([load_measured(matrix)]), "nvme", HALF)
    gains = {r.configuration: r.gain_from for r in c.rows}
    assert gains == {
        "patched off": NO_GAIN,
        "route": GAIN_BYTES,
        "block + read": GAIN_FLIGHT,
        "block + advise": NO_GAIN,
        "route, guard 4": GAIN_FLIGHT,  # 1.125x at 0.9375x the bytes
    }


def test_labels_sizes_and_the_compute_of_another_readahead(capsys, tmp_path, matrix):
    """native at two readaheads: two drives; the 8192 report has no resident rows, so its cells take
    the compute of the native resident off at 128; the model is not here: the width tag labels it."""
    native8192 = report(tmp_path / "n.json", matrix_rows(8192, ("native",), resident=False), drives=("native",))
    cells = drive_cells([load_measured(matrix), load_measured(native8192)])
    labels = list(dict.fromkeys(c.drive_label for c in cells))
    assert labels == ["native @128", "native @8192", "nvme", "sata"]
    c = cell(cells, "native @8192", HALF)
    assert c.compute_s == pytest.approx(1 / 50.0) and c.compute_read_ahead_kb == 128
    assert c.limit_label == "50 %" and c.label == "2.7 MiB, 50 %"
    assert c.size.per_expert_bytes is None and cell(cells, "nvme", 0).limit_label == "resident"
    rc, out, _ = run(capsys, matrix, native8192)
    assert rc == EXIT_OK and "(resident patched off 50.00 tok/s at read_ahead_kb 128)" in out


def test_expert_size_from_the_model_file(tmp_path):
    """Where the report's model is here, its GGUF's expert tensors give the size (not the name)."""
    model = Path(__file__).resolve().parent.parent / "models" / "qwen3moe-tiny.gguf"
    if not model.is_file():
        pytest.skip(f"{model} not here")
    rep = report(tmp_path / "r.json", matrix_rows(drives=("nvme",)), drives=("nvme",), model=str(model))
    c = drive_cells([load_measured(rep)])[0]
    assert c.size.per_expert_bytes == 24576 and c.size.label == "24 KiB"


def test_markdown_table(capsys, matrix):
    rc, out, _ = run(capsys, matrix)
    assert rc == EXIT_OK
    blocks = out.split("### ")[1:]
    assert [b.splitlines()[0] for b in blocks] == ["native @128", "nvme", "sata"]
    lines = [line for line in blocks[1].splitlines() if line.startswith("|")]
    head = [h.strip() for h in lines[0].strip("|").split("|")]
    assert head[:3] == ["configuration", "2.7 MiB, resident: tok/s (min-max)", "2.7 MiB, resident: x off"]
    assert head[6:9] == ["2.7 MiB, 50 %: tok/s (min-max)", "2.7 MiB, 50 %: x off", "2.7 MiB, 50 %: MiB read/token"]
    body = {r[0]: r[1:] for r in ([c.strip() for c in line.strip("|").split("|")] for line in lines[2:])}
    assert body["route"][5:] == ["10.00 (9.00-12.00)", "1.250", "70.0", "1.17", "fewer bytes"]
    assert body["block + read"][9] == "reads in flight (same bytes)"
    floor = next(k for k in body if k.startswith("**floor**"))
    assert body[floor][7] == "60.0"
    limit = next(k for k in body if k.startswith("**physical limit**"))
    assert body[limit][5:7] == ["50.00", "6.250"]
    assert "2.7 MiB, 50 %: compute 20.0 ms (resident patched off 50.00 tok/s)" in blocks[1]


def test_json_and_csv(capsys, matrix):
    rc, out, _ = run(capsys, matrix, "--json")
    assert rc == EXIT_OK
    rows = json.loads(out)["rows"]
    assert len(rows) == 3 * (2 + 5)
    r = next(x for x in rows if x["drive"] == "sata" and x["limit"] == "50 %" and x["configuration"] == "route")
    assert r["floor_mib_per_token"] == pytest.approx(60.0) and r["gain_from"] == GAIN_BYTES
    assert r["physical_limit_tok_s"] == pytest.approx(5.6e8 / (60 * MIB)) and r["limit_fraction"] == 0.5
    rc, out, _ = run(capsys, matrix, "--csv")
    assert rc == EXIT_OK
    table = list(csv.DictReader(io.StringIO(out)))
    assert len(table) == len(rows) and table[0]["drive"] == "native @128"


def test_bad_input_is_exit_2(capsys, tmp_path, matrix):
    partial = tmp_path / "partial.json"
    partial.write_text('{"rows": [')  # a report still being written
    rc, _, err = run(capsys, partial)
    assert rc == EXIT_USAGE and "not JSON" in err
    cold = report(tmp_path / "cold.json", [row(0, OFF, "native", 128, 5.0, 1.0)], cold=True)
    rc, _, err = run(capsys, cold)
    assert rc == EXIT_USAGE and "not onebit-bench --memory-limit reports" in err
    old = json.loads(matrix.read_text())
    del old["drives"]
    for r in old["rows"]:
        r["config"]["drive"] = None
    (tmp_path / "old.json").write_text(json.dumps(old))
    rc, _, err = run(capsys, tmp_path / "old.json")
    assert rc == EXIT_USAGE and "record no drive" in err
    rc, _, err = run(capsys, tmp_path / "missing.json")
    assert rc == EXIT_USAGE
    rc, _, err = run(capsys, matrix, "--png-dir", matrix)  # a file, not a directory
    assert rc == EXIT_USAGE and "not a directory" in err


def test_png_dir_without_matplotlib_is_exit_2(capsys, matrix, tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_matplotlib(name, *a, **k):
        if name.split(".")[0] == "matplotlib":
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    rc, out, err = run(capsys, matrix, "--png-dir", tmp_path / "png")
    assert rc == EXIT_USAGE and "--png-dir needs matplotlib" in err and out == ""


def test_png_dir_writes_one_file_per_drive(capsys, matrix, tmp_path):
    pytest.importorskip("matplotlib")
    out_dir = tmp_path / "png"
    rc, _, err = run(capsys, matrix, "--png-dir", out_dir)
    assert rc == EXIT_OK, err
    assert sorted(p.name for p in out_dir.iterdir()) == ["native-128.png", "nvme.png", "sata.png"]
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in out_dir.iterdir())
    assert png_name("native @8192") == "native-8192.png"


# --- where each token's time went (issue 30): the rows' decode, the retention-aware limit --------------


def decode(compute: float, wait: float | None, hit: float | None = None) -> dict:
    """A row's ``decode`` object (only some of its fields: the rest read as None)."""
    return {"compute_ms": compute, "wait_ms": wait, "compute_basis": "thread", "requests": 40.0, "expert_hit": hit}


def split_rows(drives: tuple[str, ...] = ("native", "nvme", "sata")) -> list:
    rows = matrix_rows(drives=drives)
    for r in rows:
        if r["config"]["drive"] == "nvme":
            ms = 1e3 / r["median_tok_s"]
            r["decode"] = decode(min(20.0, ms), ms - min(20.0, ms), 0.6 if r["config"]["route"] else None)
    return rows


def replay_json(path: Path, results: list[tuple[str, int, list[float]]], n_expert: int = 8, **extra) -> Path:
    """An onebit-stats replay --json: (policy, slots, reads per token of each layer) per result."""
    doc = {
        "trace": "t.bin",
        "header": {"n_layer": 2, "n_expert": n_expert, "n_expert_used": 2},
        "tokens": 24,
        "results": [
            {"policy": p, "slots": n, "prefetch": "none", "lfru_window": 32, "cold": False}
            | {"layers": [{"layer": i, "reads_per_token": x} for i, x in enumerate(reads)]}
            | extra
            for p, n, reads in results
        ],
    }
    path.write_text(json.dumps(doc))
    return path


def test_the_split_goes_to_the_cells_the_table_and_the_json(capsys, tmp_path):
    rep = report(tmp_path / "s.json", split_rows())
    cells = drive_cells([load_measured(rep)])
    nvme, sata = cell(cells, "nvme", HALF), cell(cells, "sata", HALF)
    assert nvme.has_split and not sata.has_split
    assert nvme.row("route").decode.compute_ms == 20.0 and nvme.row("route").decode.expert_hit == 0.6
    rc, out, _ = run(capsys, rep)
    assert rc == EXIT_OK
    blocks = {b.splitlines()[0]: b for b in out.split("### ")[1:]}
    assert "Per decoded token" in blocks["nvme"] and "Per decoded token" not in blocks["sata"]
    lines = [x for x in blocks["nvme"].split("Per decoded token")[1].splitlines() if x.startswith("|")]
    body = {r[0]: r[1:] for r in ([c.strip() for c in x.strip("|").split("|")] for x in lines[2:])}
    # 50 %: 10 tok/s, 100 ms: 20 + 80; 20 % of the physical limit (50 tok/s); no replay: no retention limit
    assert body["route"][6:12] == ["20.0", "80.0", "40.0", "60.0", "20", "-"]
    assert body["patched off"][9] == "-"  # no route time: no expert hit rate
    limit = next(v for k, v in body.items() if k.startswith("**physical limit**"))
    assert limit[6] == "20.0"  # nvme at 50 %: compute-bound, 1 / 50 tok/s
    rc, out, _ = run(capsys, rep, "--json")
    rows = json.loads(out)["rows"]
    r = next(x for x in rows if x["drive"] == "nvme" and x["limit"] == "50 %" and x["configuration"] == "route")
    assert (r["decode_compute_ms"], r["decode_wait_ms"], r["decode_expert_hit"]) == (20.0, 80.0, 0.6)
    assert r["decode_request_kib_mean"] is None and r["belady_floor_mib_per_token"] is None
    assert r["of_physical_limit"] == pytest.approx(10.0 / 50.0) and r["of_retention_limit"] is None
    assert all(x["decode_compute_ms"] is None for x in rows if x["drive"] == "sata")
    rc, out, _ = run(capsys, rep, "--csv")
    assert rc == EXIT_OK and "decode_wait_ms" in out.splitlines()[0]


def test_a_belady_replay_gives_the_retention_aware_limit(capsys, tmp_path, caplog):
    """50 % of 8 experts: 4 slots per layer; Belady's 1.5 + 0.5 expert reads per token of 25 MiB each (400 MiB
    over 2 layers x 8 experts, the model not being here): a floor of 50 MiB per token."""
    rep = report(tmp_path / "s.json", split_rows())
    replay = replay_json(
        tmp_path / "r.json", [("lru", 4, [3.0, 3.0]), ("belady", 2, [9.0, 9.0]), ("belady", 4, [1.5, 0.5])]
    )
    trace_prefetch = replay_json(tmp_path / "t.json", [("belady", 4, [0.1, 0.1])], prefetch="trace")
    with pytest.raises(ValueError, match="no belady result without prefetch"):
        load_replay(trace_prefetch)
    cells = with_belady(drive_cells([load_measured(rep)]), [load_replay(replay)])
    nvme, sata = cell(cells, "nvme", HALF), cell(cells, "sata", HALF)
    assert nvme.belady_floor_bytes == pytest.approx(50 * MIB) and cell(cells, "nvme", 0).belady_floor_bytes == 0.0
    assert nvme.retention_limit_tok_s == pytest.approx(50.0)  # 50 MiB / 6 GB/s < 20 ms of compute
    assert sata.retention_limit_tok_s == pytest.approx(5.6e8 / (50 * MIB))
    assert sata.physical_limit_tok_s == pytest.approx(5.6e8 / (60 * MIB))  # the route floor's, unchanged
    rc, out, _ = run(capsys, rep, "--replay", replay)
    assert rc == EXIT_OK and "**retention-aware limit**" in out and "**Belady floor**" in out
    block = [b for b in out.split("### ") if b.startswith("sata")][0]
    belady = next(x for x in block.splitlines() if x.startswith("| **Belady floor**"))
    assert [c.strip() for c in belady.strip("|").split("|")][8] == "50.0"
    rc, out, _ = run(capsys, rep, "--replay", replay, "--json")
    r = next(x for x in json.loads(out)["rows"] if x["drive"] == "sata" and x["limit"] == "50 %")
    assert r["belady_floor_mib_per_token"] == pytest.approx(50.0)
    assert r["retention_limit_tok_s"] == pytest.approx(5.6e8 / (50 * MIB))
    assert r["of_retention_limit"] == pytest.approx(r["median_tok_s"] / r["retention_limit_tok_s"])
    route = next(
        x
        for x in json.loads(out)["rows"]
        if x["drive"] == "nvme" and x["limit"] == "50 %" and x["configuration"] == "route"
    )
    assert route["of_retention_limit"] == pytest.approx(10.0 / 50.0)  # 10 tok/s against Belady's 50
    # no result at the cell's capacity: no limit, and a warning naming the slots to replay
    other = replay_json(tmp_path / "o.json", [("belady", 2, [1.0, 1.0])])
    cells = with_belady(drive_cells([load_measured(rep)]), [load_replay(other)])
    assert cell(cells, "nvme", HALF).retention_limit_tok_s is None
    assert "no Belady result at 4 slots per layer" in caplog.text
    # the first replay with the capacity serves the cell
    cells = with_belady(drive_cells([load_measured(rep)]), [load_replay(other), load_replay(replay)])
    assert cell(cells, "nvme", HALF).belady_floor_bytes == pytest.approx(50 * MIB)
    # without --replay the table is as before
    rc, out, _ = run(capsys, rep)
    assert "retention-aware limit**: tok/s" not in out


def test_a_bad_replay_is_exit_2(capsys, tmp_path, matrix):
    (tmp_path / "partial.json").write_text('{"results": [')
    rc, _, err = run(capsys, matrix, "--replay", tmp_path / "partial.json")
    assert rc == EXIT_USAGE and "--replay" in err and "not JSON" in err
    rc, _, err = run(capsys, matrix, "--replay", matrix)  # a bench report, not a replay
    assert rc == EXIT_USAGE and "not an onebit-stats replay --json" in err
    lru = replay_json(tmp_path / "lru.json", [("lru", 4, [1.0, 1.0])])
    rc, _, err = run(capsys, matrix, "--replay", lru)
    assert rc == EXIT_USAGE and "no belady result" in err


def test_the_split_is_drawn_as_stacked_bars_beside_the_limits():
    pytest.importorskip("matplotlib")
    from onebit_predict.costmodel.plot import drive_split_figure

    cells = [
        ("2.7 MiB, 50 %", [(20.0, 80.0), None, (30.0, 50.0)], 20.0, 15.0),
        ("2.7 MiB, 25 %", [(25.0, 100.0), (40.0, 10.0), None], None, None),
    ]
    fig = drive_split_figure(["patched off", "route", "block + read"], cells, "t")
    try:
        ax = fig.axes[0]
        bars = [[(p.get_x(), p.get_y(), p.get_height()) for p in c.patches] for c in ax.containers]
        assert len(bars) == 4  # compute and waiting per cell
        assert [h for _, _, h in bars[0]] == [20.0, 30.0] and [y for _, y, _ in bars[0]] == [0.0, 0.0]
        assert [(y, h) for _, y, h in bars[1]] == [(20.0, 80.0), (30.0, 50.0)]  # waiting on top of compute
        assert [(y, h) for _, y, h in bars[3]] == [(25.0, 100.0), (40.0, 10.0)]
        assert [x for x, _, _ in bars[0]] == [x for x, _, _ in bars[1]]
        lines = {line.get_label(): line.get_ydata()[0] for line in ax.get_lines()}
        assert lines == {"2.7 MiB, 50 %: physical limit": 20.0, "2.7 MiB, 50 %: retention-aware limit": 15.0}
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_png_dir_draws_the_split_only_where_a_report_has_it(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    rep = report(tmp_path / "s.json", split_rows())
    rc, _, err = run(capsys, rep, "--png-dir", tmp_path / "png")
    assert rc == EXIT_OK, err
    assert sorted(p.name for p in (tmp_path / "png").iterdir()) == [
        "native-128.png", "nvme-time.png", "nvme.png", "sata.png"
    ]  # fmt: skip
    assert (tmp_path / "png" / "nvme-time.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a report written before the split (docs/measured): its table and plots as before, nothing more
    old = Path(__file__).resolve().parent.parent / "docs" / "measured" / "drives-route-w21504-nvme25.json"
    rc, out, err = run(capsys, old, "--png-dir", tmp_path / "old")
    assert rc == EXIT_OK, err
    assert "Per decoded token" not in out and "retention-aware" not in out
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["nvme.png"]


def test_a_drive_without_its_resident_run_takes_the_natives_compute(capsys, tmp_path):
    """A resident run reads nothing: an emulated drive's cell without one of its own takes the native drive's
    resident patched off (and says so), and a drive with its own keeps it."""
    rows = [r for r in matrix_rows() if not (r["limit_bytes"] == 0 and r["config"]["drive"] == "nvme")]
    for r in rows:
        if r["limit_bytes"] == 0 and r["config"]["drive"] == "native" and r["config"]["route"] is False:
            r["median_tok_s"] = 40.0
    rep = report(tmp_path / "m.json", rows)
    cells = drive_cells([load_measured(rep)])
    nvme, sata = cell(cells, "nvme", HALF), cell(cells, "sata", HALF)
    assert nvme.compute_s == pytest.approx(1 / 40.0) and nvme.compute_drive == "native"
    assert sata.compute_s == pytest.approx(1 / 50.0) and sata.compute_drive == "sata"
    rc, out, _ = run(capsys, rep)
    assert rc == EXIT_OK and "(resident patched off 40.00 tok/s on native)" in out


def test_no_floor_where_the_room_rule_held_routes_reads_off(tmp_path):
    """Route time held off by the room rule counts no misses (its decode has no expert hit rate): its 0 is no
    floor, and the cell's physical limit is unknown, not the compute's; a resident cell's 0 stays its floor."""
    rows = split_rows(drives=("nvme",))
    for r in rows:
        if r["config"]["route"] and r["config"]["guard"] is None:
            r["route_missing_per_token"] = 0.0
            r["decode"]["expert_hit"] = None
    cells = drive_cells([load_measured(report(tmp_path / "s.json", rows, drives=("nvme",)))])
    half, resident = cell(cells, "nvme", HALF), cell(cells, "nvme", 0)
    assert half.floor_bytes is None and half.physical_limit_tok_s is None
    assert half.of_physical(half.row("route")) is None
    assert resident.floor_bytes == 0.0 and resident.physical_limit_tok_s == pytest.approx(50.0)


def test_the_committed_limits_are_plot_drives_output(capsys, monkeypatch):
    """docs/measured/read-path-limits.json (results.md, "The fraction of both limits") is what plot-drives
    prints for the reports and the replay it names, here too: the models' files are not here, so each
    model's expert size is the one the file recorded (the GGUF's, where it was made)."""
    measured = Path(__file__).resolve().parent.parent / "docs" / "measured"
    saved = json.loads((measured / "read-path-limits.json").read_text())
    each = {r["model"]: r["expert_bytes_each"] for r in saved["rows"]}
    monkeypatch.setattr("onebit_predict.costmodel.expert_bytes.mean_expert_bytes", lambda model: each[str(model)])
    monkeypatch.chdir(measured)
    rc, out, _ = run(capsys, *saved["reports"], "--replay", "replay-belady-w21504.json", "--json")
    assert rc == EXIT_OK
    rows = json.loads(out)["rows"]
    assert len(rows) == len(saved["rows"]) >= 30
    for got, want in zip(rows, saved["rows"]):
        assert got.keys() == want.keys()
        for k, v in want.items():
            assert got[k] == (pytest.approx(v) if isinstance(v, float) else v), (want["configuration"], k)
