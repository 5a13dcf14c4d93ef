"""Grown models (onebit_predict/grow/, onebit-grow): the writer's shapes, zeros, keys and
determinism (gguf only), the sizing and llama-quantize's log, and the proof on the grown
qwen3moe-tiny (needs_build: the patched libllama runs both models)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from onebit_predict.commands import grow as grow_cli
from onebit_predict.grow import grow as g
from onebit_predict.grow.quantize import QuantizeFailed, fallbacks, summarize
from onebit_predict.grow.store import Store

REPO = Path(__file__).resolve().parent.parent
QWEN3 = REPO / "models" / "qwen3moe-tiny.gguf"
QWEN4 = REPO / "models" / "qwen4exp-tiny.gguf"


def _tensors(path: Path) -> dict[str, object]:
    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def _fields(path: Path) -> dict[str, object]:
    return {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("src", [QWEN3, QWEN4], ids=["qwen3moe", "qwen4exp"])
def test_grow_shapes_zeros_keys(src, tmp_path):
    out = g.grow(src, tmp_path / "w256.gguf", 256, "f32")
    info = g.model_info(src)
    before, after = _tensors(src), _tensors(out.path)
    assert list(before) == list(after)  # same tensors, same order
    assert out.grown_tensors == 3 * len(info.layers)
    roles = {t.name: t.role for t in info.experts.tensors}  # the routed experts (gguf_experts.py)
    assert len(roles) == 3 * len(info.layers)
    for name, t in before.items():
        u = after[name]
        if name not in roles:  # shared experts, router, attention: copied as they are
            assert u.tensor_type == t.tensor_type and np.array_equal(np.asarray(u.data), np.asarray(t.data)), name
            continue
        assert u.tensor_type == gguf.GGMLQuantizationType.F32
        data, orig = np.asarray(u.data), np.asarray(t.data).astype(np.float32)
        if roles[name] == "down":  # numpy (E, n_embd, width): zero columns
            assert data.shape == (16, 64, 256)
            assert np.array_equal(data[:, :, :64], orig) and not data[:, :, 64:].any()
        else:  # (E, width, n_embd): zero rows
            assert data.shape == (16, 256, 64)
            assert np.array_equal(data[:, :64, :], orig) and not data[:, 64:, :].any()
    fb, fa = _fields(src), _fields(out.path)
    key = f"{info.arch}.expert_feed_forward_length"
    assert list(fb) == list(fa) and fa[key] == 256
    assert {k: v for k, v in fa.items() if k != key} == {k: v for k, v in fb.items() if k != key}
    if "shexp" in " ".join(before):
        assert fa[f"{info.arch}.expert_shared_feed_forward_length"] == 64


def test_grow_is_deterministic_and_identity_at_own_width(tmp_path):
    a = g.grow(QWEN3, tmp_path / "a.gguf", 512, "f16")
    b = g.grow(QWEN3, tmp_path / "b.gguf", 512, "f16")
    assert g.sha256_file(a.path) == g.sha256_file(b.path)
    same = g.grow(QWEN3, tmp_path / "same.gguf", 64, "f16")  # nothing to add: the source, byte for byte
    assert same.path.read_bytes() == QWEN3.read_bytes()


def test_grow_refuses(tmp_path):
    with pytest.raises(g.GrowError, match="below"):
        g.grow(QWEN3, tmp_path / "x.gguf", 32, "f32")
    with pytest.raises(g.GrowError, match="no such file"):
        g.model_info(tmp_path / "missing.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf")
    with pytest.raises(g.GrowError):
        g.model_info(tmp_path / "bad.gguf")


def test_sizing_as_llama_cpp_stores_it():
    info = g.model_info(QWEN3)
    # Q4_K_M, n_embd 64: gate and up fall back from Q4_K to Q5_0 (22 bytes per 32), down is
    # Q6_K (210 per 256) on layers 0, 3, 6, 7 (use_more_bits, 8 layers) and Q4_K (144) elsewhere
    assert [g.use_more_bits(i, 8) for i in range(8)] == [True, False, False, True, False, False, True, True]
    per = g.expert_bytes(info, 256, "q4_k_m")
    assert per[0] == 2 * 256 * 2 * 22 + 64 * 210 and per[1] == 2 * 256 * 2 * 22 + 64 * 144
    assert g.expert_bytes(info, 256, "q8_0")[0] == 3 * 64 * 256 // 32 * 34
    assert g.expert_bytes(info, 256, "f16")[0] == 3 * 64 * 256 * 2
    width = g.width_for(info, 2.7 * g.MIB, "q4_k_m")
    assert width % 256 == 0
    assert g.mean_bytes(g.expert_bytes(info, width, "q4_k_m")) >= 2.7 * g.MIB
    assert g.mean_bytes(g.expert_bytes(info, width - 256, "q4_k_m")) < 2.7 * g.MIB


def test_fallback_log_is_read_and_counted():
    log = (
        "[   3/  99]            blk.0.ffn_gate_exps.weight - [   64, 21504,    16,     1], type =    f32, "
        "warning: blk.0.ffn_gate_exps.weight - ncols     64 not divisible by 256 (required for type    q4_K) "
        "-> falling back to    q5_0\nconverting to q5_0 .. size = 84.00 MiB ->  28.88 MiB\n"
        "warning: blk.1.ffn_gate_exps.weight - ncols     64 not divisible by 256 (required for type    q4_K) "
        "-> falling back to    q5_0\n"
        "llama_model_quantize_impl: WARNING: 2 of 99 tensor(s) required fallback quantization\n"
    )
    found = fallbacks(log)
    assert [(f.tensor, f.target, f.to, f.ncols) for f in found] == [
        ("blk.0.ffn_gate_exps.weight", "q4_K", "q5_0", 64),
        ("blk.1.ffn_gate_exps.weight", "q4_K", "q5_0", 64),
    ]
    assert summarize(found) == ["blk.{0-1}.ffn_gate_exps.weight q4_K->q5_0 (ncols 64 % 256)"]
    with pytest.raises(QuantizeFailed):
        fallbacks(log.replace("WARNING: 2 of", "WARNING: 3 of"))


def test_store_caches_with_manifest(tmp_path):
    store = Store(QWEN3, tmp_path / "grown")
    out = store.get(256, "f16")
    assert not out.cached and out.path.parent.name == g.sha256_file(QWEN3)
    manifest = json.loads(store.manifest_path(256, "f16").read_text())
    assert manifest["sha256"] == g.sha256_file(out.path) and manifest["expert_bytes_predicted_match"]
    assert manifest["expert_types"]["down"] == ["F16"] * 8
    assert store.get(256, "f16").cached
    assert store.check_determinism(256, "f16") == (True, manifest["sha256"])
    with pytest.raises(g.GrowError, match="inside the repository"):
        Store(QWEN3, REPO / "build" / "grown")


def test_cli_usage_errors(run_cli, tmp_path):
    rc, _, err = run_cli(grow_cli.main, tmp_path / "missing.gguf", "--width", "256", "--types", "f16")
    assert rc == 2 and "no such file" in err
    rc, _, err = run_cli(grow_cli.main, QWEN3, "--width", "32", "--types", "f16", "--out-dir", tmp_path)
    assert rc == 2 and "below" in err
    rc, _, err = run_cli(grow_cli.main, QWEN3, "--width", "256", "--types", "q3_k")
    assert rc == 2


@pytest.mark.needs_build
def test_grown_routes_and_predicts_as_the_original(run_cli, tmp_path):
    """The proof at width 256: F32 and F16 route identically to their references, NMSE 0."""
    rc, out, err = run_cli(
        grow_cli.main,
        QWEN3,
        "--width",
        "256",
        "--types",
        "f32,f16",
        "--verify",
        "--verify-bytes",
        "40",
        "--prefill",
        "8",
        "--out-dir",
        tmp_path,
        "--json",
    )
    assert rc == 0, err
    rows = {r["type"]: r for r in json.loads(out)["rows"]}
    for kind in ("f32", "f16"):
        v = rows[kind]["verify"]
        assert v["passed"] and v["reference_routing_equal_rows"] == v["rows"] > 0
        assert v["reference_nmse"] < 1e-10
    assert rows["f16"]["verify"]["nmse"] < 1e-10  # F16 is the source's own arithmetic
    assert rows["f32"]["verify"]["nmse"] < 1e-6  # F32 against the F16 source: activations not rounded to F16
