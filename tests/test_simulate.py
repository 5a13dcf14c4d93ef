"""onebit-stats simulate: the drive queue, the worked case of docs/cost-model.md reproduced
exactly, expert bytes from a GGUF, units, the command's outputs and exit codes, --plot, and
a real trace.
"""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onebit_predict.commands.stats import main as stats_main
from onebit_predict.commands.trace import main as trace_main
from onebit_predict.constants import EXIT_OK, EXIT_USAGE, MODE_ROUTER
from onebit_predict.costmodel.expert_bytes import ModelError, expert_bytes_from_gguf
from onebit_predict.costmodel.replay import CacheConfig
from onebit_predict.costmodel.routing import load_routing
from onebit_predict.costmodel.simulate import PRED_NONE, ComputeModel, Drive, DriveModel, simulate
from onebit_predict.trace import Trace, TraceHeader
from onebit_predict.trace_writer import TraceWriter
from onebit_predict.units import parse_bandwidth, parse_size

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "models"


# --- the drive ----------------------------------------------------------------------------


def test_drive_fifo_queue():
    # 1 MB at 1 GB/s = 1 ms of transfer, 0.5 ms latency
    one = Drive(DriveModel(1e9, 0.5, 1))
    assert [one.read(0.0, 1e6) for _ in range(3)] == [1.5, 3.0, 4.5]  # nothing overlaps at depth 1
    two = Drive(DriveModel(1e9, 0.5, 2))
    # depth 2: the second read's latency overlaps the first transfer; the third enters
    # service when the first completes (1.5), its data flows from 2.0, after the second (2.5)
    assert [two.read(0.0, 1e6) for _ in range(3)] == [1.5, 2.5, 3.5]
    late = Drive(DriveModel(1e9, 0.5, 2))
    assert late.read(0.0, 1e6) == 1.5 and late.read(10.0, 1e6) == 11.5  # an idle drive starts afresh


# --- the worked case of docs/cost-model.md ------------------------------------------------

# 2 layers, 4 experts, top-1, depth 1, layer 1 predicted (router); one sequence: a prefill
# row at pos 0, then 3 decode tokens (pos 1..3).
CASE_ACTUAL = {0: [0, 0, 1, 1], 1: [2, 2, 3, 2]}
CASE_ROUTER = [None, [2], [0], [2]]  # right, wrong, right
CASE_ARGS = [
    "--expert-bytes",
    "1MB",
    "--bandwidth",
    "0.5GB/s",
    "--latency-us",
    "1000",
    "--queue-depth",
    "1",
    "--layer-ms",
    "2",
    "--route-at",
    "0.5",
    "--slots",
    "1",
    "--policy",
    "lru",
]


def make_case(path: Path) -> Path:
    h = TraceHeader.build(
        n_layer=2,
        n_expert=4,
        n_expert_used=1,
        depth=1,
        mode=MODE_ROUTER,
        layers={1},
        arch="qwen3moe",
        model="worked case",
    )
    with TraceWriter(path, h) as w:
        for pos in range(4):
            for layer in range(2):
                pred = CASE_ROUTER[pos] if layer == 1 else None
                w.add(
                    step=pos,
                    seq_id=0,
                    pos=pos,
                    layer=layer,
                    actual=[CASE_ACTUAL[layer][pos]],
                    pred=pred,
                    decode=pos > 0,
                )
    return path


@pytest.fixture
def case(tmp_path):
    return make_case(tmp_path / "case.trace")


@pytest.fixture
def run(run_cli):
    """``run(*args)``: onebit-stats simulate with args (exit code, stdout, stderr)."""
    return lambda *args: run_cli(stats_main, "simulate", *args)


def runs_of(out: str) -> dict[str, dict]:
    return {r["predictor"]: r for r in json.loads(out)["runs"]}


