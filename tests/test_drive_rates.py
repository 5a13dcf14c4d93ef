"""The drive as fio times it (costmodel/drive_rates.py; ``onebit-stats simulate --drive-rates``): fio's JSON
read into a grid of rates, interpolated between its points, served by the page model's drive at each
request's size and depth, and every bad file a usage error."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onebit_predict.constants import EXIT_OK, EXIT_USAGE
from onebit_predict.costmodel.drive_rates import DriveRates, fio_size, load_fio
from onebit_predict.costmodel.kernel import PageDrive
from tests.test_simulate_pages import PAGE_ARGS, run_cli, tiny  # noqa: F401 (tiny: a fixture)

KIB, MIB = 1024, 1024 * 1024
# GB/s by size and depth, this VM's of 2026-12-06 (docs/cost-model.md, "Out of sample")
GRID = {("128k", 1): 0.41e9, ("128k", 4): 0.76e9, ("1m", 1): 1.80e9, ("1m", 4): 1.69e9}


def fio_json(path, grid=GRID, rw="randread", extra=()):
    """fio's --output-format=json, shaped as fio 3.33 writes it: rw in the global options, bs and iodepth
    in each job's."""
    jobs = [
        {"jobname": f"bs{bs}-qd{qd}", "job options": {"bs": bs, "iodepth": str(qd)}, "read": {"bw_bytes": bw}}
        for (bs, qd), bw in grid.items()
    ]
    data = {"fio version": "fio-3.33", "global options": {"rw": rw, "direct": "1"}, "jobs": jobs + list(extra)}
    path.write_text(json.dumps(data))
    return path


def test_fio_sizes_are_read_as_fio_writes_them():
    assert [fio_size(x) for x in ("128k", "1m", "4M", "131072", "512KiB", "1m,4k")] == [
        128 * KIB,
        MIB,
        4 * MIB,
        131072,
        512 * KIB,
        MIB,
    ]
    for bad in ("", "k", "-4k", "1x", "0"):
        with pytest.raises(ValueError, match="not a request size"):
            fio_size(bad)


def test_the_grid_is_read_and_interpolated_in_log_size_and_depth(tmp_path):
    rates = load_fio([fio_json(tmp_path / "fio.json")])
    assert (rates.sizes, rates.depths) == ((128 * KIB, MIB), (1, 4))
    assert rates.rate(128 * KIB, 1) == 0.41e9 and rates.rate(MIB, 4) == 1.69e9
    # 2 is halfway from 1 to 4 in log depth; 362 KiB halfway from 128 KiB to 1 MiB in log size
    assert rates.rate(128 * KIB, 2) == pytest.approx((0.41e9 + 0.76e9) / 2)
    assert rates.rate(2**18.5, 1) == pytest.approx((0.41e9 + 1.80e9) / 2)
    # beyond the table: its edge
    assert rates.rate(4 * KIB, 1) == 0.41e9 and rates.rate(8 * MIB, 64) == 1.69e9
    # two runs of the grid: each cell their mean
    again = fio_json(tmp_path / "again.json", {k: 2 * v for k, v in GRID.items()})
    both = load_fio([tmp_path / "fio.json", again])
    assert both.rate(128 * KIB, 1) == pytest.approx(1.5 * 0.41e9) and "fio.json, " in both.source


def test_the_drive_serves_each_request_at_its_size_and_depth():
    """One page of 4 KiB; the rates give a 4 KiB request 4.096 MB/s alone (1 ms a page) and 8.192 MB/s with
    two in flight: a lone request takes 1 ms a page, the second of two issued together half that."""
    rates = DriveRates((4 * KIB,), (1, 2), ((4.096e6, 8.192e6),), "test")
    d = PageDrive(1e12, 5.0, 4, page_size=4096, rates=rates)  # the bandwidth and latency are the rates'
    assert d.request(0.0, 1) == (0.0, pytest.approx(1.0))
    assert d.request(0.0, 1) == (pytest.approx(1.0), pytest.approx(0.5))
    assert d.idle_at == pytest.approx(1.5)
    assert d.request(10.0, 1) == (10.0, pytest.approx(1.0))  # alone again


