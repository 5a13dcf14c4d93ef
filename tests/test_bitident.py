"""The bit-identity check on every covered architecture, and its negative control.

Off vs router vs block must be byte-identical in every scenario and must have predicted;
with ONEBIT_MOE_PREDICT_DEBUG_LEAK=1 (block stores its speculative state) the same check
must fail, so a pass means something.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onebit_predict import cli_bitident
from onebit_predict.bitident import first_mismatch, prediction_problem
from onebit_predict.constants import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, MODE_ROUTER
from onebit_predict.tiny import TINY_ARCHS
from onebit_predict.trace import TraceHeader
from onebit_predict.trace_writer import TraceWriter

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_identical_and_predicted(arch, tiny_model, capsys):
    rc = cli_bitident.main([str(tiny_model(arch)), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == EXIT_OK, report
    assert report["identical"] is True
    scenarios = {r["scenario"] for r in report["results"]}
    assert scenarios == {"prefill+decode", "prefill+decode flash-attn", "prefill+decode 1 thread",
                         "two sequences", "save+restore"}
    for r in report["results"]:
        assert r["mismatch"] is None and r["problem"] is None
        assert r["ran"] == r["mode"]  # block really ran block on every covered architecture
        assert r["predicted_rows"] > 0


@pytest.mark.parametrize("name", ["qwen3moe-tiny", "qwen4exp-tiny"])
def test_trained_models_identical(name, capsys):
    """The bundled trained models hold F16 weights, which a CPU with AMX multiplies in its AMX
    buffer: the batched AMX path (patch 0007) broke the "two sequences" scenario on qwen4exp
    before it was fixed, while the F32 tiny random models never reach it."""
    model = REPO_ROOT / "models" / f"{name}.gguf"
    rc = cli_bitident.main([str(model), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == EXIT_OK, [r for r in report["results"] if not r["ok"]]
    assert len(report["results"]) == 5 * 4  # every scenario, every default mode


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_leaky_block_is_caught(arch, tiny_model, capsys):
    rc = cli_bitident.main([str(tiny_model(arch)), "--debug-leak", "--scenarios", "prefill+decode,save+restore",
                            "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == EXIT_CHECK_FAILED
    by_mode = {(r["scenario"], r["mode"]): r for r in report["results"]}
    for scenario in ("prefill+decode", "save+restore"):
        assert by_mode[(scenario, "block")]["mismatch"] is not None  # the leak changed the bytes
        assert by_mode[(scenario, "router")]["mismatch"] is None  # the switch only touches block


def test_usage_errors(tmp_path, capsys):
    assert cli_bitident.main([str(tmp_path / "missing.gguf")]) == EXIT_USAGE
    assert cli_bitident.main([str(tmp_path), "--modes", "sideways"]) == EXIT_USAGE
    assert cli_bitident.main([str(tmp_path), "--scenarios", "nope"]) == EXIT_USAGE
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf")
    assert cli_bitident.main([str(tmp_path / "junk.gguf")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "no such file" in err and "--modes" in err and "unknown scenario" in err and "could not load" in err


def test_first_mismatch_reports_row_and_index():
    a = np.arange(6, dtype=np.float32)
    b = a.copy()
    b[4] = np.nextafter(b[4], np.float32(10))  # one ulp: a tolerance would call it equal
    rows_a = [a[:3].tobytes(), a[3:].tobytes()]
    rows_b = [b[:3].tobytes(), b[3:].tobytes()]
    m = first_mismatch(rows_a, rows_b)
    assert (m.row, m.vocab, m.off) == (1, 1, 4.0) and m.other != 4.0
    assert first_mismatch(rows_a, rows_a) is None
    assert first_mismatch(rows_a, rows_a[:1]).row == 1  # a missing row is a difference


def _trace(path, rows, layers_predicted):
    header = TraceHeader.build(n_layer=3, n_expert=4, n_expert_used=2, mode=MODE_ROUTER, arch="qwen3moe")
    with TraceWriter(path, header) as w:
        for pos in range(rows):
            for layer in range(3):
                pred = [0, 1] if layer in layers_predicted else None
                w.add(step=pos, seq_id=0, pos=pos, layer=layer, actual=[0, 1], pred=pred,
                      logits=[1.0, 0.5] if pred else None)
    return path


def test_prediction_problem_requires_every_row(tmp_path):
    full = _trace(tmp_path / "full.bin", 5, {1, 2})
    assert prediction_problem(full, 5)[1] is None
    assert "layer 1" in prediction_problem(full, 6)[1]  # a routed row without a record
    partial = _trace(tmp_path / "partial.bin", 5, {1})
    assert "layer 2: 0 predicted" in prediction_problem(partial, 5)[1]
    none = _trace(tmp_path / "none.bin", 5, set())
    assert "layer 1: 0 predicted" in prediction_problem(none, 5)[1]


@pytest.mark.parametrize("layer, mixer", [(2, "DeltaNet"), (3, "attention")])
def test_leak_caught_for_each_mixer(layer, mixer, tiny_model):
    """qwen3next alternates DeltaNet (layers 0, 2) and attention (1, 3): predicting one layer at a
    time, block is identical to off and its leaky twin is not, whichever mixer it runs."""
    from onebit_predict.runner import Context, ContextSettings, Model

    def logits(env):
        with Model(tiny_model("qwen3next")) as m, Context(m, ContextSettings(n_ubatch=8), env) as ctx:
            toks = np.random.default_rng(1).integers(0, m.n_vocab, size=40).tolist()
            rows = ctx.decode(toks[:24], range(24), [0] * 24, [True] * 24)
            for i in range(16):
                rows += ctx.decode([toks[24 + i]], [24 + i], [0], [True])
            return rows

    base = {"ONEBIT_MOE_PREDICT": "block", "ONEBIT_MOE_PREDICT_LAYERS": str(layer)}
    off = logits({})
    assert logits(base) == off
    assert logits(base | {"ONEBIT_MOE_PREDICT_DEBUG_LEAK": "1"}) != off, mixer