def assert_worked_runs(runs: dict[str, dict], expected: dict[str, tuple], none_ms: float) -> None:
    """Every run of the worked case (3 tokens, 1 MB reads) against (total ms, stalls, stall ms,
    late, reads, wasted reads, hit rate) worked out by hand."""
    for name, (total, stalls, stall_ms, late, reads, wasted, hit) in expected.items():
        x = runs[name]
        assert x["total_ms"] == total, name
        assert x["tok_s"] == pytest.approx(3000.0 / total, rel=1e-15), name
        assert (x["stalls"], x["stall_ms_per_token"] * 3, x["late"]) == (stalls, pytest.approx(stall_ms), late), name
        assert (x["bytes_read"], x["bytes_wasted"]) == (reads * 1e6, wasted * 1e6), name
        assert x["hit_rate"] == pytest.approx(hit), name
        assert x["speedup"] == pytest.approx(none_ms / total), name


def test_worked_case(capsys, case, run):
    rc, out, _ = run(case, *CASE_ARGS, "--json")
    assert rc == EXIT_OK
    r = runs_of(out)
    assert list(r) == ["none", "previous-token", "router", "oracle"]
    expected = {  # predictor: (total ms, stalls, stall ms, late, reads, wasted reads, hit rate)
        "none": (27.0, 5, 15.0, 0, 5, 0, 1 / 6),
        "previous-token": (25.0, 5, 13.0, 1, 5, 0, 2 / 6),
        "router": (24.0, 5, 12.0, 2, 6, 1, 3 / 6),
        "oracle": (21.0, 5, 9.0, 3, 5, 0, 4 / 6),
    }
    assert_worked_runs(r, expected, none_ms=27.0)
    assert all(x["spent_pct"] == 0.0 for x in r.values())
    assert r["router"]["saved_pct"] == pytest.approx(100 * 3 / 27)


def test_worked_case_with_the_predictor_cost(capsys, case, run):
    # 25 % of a token's compute (2 layers x 2 ms) = 1 ms, paid by layer 0 (it predicts layer 1)
    rc, out, _ = run(case, *CASE_ARGS, "--predictor-cost-pct", "25", "--json")
    assert rc == EXIT_OK
    report = json.loads(out)
    assert report["model"]["cost_ms_by_layer"] == {"0": 1.0}
    r = runs_of(out)
    assert r["router"]["total_ms"] == 27.0 and r["router"]["stalls"] == 5 and r["router"]["late"] == 2
    assert r["router"]["spent_pct"] == pytest.approx(100 * 3 / 27)  # 11.1 %
    assert r["router"]["saved_pct"] == 0.0
    assert r["oracle"]["total_ms"] == 21.0  # only the trace's predictor pays
    rc, out, _ = run(case, *CASE_ARGS, "--predictor-cost-pct", "25")
    assert "router: spent 11.1 %, saved 0.0 %" in out


