"""onebit-stats: table, --json, --csv, several traces, exit codes."""

from __future__ import annotations

import csv
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from onebit_predict.commands.stats import main
from onebit_predict.constants import MODE_BLOCK, MODE_ROUTER
from onebit_predict.trace import TraceHeader
from onebit_predict.trace_writer import TraceWriter

REPO = Path(__file__).resolve().parent.parent

# One sequence, four decode steps (pos 0..3), 3 layers, 4 experts, top-1, depth 2, no gate
# (n_read = depth = 2). Layer 1 is predicted, layer 2 is not; pos 0 is the first token.
ACTUAL = {0: [[0], [1], [2], [3]], 1: [[0], [1], [1], [2]], 2: [[3], [3], [3], [0]]}
ROUTER_PRED = [[0, 1], [1, 0], [0, 1], [3, 0]]
# layer 1, router, pos 1..3:  A {1} P 1,0: top-1 hit   | A {1} P 0,1: depth hit | A {2} P 3,0: miss
#   slot@1 1/3 = 33.3  slot@2 2/3 = 66.7  read 2/3 = 66.7  precision 2/6 = 33.3  waste (6-2)/2 = 2.00
#   exact 1/3 = 33.3  mass 2/3 = 66.7  read 6, gated 0  baseline {1}v{0}, {1}v{1}, {2}v{1} = 1/3 = 33.3
# layer 2 baseline: {3}v{3}, {3}v{3}, {0}v{3} = 2/3 = 66.7;  layer 0 baseline: {1}v{0}, {2}v{1}, {3}v{2} = 0/3
# total: the predicted layer 1 only (prediction and baseline over the same tokens): baseline 1/3 = 33.3
BLOCK_PRED = [[0, 1], [1, 2], [1, 0], [2, 1]]  # every top-1 right on pos 1..3: read 100, slot@1 100


def make(path: Path, mode: int = MODE_ROUTER, pred=ROUTER_PRED, actual=ACTUAL) -> Path:
    h = TraceHeader.build(
        n_layer=3, n_expert=4, n_expert_used=1, depth=2, mode=mode, layers={1}, arch="qwen3moe", model="tiny"
    )
    with TraceWriter(path, h) as w:
        for pos in range(4):
            for layer in range(3):
                w.add(
                    step=pos,
                    seq_id=0,
                    pos=pos,
                    layer=layer,
                    actual=actual[layer][pos],
                    pred=pred[pos] if layer == 1 else None,
                )
    return path


@pytest.fixture
def router(tmp_path):
    return make(tmp_path / "router.trace")


@pytest.fixture
def run(run_cli):
    """``run(*args)``: onebit-stats with args (exit code, stdout, stderr)."""
    return lambda *args: run_cli(main, *args)


def table_rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip()}


def test_table(capsys, router, run):
    rc, out, err = run(router)
    assert rc == 0 and err == ""
    assert "arch qwen3moe | model tiny | mode router | depth 2 | margin none" in out
    assert "| n_used 1 | ahead L+1\n" in out  # layer l predicted from layer l-1
    rows = table_rows(out)
    assert rows["layer"] == [
        "tokens",
        "slot@1%",
        "slot@2%",
        "read%",
        "prec%",
        "waste/hit",
        "exact%",
        "mass%",
        "cand_read",
        "cand_gated",
        "base_tok",
        "base%",
    ]
    assert rows["0"] == ["0"] + ["-"] * 9 + ["3", "0.0"]  # never predicted, but its baseline is scored
    assert rows["1"] == ["3", "33.3", "66.7", "66.7", "33.3", "2.00", "33.3", "66.7", "6", "0", "3", "33.3"]
    assert rows["2"] == ["0"] + ["-"] * 9 + ["3", "66.7"]
    assert rows["total"] == ["3", "33.3", "66.7", "66.7", "33.3", "2.00", "33.3", "66.7", "6", "0", "3", "33.3"]


def test_layers_option(capsys, router, run):
    rc, out, _ = run(router, "--layers", "2")
    rows = table_rows(out)
    assert rc == 0 and "1" not in rows and "0" not in rows
    assert rows["2"][-2:] == ["3", "66.7"]
    assert rows["total"][-2:] == ["0", "-"]  # the total follows the selection: layer 2 is not predicted


