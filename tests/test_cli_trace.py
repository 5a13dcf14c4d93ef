"""onebit-trace and onebit-tiny end to end on the patched build: a real trace, read back.

Also holds the C++ _STATS table to onebit-stats: the same run must give the same counts.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

from onebit_predict.commands.tiny import main as tiny_main
from onebit_predict.commands.trace import main as trace_main
from onebit_predict.constants import EXIT_OK, EXIT_USAGE, TRACE_FLAG_DECODE, TRACE_FLAG_PREDICTED
from onebit_predict.llama.tiny import write_tiny_model
from onebit_predict.metrics.stats import compute_stats
from onebit_predict.trace import Trace

N_PROMPT = 20
N_GEN = 12


@pytest.mark.parametrize("mode", ["router", "block"])
def test_trace_recorded_and_read(mode, tiny_model, tmp_path, capsys):
    out = tmp_path / f"{mode}.bin"
    rc = trace_main(
        [
            str(tiny_model("qwen3moe")),
            "--mode",
            mode,
            "--out",
            str(out),
            "--tokens",
            str(N_PROMPT),
            "--generate",
            str(N_GEN),
            "--ubatch",
            "8",
            "--depth",
            "4",
            "--stats",
        ]
    )
    assert rc == EXIT_OK
    table = capsys.readouterr().out
    assert "qwen3moe" in table and "total" in table
    trace = Trace.open(out)
    h = trace.header
    assert (h.arch, h.n_layer, h.n_expert, h.n_expert_used, h.depth) == ("qwen3moe", 4, 8, 2, 4)
    assert h.mode_name == mode and h.layer_mask == frozenset({1, 2, 3})
    rec = trace.records
    # every token is routed through every layer, except that qwen3moe computes its last
    # layer only for the rows that ask for logits: the prompt's last row and each generated token
    n_tokens = N_PROMPT + N_GEN
    for layer in range(3):
        assert np.count_nonzero(rec["layer"] == layer) == n_tokens
    assert np.count_nonzero(rec["layer"] == 3) == 1 + N_GEN
    decode = (rec["flags"] & TRACE_FLAG_DECODE) != 0
    assert np.count_nonzero(decode) == 4 * N_GEN
    predicted = (rec["flags"] & TRACE_FLAG_PREDICTED) != 0
    assert np.array_equal(predicted, rec["layer"] >= 1)
    assert np.all(rec["pred_ids"][predicted] >= 0) and np.all(rec["pred_ids"][predicted] < 8)
    stats = compute_stats(trace)
    assert stats.issues == ()
    assert stats.total.tokens == 3 * N_GEN


def test_native_stats_table_matches_onebit_stats(tiny_model, tmp_path, capfd):
    """ONEBIT_MOE_PREDICT_STATS (printed by llama.cpp) and onebit-stats count the same rows."""
    from onebit_predict.llama.runner import Context, ContextSettings, Model, builtin_tokens

    out = tmp_path / "native.bin"
    env = {
        "ONEBIT_MOE_PREDICT": "block",
        "ONEBIT_MOE_PREDICT_DEPTH": "3",
        "ONEBIT_MOE_PREDICT_MARGIN": "0.02",
        "ONEBIT_MOE_PREDICT_OUT": str(out),
        "ONEBIT_MOE_PREDICT_STATS": "1",
    }
    toks = builtin_tokens(N_PROMPT + N_GEN, 64, 3)
    with Model(tiny_model("qwen3moe")) as model, Context(model, ContextSettings(n_ubatch=8), env) as ctx:
        ctx.decode(toks[:N_PROMPT], range(N_PROMPT), [0] * N_PROMPT, [False] * (N_PROMPT - 1) + [True])
        for i in range(N_GEN):
            ctx.decode([toks[N_PROMPT + i]], [N_PROMPT + i], [0], [True])
    err = capfd.readouterr().err
    native = {}
    for m in re.finditer(r"onebit:\s+(\d+|total)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s", err):
        native[m.group(1)] = tuple(int(m.group(i)) for i in range(2, 7))
    stats = compute_stats(Trace.open(out))
    assert stats.issues == ()
    for layer in (1, 2, 3):
        c = stats.layers[layer]
        assert native[str(layer)] == (c.tokens, c.actual, c.read, c.gated, c.hits_read)
    t = stats.total
    assert native["total"] == (t.tokens, t.actual, t.read, t.gated, t.hits_read)
    assert t.gated > 0  # the margin gate really dropped candidates


def test_trace_usage_errors(tmp_path, tiny_model, capsys):
    assert trace_main([str(tmp_path / "none.gguf"), "--mode", "router", "--out", "x"]) == EXIT_USAGE
    model = str(tiny_model("qwen3moe"))
    assert trace_main([model, "--mode", "router", "--out", str(tmp_path / "t"), "--tokens", "0"]) == EXIT_USAGE
    assert (
        trace_main([model, "--mode", "router", "--out", str(tmp_path / "t"), "--tokens", "500", "--ctx", "256"])
        == EXIT_USAGE
    )
    assert (
        trace_main(
            [model, "--mode", "router", "--out", str(tmp_path / "t"), "--prompt-file", str(tmp_path / "nope.txt")]
        )
        == EXIT_USAGE
    )
    assert trace_main([model, "--mode", "sideways", "--out", "x"]) == EXIT_USAGE  # argparse's usage error
    err = capsys.readouterr().err
    assert "no such file" in err and "--tokens" in err and "exceeds --ctx" in err


@pytest.mark.needs_build
def test_tiny_is_deterministic_and_checked(tmp_path, capsys):
    a = write_tiny_model("olmoe", tmp_path / "a.gguf", seed=5)
    b = write_tiny_model("olmoe", tmp_path / "b.gguf", seed=5)
    c = write_tiny_model("olmoe", tmp_path / "c.gguf", seed=6)
    assert a.read_bytes() == b.read_bytes() != c.read_bytes()
    assert tiny_main(["--arch", "olmoe", "--out", str(tmp_path / "d.gguf"), "--seed", "-1"]) == EXIT_USAGE
    assert tiny_main(["--arch", "llama", "--out", str(tmp_path / "e.gguf")]) == EXIT_USAGE  # argparse's usage error
    assert "seed" in capsys.readouterr().err


def test_prefill_then_teacher_forced_decode(tiny_model, tmp_path):
    """--prefill N: the rest of the prompt is decoded one token per step, so it is scored."""
    out = tmp_path / "tf.bin"
    rc = trace_main(
        [
            str(tiny_model("qwen3next")),
            "--mode",
            "block",
            "--out",
            str(out),
            "--tokens",
            "20",
            "--prefill",
            "4",
            "--generate",
            "3",
        ]
    )
    assert rc == EXIT_OK
    rec = Trace.open(out).records
    n_decoded = 20 - 4 + 3
    decode = (rec["flags"] & TRACE_FLAG_DECODE) != 0
    assert np.count_nonzero(decode & (rec["layer"] == 1)) == n_decoded
    assert rec[decode & (rec["layer"] == 0)]["pos"].tolist() == list(range(4, 4 + n_decoded))


def test_bytes_needs_a_byte_vocabulary(tiny_model, tmp_path, capsys):
    model = str(tiny_model("qwen3moe"))  # 64 ids: not a byte-level model
    out = str(tmp_path / "t")
    assert trace_main([model, "--mode", "router", "--out", out, "--tokens", "5", "--bytes"]) == EXIT_USAGE
    assert trace_main([model, "--mode", "router", "--out", out, "--prompt", "abc", "--bytes"]) == EXIT_USAGE
    assert trace_main([model, "--mode", "router", "--out", out, "--tokens", "5", "--prefill", "0"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--bytes needs --prompt" in err and "at least 256 ids" in err and "--prefill" in err


def test_warmup_is_not_recorded(tiny_model, tmp_path):
    """A warmup decode (every expert used) writes no record; counting starts after it."""
    from onebit_predict.llama.runner import Context, ContextSettings, Model, llama

    lib = llama()
    out = tmp_path / "warm.bin"
    env = {"ONEBIT_MOE_PREDICT": "router", "ONEBIT_MOE_PREDICT_OUT": str(out)}
    with Model(tiny_model("qwen3moe")) as model, Context(model, ContextSettings(n_ubatch=8), env) as ctx:
        lib.llama_set_warmup(ctx.ptr, True)
        ctx.decode([1, 2], [0, 1], [0, 0], [False, True])
        lib.llama_set_warmup(ctx.ptr, False)
        assert out.stat().st_size == 512  # the header alone
        lib.llama_memory_clear(lib.llama_get_memory(ctx.ptr), True)
        ctx.decode([3], [0], [0], [True])
    rec = Trace.open(out).records
    assert len(rec) == 4 and set(rec["step"].tolist()) == {0}


def test_windows_restart_at_pos_zero(tiny_model, tmp_path):
    """--window N: each window is a fresh sequence from pos 0; its first rows are not scored."""
    out = tmp_path / "win.bin"
    rc = trace_main(
        [
            str(tiny_model("qwen3moe")),
            "--mode",
            "router",
            "--out",
            str(out),
            "--tokens",
            "30",
            "--window",
            "10",
            "--prefill",
            "2",
            "--generate",
            "0",
        ]
    )
    assert rc == EXIT_OK
    trace = Trace.open(out)
    rec = trace.records
    layer0 = rec[rec["layer"] == 0]
    assert layer0["pos"].tolist() == ([0, 1] + list(range(2, 10))) * 3
    stats = compute_stats(trace)
    assert stats.issues == ()
    assert stats.total.tokens == 3 * 8 * 3  # 3 windows x 8 decoded rows x 3 predicted layers


def test_no_extra_bufts_loads_the_plain_kernels_and_records_the_same_trace(tiny_model, tmp_path, monkeypatch):
    """--no-extra-bufts reaches the model's load (use_extra_bufts false: on an AMX VM the grown Q4_K_M models'
    prefill faults in ggml's AMX mul_mat without it), and on the tiny F32 model records the same routing."""
    from onebit_predict.llama import record

    loaded = []
    real = record.Model

    def spy(path, **kw):
        loaded.append(kw.get("extra_bufts", True))
        return real(path, **kw)

    monkeypatch.setattr(record, "Model", spy)
    model = str(tiny_model("qwen3moe"))
    args = ["--mode", "router", "--tokens", "12", "--prefill", "4", "--generate", "2"]
    assert trace_main([model, *args, "--out", str(tmp_path / "a.bin")]) == EXIT_OK
    assert trace_main([model, *args, "--out", str(tmp_path / "b.bin"), "--no-extra-bufts"]) == EXIT_OK
    assert loaded == [True, False]
    a, b = Trace.open(tmp_path / "a.bin").records, Trace.open(tmp_path / "b.bin").records
    assert np.array_equal(a["actual_ids"], b["actual_ids"])