def test_worked_case_cold(capsys, case, run):
    """--cold: every layer's cache is emptied before each token (onebit-bench --cold).

    Same model as the worked case; a read on an idle drive takes 3 ms (1 latency + 2
    transfer), Q = 1; a layer is 1 ms, routing, wait for its experts, 1 ms. Layer 0 now
    misses at every token (t3's layer-0 hit of the warm run is gone); layer 1 hits only on
    its own token's prefetch.

    none: every layer reads on demand, stalls 3 ms, lasts 5 ms: t1 L0 R1 0: 1->4 E5, L1 R6
      2: 6->9 E10; t2 L0 R11 ->14 E15, L1 R16 ->19 E20; t3 L0 R21 1: 21->24 E25, L1 R26
      ->29 E30. 30 ms (100.0 tok/s), 6 reads, 6 stalls, 18 ms, 0 late, hit rate 0.
    previous-token (P = 2, 2, 3): t1 L0 R1 0: 1->4, prefetch 2: 4->7, E5; L1 R6 late hit
      (7) E8. t2 L0 R9 1: 9->12, prefetch 2 (the cache is empty: read again, wrong):
      12->15, E13; L1 R14 demand 3 waits for it: 15->18, E19. t3 L0 R20 1: 20->23,
      prefetch 3 (wrong): 23->26, E24; L1 R25 demand 2: 26->29, E30. 30 ms, 8 reads
      (2 wasted), 6 stalls, 3+1+3+4+3+4 = 18 ms, 1 late, hit rate 1/6, speedup 1.
    router (P = 2, 0, 2): t1 and t2 as warm (E8, E19: the wrong prefetch 0 at t2). t3 L0
      R20 misses 1: 20->23, prefetch 2: 23->26, E24; L1 R25 late hit (26) E27. 27 ms,
      7 reads (1 wasted), 6 stalls, 3+1+3+4+3+1 = 15 ms, 2 late, hit rate 2/6, speedup
      30/27, saved 10 %.
    oracle (P = 2, 3, 2): t1 E8; t2 L0 R9 1: 9->12, prefetch 3: 12->15, E13; L1 R14 late
      (15) E16; t3 L0 R17 1: 17->20, prefetch 2: 20->23, E21; L1 R22 late (23) E24.
      24 ms, 6 reads, 6 stalls, 3+1+3+1+3+1 = 12 ms, 3 late, hit rate 3/6, speedup 1.25.
    """
    rc, out, _ = run(case, *CASE_ARGS, "--cold", "--json")
    assert rc == EXIT_OK
    report = json.loads(out)
    assert report["model"]["cold"] is True
    r = runs_of(out)
    expected = {  # predictor: (total ms, stalls, stall ms, late, reads, wasted reads, hit rate)
        "none": (30.0, 6, 18.0, 0, 6, 0, 0.0),
        "previous-token": (30.0, 6, 18.0, 1, 8, 2, 1 / 6),
        "router": (27.0, 6, 15.0, 2, 7, 1, 2 / 6),
        "oracle": (24.0, 6, 12.0, 3, 6, 0, 3 / 6),
    }
    assert_worked_runs(r, expected, none_ms=30.0)
    assert r["router"]["saved_pct"] == pytest.approx(10.0)
    rc, out, _ = run(case, *CASE_ARGS, "--json")
    assert json.loads(out)["model"]["cold"] is False
    rc, out, _ = run(case, *CASE_ARGS, "--cold", "--csv")
    table = list(csv.DictReader(io.StringIO(out)))
    assert [row["cold"] for row in table] == ["1"] * 4 and float(table[0]["tok_s"]) == pytest.approx(100.0)
    rc, out, _ = run(case, *CASE_ARGS, "--cold")
    assert "cold (emptied before every token)" in out and "router: spent 0.0 %, saved 10.0 %" in out


@st.composite
def random_routing(draw):
    """A small random trace (router mode, every layer from 1 predicted) and a drive."""
    n_layer = draw(st.integers(1, 3))
    n_expert = draw(st.integers(2, 8))
    n_used = draw(st.integers(1, min(3, n_expert)))
    n_tok = draw(st.integers(1, 12))
    picks = st.permutations(range(n_expert))
    actual = [[draw(picks)[:n_used] for _ in range(n_layer)] for _ in range(n_tok + 1)]
    pred = [[draw(picks)[:n_used] for _ in range(n_layer)] for _ in range(n_tok + 1)]
    slots = draw(st.integers(n_used, n_expert + 1))
    policy = draw(st.sampled_from(["lru", "lfru", "belady"]))
    drive = (draw(st.sampled_from([0.2e9, 1e9, 5e9])), draw(st.sampled_from([0.0, 0.1, 1.0])), draw(st.integers(1, 4)))
    compute = ComputeModel(draw(st.sampled_from([0.0, 0.3, 2.0])), draw(st.sampled_from([0.0, 0.3, 1.0])))
    return n_layer, n_expert, n_used, actual, pred, slots, policy, drive, compute


