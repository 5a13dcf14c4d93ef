"""The model check every command that takes a model runs first (onebit_predict/moe_check.py).

A dense model, or a MoE model whose ``{arch}.expert_count`` / ``{arch}.expert_used_count`` is
missing, 0, out of range or not an integer, is refused with exit 2 and a message naming the
file and the key, by every command, before any llama.cpp work: before the check, a dense model
failed later on a file never written, and a bad count killed llama.cpp with a GGML_ASSERT
(rc 134). None of these tests needs the build: the check comes before the build is looked for.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from onebit_predict.commands import bench, bitident, grow, stats
from onebit_predict.constants import EXIT_USAGE
from onebit_predict.costmodel.expert_bytes import ModelError
from onebit_predict.grow.gguf_keys import copy_key, write_tensors_as_read
from onebit_predict.moe_check import MoeKeys, require_moe_model, require_trace_model
from onebit_predict.trace import TraceHeader
from onebit_predict.trace_writer import TraceWriter

MODELS = Path(__file__).resolve().parent.parent / "models"
QWEN3MOE = MODELS / "qwen3moe-tiny.gguf"  # 8 layers, 16 experts, 4 used
VT = gguf.GGUFValueType

# --- the files ---------------------------------------------------------------------------


def dense_qwen3(path: Path) -> Path:
    """A dense qwen3 GGUF with 2 layers: attention and a plain FFN, no router."""
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_block_count(2)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_tensor("token_embd.weight", np.zeros((257, 8), dtype=np.float32))
    for layer in range(2):
        w.add_tensor(f"blk.{layer}.attn_q.weight", np.zeros((8, 8), dtype=np.float32))
        w.add_tensor(f"blk.{layer}.ffn_gate.weight", np.zeros((16, 8), dtype=np.float32))
        w.add_tensor(f"blk.{layer}.ffn_up.weight", np.zeros((16, 8), dtype=np.float32))
        w.add_tensor(f"blk.{layer}.ffn_down.weight", np.zeros((8, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def rewrite(src: Path, dst: Path, changes: dict[str, tuple[Any, gguf.GGUFValueType] | None]) -> Path:
    """``src`` with the keys in ``changes`` set to (value, type), or dropped (None); tensors as is."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(dst, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if key in changes:
            change = changes[key]
            if change is not None:
                w.add_key_value(key, change[0], change[1])
            continue
        copy_key(w, key, field, field.contents(), src, ValueError)
    for key, change in changes.items():
        if key not in reader.fields and change is not None:
            w.add_key_value(key, change[0], change[1])
    write_tensors_as_read(w, reader)
    w.close()
    return dst


USED, COUNT = "qwen3moe.expert_used_count", "qwen3moe.expert_count"

# name -> (make the file in a directory, the message every command must print)
CASES: dict[str, tuple[Callable[[Path], Path], str]] = {
    "dense": (
        lambda d: dense_qwen3(d / "dense.gguf"),
        "dense.gguf has no routed experts (architecture qwen3, no ffn_gate_inp",
    ),
    "used-0": (
        lambda d: rewrite(QWEN3MOE, d / "used0.gguf", {USED: (0, VT.UINT32)}),
        f"{USED} = 0 is out of range (1..16 = {COUNT})",
    ),
    "used-17": (
        lambda d: rewrite(QWEN3MOE, d / "used17.gguf", {USED: (17, VT.UINT32)}),
        f"{USED} = 17 is out of range (1..16 = {COUNT})",
    ),
    "used-ffffffff": (
        lambda d: rewrite(QWEN3MOE, d / "usedmax.gguf", {USED: (0xFFFFFFFF, VT.UINT32)}),
        f"{USED} = 4294967295 is out of range (1..16 = {COUNT})",
    ),
    "used-missing": (
        lambda d: rewrite(QWEN3MOE, d / "noused.gguf", {USED: None}),
        f"has no key {USED}",
    ),
    "used-float": (
        lambda d: rewrite(QWEN3MOE, d / "usedf.gguf", {USED: (4.0, VT.FLOAT32)}),
        f"{USED} = 4.0 is not an integer (FLOAT32)",
    ),
    "count-0": (
        lambda d: rewrite(QWEN3MOE, d / "count0.gguf", {COUNT: (0, VT.UINT32)}),
        f"{COUNT} = 0 is out of range (1..1024",
    ),
    "count-8-router-16": (
        lambda d: rewrite(QWEN3MOE, d / "count8.gguf", {COUNT: (8, VT.UINT32)}),
        f"blk.0.ffn_gate_inp.weight has shape [64, 16], not [n_embd, 8] ({COUNT} = 8)",
    ),
    "not-gguf": (
        lambda d: (d / "text.gguf").write_text("not a gguf") and d / "text.gguf",
        "text.gguf: cannot read it as a GGUF",
    ),
}


@pytest.fixture(params=sorted(CASES))
def bad_model(request, tmp_path) -> tuple[Path, str]:
    make, message = CASES[request.param]
    return make(tmp_path), message