def test_bad_fio_files_say_what_is_wrong(tmp_path):
    cases = {
        "not json": ("{", "not fio's JSON output"),
        "no jobs": (json.dumps({"jobs": []}), "no 'jobs' list"),
        "no read": (json.dumps({"jobs": [{"job options": {"bs": "4k", "rw": "randread"}}]}), "read.bw_bytes"),
    }
    for name, (text, msg) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=msg):
            load_fio([tmp_path / name])
    with pytest.raises(ValueError, match="cannot read"):
        load_fio([tmp_path / "absent.json"])
    with pytest.raises(ValueError, match="the expert reads are random"):
        load_fio([fio_json(tmp_path / "seq.json", rw="read")])
    with pytest.raises(ValueError, match="missing 1024 KiB at depth 4"):
        load_fio([fio_json(tmp_path / "hole.json", {k: v for k, v in GRID.items() if k != ("1m", 4)})])
    twice = {"jobname": "again", "job options": {"bs": "128k", "iodepth": "1"}, "read": {"bw_bytes": 1}}
    with pytest.raises(ValueError, match="given twice"):
        load_fio([fio_json(tmp_path / "twice.json", extra=[twice])])
    with pytest.raises(ValueError, match="it read nothing"):
        load_fio([fio_json(tmp_path / "zero.json", {**GRID, ("1m", 4): 0})])


RATES_ARGS = ["--expert-bytes", "12288", "--layer-ms", "0", "--readahead-kb", "0", "--granularity", "page"]


def test_simulate_plays_the_rates_and_refuses_them_with_one_figure(capsys, tmp_path, tiny):  # noqa: F811
    good = fio_json(tmp_path / "fio.json")
    rc, out, err = run_cli(capsys, tiny, *RATES_ARGS, "--drive-rates", good)
    assert rc == EXIT_OK and "drive rates fio" in out and "128 KiB to 1024 KiB at depth 1 to 4" in out
    rc, out, _ = run_cli(capsys, tiny, *RATES_ARGS, "--drive-rates", good, "--json")
    model = json.loads(out)["model"]
    assert model["drive_rates"]["value"]["depths"] == [1, 4] and model["latency_us"]["value"] == 0.0
    assert model["bandwidth_bytes_s"]["value"] == pytest.approx(1.69e9)  # 1 MiB at the queue depth (4)
    slow = fio_json(tmp_path / "slow.json", {k: v / 100 for k, v in GRID.items()})
    _, out_slow, _ = run_cli(capsys, tiny, *RATES_ARGS, "--drive-rates", slow, "--json")
    tok_s = [r["tok_s"] for r in json.loads(out)["rows"]]
    assert all(a > b for a, b in zip(tok_s, (r["tok_s"] for r in json.loads(out_slow)["rows"])))
    rc, _, err = run_cli(capsys, tiny, *RATES_ARGS, "--drive-rates", good, "--bandwidth", "3GB/s")
    assert rc == EXIT_USAGE and "leave out --bandwidth" in err
    rc, _, err = run_cli(capsys, tiny, *RATES_ARGS, "--drive-rates", tmp_path / "absent.json")
    assert rc == EXIT_USAGE and "--drive-rates: " in err and "cannot read" in err
    rc, _, err = run_cli(capsys, tiny, "--expert-bytes", "12288", "--layer-ms", "0", "--drive-rates", good)
    assert rc == EXIT_USAGE and "the page model's drive" in err


def test_the_committed_fio_grids_are_the_tables_of_the_docs():
    """docs/fio/ keeps the grids docs/cost-model.md plays; its tables and figures are these files' cells."""
    fio = Path(__file__).resolve().parent.parent / "docs" / "fio"
    epyc = load_fio([fio / "epyc-2026-12-06-before.json", fio / "epyc-2026-12-06-after.json"])
    assert (epyc.sizes, epyc.depths) == ((128 * KIB, 512 * KIB, MIB, 4 * MIB), (1, 4, 16))
    assert epyc.rate(MIB, 4) == pytest.approx(1.709e9, rel=1e-3)  # the 1 MiB figure
    assert epyc.rate(128 * KIB, 1) == pytest.approx(1.055e9, rel=1e-2)
    xeon = load_fio([fio / "xeon-2026-12-06-table.json"])
    assert xeon.rate(128 * KIB, 1) == 0.41e9 and xeon.rate(MIB, 1) == 1.80e9