def test_json(capsys, router, run):
    rc, out, _ = run(router, "--json")
    assert rc == 0
    doc = json.loads(out)
    assert doc["routing_differences"] == []
    (t,) = doc["traces"]
    assert t["path"] == str(router) and t["records"] == 12 and t["dropped_bytes"] == 0 and t["issues"] == []
    assert t["header"]["mode"] == "router" and t["header"]["margin"] is None and t["header"]["layer_mask"] == [1]
    assert (t["header"]["n_expert"], t["header"]["n_expert_used"], t["header"]["depth"]) == (4, 1, 2)
    layers = {layer["layer"]: layer for layer in t["layers"]}
    assert sorted(layers) == [0, 1, 2]
    assert layers[1]["predicted"] and not layers[2]["predicted"]
    assert [layers[i]["distance"] for i in range(3)] == [None, 1, None] and t["distances"] == [1]
    assert t["total"]["distance"] == 1 and [x["distance"] for x in t["totals"]] == [1]
    assert layers[1]["read_recall"] == pytest.approx(2 / 3) and layers[1]["slot_recall_used"] == pytest.approx(1 / 3)
    assert layers[1]["precision"] == pytest.approx(1 / 3) and layers[1]["wasted_per_useful"] == 2.0
    assert layers[2]["read_recall"] is None and layers[2]["baseline_recall"] == pytest.approx(2 / 3)
    assert t["total"]["baseline_recall"] == pytest.approx(1 / 3) and t["total"]["records"] == 12
    for layer in t["layers"]:
        for key in (
            "slot_recall_used",
            "slot_recall_depth",
            "read_recall",
            "precision",
            "exact_match",
            "gate_mass_recall",
            "baseline_recall",
        ):
            assert layer[key] is None or 0 <= layer[key] <= 1


def test_csv(capsys, router, run):
    rc, out, _ = run(router, "--csv")
    assert rc == 0
    rows = list(csv.DictReader(io.StringIO(out)))
    assert out.splitlines()[0] == (
        "trace,layer,distance,predicted,records,tokens,slot_recall_used,slot_recall_depth,read_recall,precision,"
        "wasted_per_useful,exact_match,gate_mass_recall,candidates_read,candidates_gated,baseline_tokens,"
        "baseline_recall"
    )
    assert [r["layer"] for r in rows] == ["0", "1", "2", "total"]
    assert [r["distance"] for r in rows] == ["", "1", "", "1"]  # a version-2 prediction is one layer ahead
    assert float(rows[1]["read_recall"]) == pytest.approx(2 / 3) and rows[1]["predicted"] == "1"
    assert rows[2]["read_recall"] == "" and float(rows[2]["baseline_recall"]) == pytest.approx(2 / 3)


def test_two_traces_side_by_side(capsys, router, tmp_path, run):
    block = make(tmp_path / "block.trace", mode=MODE_BLOCK, pred=BLOCK_PRED)
    rc, out, err = run(router, block)
    assert rc == 0 and err == ""
    assert f"[1] {router}" in out and f"[2] {block}" in out
    rows = table_rows(out)
    assert rows["layer"] == ["read%[1]", "slot@1%[1]", "read%[2]", "slot@1%[2]", "base%"]
    assert rows["1"] == ["66.7", "33.3", "100.0", "100.0", "33.3"]
    assert rows["2"] == ["-", "-", "-", "-", "66.7"]
    assert rows["total"] == ["66.7", "33.3", "100.0", "100.0", "33.3"]


@pytest.mark.parametrize("named_like_subcommands", [False, True])
def test_the_first_argument_names_the_subcommand(capsys, router, tmp_path, monkeypatch, run, named_like_subcommands):
    """The command line alone decides (commands/stats.py): a subcommand's name first is that
    subcommand, anything else is rates; files named like subcommands in the working directory
    change nothing, and such a trace is given with a path."""
    monkeypatch.chdir(tmp_path)
    block = make(tmp_path / "block.trace", mode=MODE_BLOCK, pred=BLOCK_PRED)
    if named_like_subcommands:
        for name in ("rates", "replay", "simulate", "plot-memory"):
            shutil.copy(router, tmp_path / name)
    rc, implicit, err = run(router, block, "--json")  # the README's onebit-stats router.bin block.bin
    assert rc == 0 and err == ""
    rc, explicit, err = run("rates", router, block, "--json")
    assert rc == 0 and explicit == implicit and len(json.loads(implicit)["traces"]) == 2
    for name in ("rates", "replay", "simulate"):  # the subcommand, lacking its trace: a usage error
        rc, out, err = run(name, "--json")
        assert rc == 2 and out == "" and "the following arguments are required" in err, (name, err)
    if named_like_subcommands:
        for name in ("./rates", "./replay", "./simulate", "./plot-memory"):
            rc, out, err = run(name, "--json")
            assert rc == 0 and json.loads(out)["traces"][0]["total"]["tokens"] == 3, (name, err)
        rc, out, err = run("replay", "./replay", "--slots", "2")
        assert rc == 0 and "lru@2 hit%" in out, err