# --- the check ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, arch, n_layer, n_expert, n_used",
    [
        ("qwen3moe-tiny", "qwen3moe", 8, 16, 4),
        ("olmoe-tiny", "olmoe", 12, 64, 8),
        ("qwen4exp-tiny", "qwen4exp", 8, 16, 2),
    ],
)
def test_bundled_models_pass(name, arch, n_layer, n_expert, n_used):
    keys = require_moe_model(MODELS / f"{name}.gguf")
    assert keys == MoeKeys(MODELS / f"{name}.gguf", arch, n_layer, n_expert, n_used, tuple(range(n_layer)))


def test_every_bad_model_is_a_model_error(bad_model):
    path, message = bad_model
    with pytest.raises(ModelError) as e:
        require_moe_model(path)
    assert message in str(e.value) and str(path.name) in str(e.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ModelError, match="missing.gguf: no such file"):
        require_moe_model(tmp_path / "missing.gguf")


def test_per_layer_used_counts(tmp_path):
    ok = rewrite(QWEN3MOE, tmp_path / "arr.gguf", {USED: ([4, 4, 2, 4, 4, 4, 4, 4], VT.ARRAY)})
    assert require_moe_model(ok).n_expert_used == 4
    bad = rewrite(QWEN3MOE, tmp_path / "arr17.gguf", {USED: ([4, 4, 17, 4, 4, 4, 4, 4], VT.ARRAY)})
    with pytest.raises(ModelError, match=rf"{USED}\[2\] = 17 is out of range"):
        require_moe_model(bad)
    short = rewrite(QWEN3MOE, tmp_path / "arr3.gguf", {USED: ([4, 4, 4], VT.ARRAY)})
    with pytest.raises(ModelError, match="has 3 values, not one per layer"):
        require_moe_model(short)


def test_expert_groups(tmp_path):
    groups, group_used = "qwen3moe.expert_group_count", "qwen3moe.expert_group_used_count"
    bad = rewrite(QWEN3MOE, tmp_path / "g16.gguf", {groups: (16, VT.UINT32)})
    with pytest.raises(ModelError, match=f"{groups} = 16 is out of range"):
        require_moe_model(bad)
    no_used = rewrite(QWEN3MOE, tmp_path / "g4.gguf", {groups: (4, VT.UINT32)})
    with pytest.raises(ModelError, match=f"has no key {group_used}"):
        require_moe_model(no_used)
    ok = rewrite(QWEN3MOE, tmp_path / "g4u2.gguf", {groups: (4, VT.UINT32), group_used: (2, VT.UINT32)})
    assert require_moe_model(ok).n_expert == 16


def test_the_trace_model_check(tmp_path):
    assert require_trace_model(QWEN3MOE, 16, [1, 2, 7]).n_expert == 16
    with pytest.raises(ModelError, match="has 16 experts per layer, the trace 4: not its model"):
        require_trace_model(QWEN3MOE, 4, [1])
    with pytest.raises(ModelError, match=r"no expert tensors for layers \[8\], which the trace routes"):
        require_trace_model(QWEN3MOE, 16, [1, 8])


# --- every command that takes a model: exit 2 and the message, before anything else ---------


def _trace(d: Path) -> Path:
    path = d / "t.trace"
    with TraceWriter(path, TraceHeader.build(n_layer=8, n_expert=16, n_expert_used=4)) as w:
        for step in range(3):
            for layer in range(8):
                pred = [0, 1, 2, 3] if layer else None  # layer 0 is predicted by no layer
                w.add(step=step, seq_id=0, pos=step, layer=layer, actual=[0, 1, 2, 3], pred=pred)
    return path


def _trace_main(argv: list[str]) -> int:
    from onebit_predict.commands import trace

    return trace.main(argv)


COMMANDS: dict[str, Callable[[Path, Path], tuple[Callable[[list[str]], int], list[str]]]] = {
    "onebit-bitident": lambda m, d: (bitident.main, [str(m)]),
    "onebit-bench": lambda m, d: (bench.main, [str(m), "--rounds", "1"]),
    "onebit-bench --cold": lambda m, d: (bench.main, [str(m), "--cold"]),
    "onebit-grow": lambda m, d: (grow.main, [str(m), "--width", "512", "--types", "f32", "--out-dir", str(d / "g")]),
    "onebit-stats simulate": lambda m, d: (
        stats.main,
        ["simulate", str(_trace(d)), "--model", str(m), "--bandwidth", "3GB/s", "--layer-ms", "1"],
    ),
    "onebit-stats simulate --granularity page": lambda m, d: (
        stats.main,
        ["simulate", str(_trace(d)), "--model", str(m), "--granularity", "page", "--bandwidth", "3GB/s"]
        + ["--layer-ms", "1", "--cold"],
    ),
    # last: its call is another change's (commands/trace.py)
    "onebit-trace": lambda m, d: (_trace_main, [str(m), "--mode", "router", "--out", str(d / "out.trace")]),
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_refuses_a_bad_model_with_exit_2(command, bad_model, tmp_path, capsys):
    path, message = bad_model
    main, argv = COMMANDS[command](path, tmp_path)
    rc = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    assert rc == EXIT_USAGE, err
    assert message in err, err
    assert not (tmp_path / "out.trace").exists() and not (tmp_path / "g").exists()