@settings(max_examples=60, deadline=None)
@given(random_routing())
def test_cold_none_reads_every_expert_and_is_never_faster(case_):
    """--cold: "none" never hits and reads every demanded expert; it is never faster than
    the warm run (it issues a superset of the warm run's reads, no earlier)."""
    import tempfile

    n_layer, n_expert, n_used, actual, pred, slots, policy, (bw, lat, q), compute = case_
    h = TraceHeader.build(
        n_layer=n_layer,
        n_expert=n_expert,
        n_expert_used=n_used,
        depth=n_used,
        mode=MODE_ROUTER,
        layers=set(range(1, n_layer)),
        arch="qwen3moe",
        model="random",
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.trace"
        with TraceWriter(path, h) as w:
            for pos in range(len(actual)):
                for layer in range(n_layer):
                    w.add(
                        step=pos,
                        seq_id=0,
                        pos=pos,
                        layer=layer,
                        actual=actual[pos][layer],
                        pred=pred[pos][layer] if layer >= 1 and pos > 0 else None,
                        decode=pos > 0,
                    )
        routing = load_routing(Trace.open(path))
    size = {layer: 1e6 for layer in range(n_layer)}
    res = {
        cold: simulate(routing, size, CacheConfig(slots, policy, cold=cold), compute, [bw], lat, q)
        for cold in (False, True)
    }
    cold, warm = res[True].run(PRED_NONE, bw), res[False].run(PRED_NONE, bw)
    demand = (len(actual) - 1) * n_layer * n_used
    assert cold.counts.demand == demand and cold.counts.hits == 0 and cold.counts.hit_rate == 0
    assert cold.counts.demand_reads == demand and cold.bytes_read == demand * 1e6
    assert cold.total_ms >= warm.total_ms
    for name in res[True].predictors:  # under --cold a hit is exactly a useful prefetch of its own token
        r = res[True].run(name, bw)
        assert r.counts.hits == r.counts.prefetch_useful


def test_table_and_csv(capsys, case, run):
    rc, out, _ = run(case, *CASE_ARGS[:2], "--bandwidth", "0.5GB/s,1GB/s", *CASE_ARGS[4:])
    assert rc == EXIT_OK
    at_half, at_one = out.split("bandwidth 1 GB/s")
    assert "bandwidth 500 MB/s" in at_half
    oracle = [line.split() for line in out.splitlines() if line.lstrip().startswith("oracle")]
    assert [row[3] for row in oracle] == ["142.9", "187.5"]  # 3 tokens in 21 ms, then in 16 ms
    assert "router: spent 0.0 %, saved 11.1 %" in at_half  # 24 ms against 27
    assert "router: spent 0.0 %, saved 18.2 %" in at_one  # 18 ms against 22
    assert "per-layer hit rate" in at_one
    rc, out, _ = run(case, *CASE_ARGS, "--csv")
    table = list(csv.DictReader(io.StringIO(out)))
    assert [r["predictor"] for r in table] == ["none", "previous-token", "router", "oracle"]
    assert float(table[2]["tok_s"]) == pytest.approx(125.0)


def test_bench_json(capsys, case, tmp_path, run):
    bench = tmp_path / "bench.json"
    bench.write_text(
        json.dumps(
            {
                "rows": [
                    {"name": "patched off", "median_tok_s": 250.0, "ratio_to_off": 1.0},
                    {"name": "router", "median_tok_s": 200.0, "ratio_to_off": 0.8},
                ]
            }
        )
    )
    # 250 tok/s over 2 layers: 2 ms a layer; router at 0.8 of off costs 25 %
    args = [a for a in CASE_ARGS if a not in ("--layer-ms", "2")]
    rc, out, _ = run(case, *args, "--bench-json", bench, "--json")
    assert rc == EXIT_OK
    model = json.loads(out)["model"]
    assert model["layer_ms"] == pytest.approx(2.0) and model["predictor_cost_pct"] == pytest.approx(25.0)
    assert runs_of(out)["router"]["total_ms"] == pytest.approx(27.0)


# --- expert bytes and units ---------------------------------------------------------------


def test_expert_bytes_of_the_bundled_models():
    for name in ("qwen3moe-tiny", "qwen4exp-tiny"):
        per_layer, n_expert = expert_bytes_from_gguf(MODELS / f"{name}.gguf")
        # gate, up, down: 64 x 64 F16 each = 8192 bytes per expert and tensor
        assert n_expert == 16 and per_layer == {layer: 3 * 64 * 64 * 2 for layer in range(8)}


def dense_gguf(path: Path) -> Path:
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_model_without_experts_is_refused(tmp_path):
    with pytest.raises(ModelError, match="no routed-expert tensors"):
        expert_bytes_from_gguf(dense_gguf(tmp_path / "dense.gguf"))


@pytest.mark.parametrize(
    "text, value", [("3GB/s", 3e9), ("3 GB/s", 3e9), ("500MiB/s", 500 * 2**20), ("7e9", 7e9), ("1.5gB/s", 1.5e9)]
)
def test_parse_bandwidth(text, value):
    assert parse_bandwidth(text) == value


@pytest.mark.parametrize("text", ["3Gb/s", "fast", "0GB/s", "-1GB/s", "3XB/s", "", "GB/s", "inf"])
def test_bad_bandwidth(text):
    with pytest.raises(ValueError):
        parse_bandwidth(text)


def test_parse_size():
    assert parse_size("6.75MiB") == 6.75 * 2**20
    assert parse_size("2856960") == 2856960
    assert parse_size("1kB") == 1000
    with pytest.raises(ValueError, match="bits"):
        parse_size("8Mb")


# --- exit codes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["{missing}", "--expert-bytes", "1MB", "--bandwidth", "3GB/s", "--layer-ms", "1"], "No such file"),
        (["{case}", "--expert-bytes", "1MB", "--bandwidth", "3Gb/s", "--layer-ms", "1"], "is not a bandwidth"),
        (["{case}", "--expert-bytes", "1MB", "--bandwidth", "fast", "--layer-ms", "1"], "'fast' is not a bandwidth"),
        (
            ["{case}", "--expert-bytes", "1MB", "--bandwidth", "3GB/s", "--layer-ms", "1", "--slots", "0"],
            "'0' is not a positive integer",
        ),
        (["{case}", "--expert-bytes", "lots", "--bandwidth", "3GB/s", "--layer-ms", "1"], "'lots' is not a size"),
        (["{case}", "--model", "{dense}", "--bandwidth", "3GB/s", "--layer-ms", "1"], "no routed-expert tensors"),
        (
            ["{case}", "--model", "{qwen3moe}", "--bandwidth", "3GB/s", "--layer-ms", "1"],
            "has 16 experts per layer, the trace 4",
        ),
        (["{case}", "--model", "{missing}", "--bandwidth", "3GB/s", "--layer-ms", "1"], "no such file"),
        (["{case}", "--expert-bytes", "1MB", "--bandwidth", "3GB/s"], "--layer-ms MS or --bench-json"),
        (["{case}", "--bandwidth", "3GB/s", "--layer-ms", "1"], "one of the arguments --model --expert-bytes"),
        (
            ["{case}", "--expert-bytes", "1MB", "--model", "{qwen3moe}", "--bandwidth", "3GB/s", "--layer-ms", "1"],
            "not allowed with",
        ),
        (
            ["{case}", "--expert-bytes", "1MB", "--bandwidth", "3GB/s", "--layer-ms", "1", "--route-at", "2"],
            "'2' is not in [0, 1]",
        ),
        (
            ["{case}", "--expert-bytes", "1MB", "--bandwidth", "3GB/s", "--layer-ms", "-1"],
            "'-1' is not a finite number >= 0",
        ),
        (["{case}", "--expert-bytes", "1MB", "--bandwidth", "3GB/s", "--bench-json", "{missing}"], "--bench-json"),
    ],
)
def test_usage_and_input_errors_exit_2(capsys, case, tmp_path, args, message, run):
    paths = dict(
        missing=tmp_path / "missing",
        case=case,
        dense=dense_gguf(tmp_path / "dense.gguf"),
        qwen3moe=MODELS / "qwen3moe-tiny.gguf",
    )
    rc, out, err = run(*(a.format(**paths) for a in args))
    assert rc == EXIT_USAGE and out == ""
    assert message in err