def test_disagreeing_routing_fails_unless_forced(capsys, router, tmp_path, run):
    actual = {**ACTUAL, 2: [[3], [3], [2], [0]]}  # pos 2, layer 2: {3} -> {2}
    other = make(tmp_path / "other.trace", mode=MODE_BLOCK, pred=BLOCK_PRED, actual=actual)
    rc, out, err = run(router, other)
    assert rc == 1
    assert "1 records differ" in err and "seq 0 pos 2 layer 2 actual [3] vs seq 0 pos 2 layer 2 actual [2]" in err
    rc, out, err = run(router, other, "--force")
    assert rc == 0 and "1 records differ" in err
    assert table_rows(out)["1"] == ["66.7", "33.3", "100.0", "100.0", "33.3"]
    rc, out, _ = run(router, other, "--json", "--force")
    assert rc == 0 and json.loads(out)["routing_differences"][0].endswith(
        "1 records differ in (seq_id, pos, layer) or actual ids"
    )


def test_consistency_issue_exits_1(capsys, tmp_path, run):
    bad = make(tmp_path / "bad.trace", actual={**ACTUAL, 0: [[0], [1], [2], [9]]})  # id 9 >= n_expert 4
    rc, out, err = run(bad)
    assert rc == 1
    assert "consistency: 1 records with actual ids outside [0, 4)" in err
    assert "total" in out  # the table is still printed
    rc, out, _ = run(bad, "--json")
    assert rc == 1 and json.loads(out)["traces"][0]["issues"] == ["1 records with actual ids outside [0, 4)"]


def test_truncated_trace_warns_and_succeeds(capsys, router, run):
    data = router.read_bytes()
    router.write_bytes(data[:-5])  # 5 bytes short: the last record (layer 2, pos 3) is partial
    rc, out, err = run(router)
    assert rc == 0
    # record_size 20 + 8*1 + 8*2 = 44: 39 bytes of the last record remain and are dropped
    assert "dropped 39 bytes" in err
    assert table_rows(out)["2"][-2:] == ["2", "100.0"]  # layer 2 lost pos 3: baseline {3}v{3} twice
    assert "11 records, 39 bytes of a partial record dropped" in out


def test_empty_trace(capsys, tmp_path, run):
    empty = tmp_path / "empty.trace"
    TraceWriter(empty, TraceHeader.build(n_layer=3, n_expert=4, n_expert_used=1)).close()
    rc, out, _ = run(empty)
    assert rc == 0
    assert table_rows(out)["total"] == ["0"] + ["-"] * 9 + ["0", "-"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["{missing}"], "No such file or directory"),
        (["{garbage}"], "bad magic"),
        (["{router}", "--layers", "1-x"], "'1-x' is not N or A-B"),
        (["{router}", "--layers", "3-1"], "'3-1' is a reversed range"),
        (["{router}", "--layers", ""], "'' is not N or A-B"),
        (["{router}", "--layers", "1,5"], "--layers [5]"),
        (["{router}", "--json", "--csv"], "not allowed with"),
        ([], "the following arguments are required"),
    ],
)
def test_usage_and_input_errors_exit_2(capsys, router, tmp_path, args, message, run):
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x00" * 600)
    paths = dict(missing=tmp_path / "missing", garbage=garbage, router=router)
    rc, out, err = run(*(a.format(**paths) for a in args))
    assert rc == 2 and out == ""
    assert message in err


def test_help_exits_0(capsys, run):
    rc, out, _ = run("--help")
    assert rc == 0 and "exit codes" in out


def test_python_dash_m(router):
    done = subprocess.run(
        [sys.executable, "-m", "onebit_predict.commands.stats", str(router), "--layers", "9"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr and "--layers [9]" in done.stderr
    done = subprocess.run(
        [sys.executable, "-m", "onebit_predict.commands.stats", str(router), "--json"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and json.loads(done.stdout)["traces"][0]["total"]["tokens"] == 3


def test_engines_agree_through_the_command(capsys, router, run):
    rc_c, out_c, _ = run(router, "--json")
    rc_np, out_np, _ = run(router, "--json", "--engine", "numpy")
    assert rc_c == rc_np == 0
    assert json.loads(out_c)["traces"][0]["total"] == json.loads(out_np)["traces"][0]["total"]


def test_kernel_that_cannot_be_built_is_a_usage_error(capsys, router, monkeypatch, run):
    from onebit_predict.commands import stats as cli_stats
    from onebit_predict.metrics.stats_kernel import StatsKernelError

    def no_compiler(*_args, **_kw):
        raise StatsKernelError("the stats kernel needs a C compiler")

    monkeypatch.setattr(cli_stats, "compute_stats", no_compiler)
    rc, out, err = run(router)
    assert rc == 2 and out == ""
    assert "needs a C compiler" in err and "--engine numpy" in err