def test_slots_below_n_used_exit_2(capsys, tmp_path, run):
    path = tmp_path / "top2.trace"
    with TraceWriter(path, TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=2)) as w:
        w.add(step=0, seq_id=0, pos=0, layer=0, actual=[0, 1])
    rc, _, err = run(path, "--expert-bytes", "1MB", "--bandwidth", "3GB/s", "--layer-ms", "1", "--slots", "1")
    assert rc == EXIT_USAGE and "n_expert_used (2)" in err


# --- --plot -------------------------------------------------------------------------------


def test_plot(capsys, case, tmp_path, run):
    pytest.importorskip("matplotlib")
    png = tmp_path / "sim.png"
    rc, out, err = run(case, *CASE_ARGS, "--plot", png)
    assert rc == EXIT_OK and "wrote" in err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bandwidth 500 MB/s" in out and "bandwidth 1 GB/s" not in out  # the sweep is only plotted


def test_plot_without_matplotlib(capsys, case, tmp_path, no_matplotlib, run):
    rc, out, err = run(case, *CASE_ARGS, "--plot", tmp_path / "x.png")
    assert rc == EXIT_USAGE and out == ""
    assert "--plot needs matplotlib" in err and "onebit-predict[plot]" in err


# --- a real trace from the patched build --------------------------------------------------


def test_real_trace(tiny_model, tmp_path, capsys, run):
    """A trace llama.cpp wrote, sized by its own GGUF: the oracle reads no more than none and
    is never slower; every predictor's bytes are whole expert reads."""
    model = tiny_model("qwen3moe")
    out = tmp_path / "block.bin"
    rc = trace_main(
        [str(model), "--mode", "block", "--out", str(out), "--tokens", "24", "--generate", "24", "--ubatch", "8"]
    )
    assert rc == EXIT_OK
    capsys.readouterr()
    per_layer, _ = expert_bytes_from_gguf(model)
    assert len(set(per_layer.values())) == 1
    size = per_layer[0]
    rc, text, err = run(out, "--model", model, "--bandwidth", "100MB/s,1GB/s", "--layer-ms", "0.05", "--json")
    assert rc == EXIT_OK, err
    report = json.loads(text)
    assert report["tokens"] == 24
    for bw in (1e8, 1e9):
        r = {x["predictor"]: x for x in report["runs"] if x["bandwidth"] == bw}
        assert list(r) == ["none", "previous-token", "block", "oracle"]
        assert r["oracle"]["bytes_read"] <= r["none"]["bytes_read"]
        assert r["oracle"]["tok_s"] >= r["none"]["tok_s"]
        for x in r.values():
            reads = x["bytes_read"] / size
            assert reads == int(reads) and x["bytes_wasted"] <= x["bytes_read"]
    assert Trace.open(out).header.mode_name == "block"


def _ahead_case(path: Path, ahead: int) -> Path:
    """3 layers, 4 experts, 1 used; layers 0 and 1 always use expert 0 (hits after the first
    token: the drive idles there), layer 2 a new one each token, predicted (from layer 2-ahead)."""
    h = TraceHeader.build(n_layer=3, n_expert=4, n_expert_used=1, depth=1, mode=MODE_ROUTER, layers={2}, ahead=ahead)
    with TraceWriter(path, h) as w:
        for pos in range(4):
            for layer in range(3):
                actual = [pos % 4 if layer == 2 else 0]
                pred = actual if layer == 2 else None
                w.add(step=pos, seq_id=0, pos=pos, layer=layer, actual=actual, pred=pred, distance=ahead)
    return path


def test_prefetch_issued_k_layers_ahead(tmp_path, run):
    """A prediction K layers out is issued at layer l-K's routing instant: with a read taking two
    layers' compute (4 ms against 2), two layers of lead stall less than one, and the cost lands
    on layer l-K."""
    args = ("--expert-bytes", "1MB", "--bandwidth", "0.25GB/s", "--latency-us", "0", "--queue-depth", "1",
            "--layer-ms", "2", "--route-at", "0.5", "--slots", "1", "--policy", "lru",
            "--predictor-cost-pct", "10", "--json")  # fmt: skip
    total = {}
    for k in (1, 2):
        rc, out, _ = run(_ahead_case(tmp_path / f"k{k}.trace", k), *args)
        assert rc == EXIT_OK
        report = json.loads(out)
        assert report["model"]["cost_ms_by_layer"] == {str(2 - k): pytest.approx(0.6)}  # 10 % of 3 x 2 ms
        total[k] = runs_of(out)["oracle"]["total_ms"]
    assert total[2] < total[1]
