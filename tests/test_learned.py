"""The learned lookahead predictor (onebit_predict/learned.py): the sidecar file's round trip, the
reader's errors on bad files, and the loss and training step on a tiny synthetic problem.

Everything runs with numpy and gguf-py alone; only the comparison of the numpy gradient with
torch's autograd needs torch and is skipped without it (saying so).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from onebit_predict import learned as L
from onebit_predict.constants import SIDECAR_MAX_GAIN
from onebit_predict.sidecar import frobenius

REPO = Path(__file__).resolve().parent.parent
MODELS = REPO / "models"
BUNDLED = ("qwen3moe-tiny", "qwen4exp-tiny", "olmoe-tiny")
# model_identity of the bundled models (their sha256 is pinned in models/README.md), as llama.cpp's
# log prints them
IDENTITY = {
    "qwen3moe-tiny": ("qwen3moe", 0x58F31EDC0B5A23B0),
    "qwen4exp-tiny": ("qwen4exp", 0x51B4E94FE8DE380C),
    "olmoe-tiny": ("olmoe", 0xB8E32C71829E9BFC),
}


def make_pred(ahead=1, n_layer=4, n_embd=8, n_expert=6, seed=0, **kw) -> L.LearnedPredictor:
    rng = np.random.default_rng(seed)
    layers = {
        li: L.LearnedLayer(
            rng.standard_normal((n_expert, n_embd)).astype(np.float32),
            rng.standard_normal(n_expert).astype(np.float32),
        )
        for li in range(ahead, n_layer)
    }
    args = dict(
        ahead=ahead,
        n_embd=n_embd,
        n_expert=n_expert,
        model_name="m",
        trained_on="generation",
        tokens=1234,
        model_arch="qwen3moe",
        router_hash=0xFEDCBA9876543210,
    )
    return L.LearnedPredictor(layers=layers, **(args | kw))


def write_raw(path: Path, *, arch=L.ARCH, keys=None, drop=(), tensors=None, ahead=1, n_embd=8, n_expert=6):
    """A GGUF written without the module's validation, to make bad files."""
    w = gguf.GGUFWriter(path, arch)
    vals = {
        L.KEY_AHEAD: ("u32", ahead),
        L.KEY_N_EMBD: ("u32", n_embd),
        L.KEY_N_EXPERT: ("u32", n_expert),
        L.KEY_MODEL_NAME: ("str", "m"),
        L.KEY_TRAINED_ON: ("str", "chunks"),
        L.KEY_TOKENS: ("u32", 10),
        L.KEY_MODEL_ARCH: ("str", "qwen3moe"),
        L.KEY_ROUTER_HASH: ("u64", 2**64 - 1),
    } | (keys or {})
    add = {"u32": w.add_uint32, "u64": w.add_uint64, "str": w.add_string, "i32": w.add_int32, "f32": w.add_float32}
    for k, (kind, v) in vals.items():
        if k in drop:
            continue
        add[kind](k, v)
    if tensors is None:
        tensors = {}
        for li in range(ahead, 3):
            tensors[f"learned.{li}.weight"] = np.zeros((n_expert, n_embd), np.float32)
            tensors[f"learned.{li}.bias"] = np.zeros(n_expert, np.float32)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def copy_sidecar(src: Path, dst: Path, *, drop=(), keys=None, poison: str | None = None, value: float = np.nan) -> Path:
    """``src`` rewritten without the module's validation: keys ``drop``ped, ``keys`` ({key: (kind,
    value)}) added or replaced, tensor ``poison``'s first value ``value`` (NaN); every other key and
    value as is."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(dst, L.ARCH)
    add = {"u32": w.add_uint32, "u64": w.add_uint64, "str": w.add_string}
    kinds = {gguf.GGUFValueType.UINT32: "u32", gguf.GGUFValueType.UINT64: "u64", gguf.GGUFValueType.STRING: "str"}
    vals = {k: (kinds[f.types[0]], f.contents()) for k, f in r.fields.items() if k.startswith(L.ARCH + ".")}
    for k, (kind, v) in (vals | (keys or {})).items():
        if k not in drop:
            add[kind](k, v)
    for t in r.tensors:
        arr = np.array(t.data, dtype=np.float32)
        if t.name == poison:
            arr.reshape(-1)[0] = value
        w.add_tensor(t.name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def bundled(name: str) -> Path:
    path = MODELS / f"{name}.gguf"
    assert path.is_file(), f"{path} is missing: it is committed (models/README.md)"
    return path


# --- the file -----------------------------------------------------------------------------------


@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_round_trip(tmp_path, ahead):
    pred = make_pred(ahead=ahead, n_layer=5, trained_on="chunks", tokens=65536)
    path = tmp_path / "p.gguf"
    L.write_learned(path, pred)
    back = L.read_learned(path)
    assert (back.ahead, back.n_embd, back.n_expert, back.model_name, back.trained_on, back.tokens) == (
        ahead,
        8,
        6,
        "m",
        "chunks",
        65536,
    )
    assert (back.model_arch, back.router_hash) == ("qwen3moe", 0xFEDCBA9876543210)
    assert sorted(back.layers) == list(range(ahead, 5)) and back.n_layer == 5
    for li, ly in pred.layers.items():
        assert np.array_equal(back.layers[li].weight, ly.weight)
        assert np.array_equal(back.layers[li].bias, ly.bias)
    x = np.ones((3, 8), np.float32)
    assert np.allclose(back.logits(ahead, x), x @ pred.layers[ahead].weight.T + pred.layers[ahead].bias)


def test_layout_as_llama_reads_it(tmp_path):
    """ggml ne of the weight is (n_embd, n_expert), as ffn_gate_inp; the keys have the stated types."""
    path = tmp_path / "p.gguf"
    L.write_learned(path, make_pred(ahead=2, n_layer=4))
    r = gguf.GGUFReader(path)
    assert r.fields["general.architecture"].contents() == "onebit_learned"
    for k in L.U32_KEYS:
        assert r.fields[k].types == [gguf.GGUFValueType.UINT32]
    for k in L.STRING_KEYS:
        assert r.fields[k].types == [gguf.GGUFValueType.STRING]
    # the model the sidecar names, as llama.cpp reads it
    assert r.fields[L.KEY_MODEL_ARCH].types == [gguf.GGUFValueType.STRING]
    assert r.fields[L.KEY_MODEL_ARCH].contents() == "qwen3moe"
    assert r.fields[L.KEY_ROUTER_HASH].types == [gguf.GGUFValueType.UINT64]
    assert r.fields[L.KEY_ROUTER_HASH].contents() == 0xFEDCBA9876543210
    assert (L.KEY_MODEL_ARCH, L.KEY_ROUTER_HASH) == (
        "onebit_learned.model.architecture",
        "onebit_learned.model.router_hash",
    )
    shapes = {t.name: ([int(n) for n in t.shape], t.tensor_type) for t in r.tensors}
    f32 = gguf.GGMLQuantizationType.F32
    assert shapes == {
        "learned.2.weight": ([8, 6], f32),
        "learned.2.bias": ([6], f32),
        "learned.3.weight": ([8, 6], f32),
        "learned.3.bias": ([6], f32),
    }


def test_raw_writer_makes_a_valid_file(tmp_path):
    assert L.read_learned(write_raw(tmp_path / "ok.gguf")).layers.keys() == {1, 2}


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(arch="llama"), "general.architecture is 'llama', expected 'onebit_learned'"),
        (dict(ahead=0), "onebit_learned.ahead = 0 is out of range 1..3"),
        (dict(ahead=4, tensors={}), "onebit_learned.ahead = 4 is out of range 1..3"),
        (dict(drop=(L.KEY_N_EXPERT,)), "key onebit_learned.n_expert is missing"),
        (dict(keys={L.KEY_AHEAD: ("i32", 1)}), "key onebit_learned.ahead is INT32, expected UINT32"),
        (dict(keys={L.KEY_TRAINED_ON: ("str", "text")}), "trained_on = 'text' is not one of"),
        (dict(keys={L.KEY_MODEL_NAME: ("u32", 7)}), "key onebit_learned.model_name is UINT32, expected STRING"),
        (dict(keys={"onebit_learned.extra": ("u32", 1)}), "unknown key(s) onebit_learned.extra"),
        (dict(drop=(L.KEY_MODEL_ARCH, L.KEY_ROUTER_HASH)), "the sidecar names no model"),
        (dict(drop=(L.KEY_ROUTER_HASH,)), "names no model (key(s) onebit_learned.model.router_hash missing)"),
        (dict(keys={L.KEY_ROUTER_HASH: ("u32", 7)}), "key onebit_learned.model.router_hash is UINT32, expected UINT64"),
        (dict(keys={L.KEY_MODEL_ARCH: ("u32", 5)}), "key onebit_learned.model.architecture is UINT32, expected STRING"),
        (
            dict(tensors={"learned.1.weight": np.zeros((6, 8), np.float32)}),
            "tensor learned.1.bias is missing",
        ),
        (
            dict(
                tensors={
                    "learned.1.weight": np.zeros((6, 8), np.float32),
                    "learned.1.bias": np.zeros(6, np.float32),
                    "learned.3.weight": np.zeros((6, 8), np.float32),
                    "learned.3.bias": np.zeros(6, np.float32),
                }
            ),
            "tensor learned.2.weight is missing",
        ),
        (
            dict(
                tensors={
                    "learned.1.weight": np.zeros((8, 6), np.float32),
                    "learned.1.bias": np.zeros(6, np.float32),
                }
            ),
            "tensor learned.1.weight has ggml ne [6, 8], expected [8, 6]",
        ),
        (
            dict(tensors={"learned.1.weight": np.zeros((6, 8), np.float32), "learned.1.bias": np.zeros(5, np.float32)}),
            "tensor learned.1.bias has ggml ne [5], expected [6]",
        ),
        (
            dict(tensors={"learned.1.weight": np.zeros((6, 8), np.float16), "learned.1.bias": np.zeros(6, np.float32)}),
            "tensor learned.1.weight is F16, expected F32",
        ),
        (
            dict(
                ahead=2,
                tensors={"learned.1.weight": np.zeros((6, 8), np.float32), "learned.1.bias": np.zeros(6, np.float32)},
            ),
            "layer 1 < ahead=2",
        ),
        (dict(tensors={}), "no learned.{l}.weight/bias tensor"),
        (
            dict(tensors={"blk.1.ffn_gate_inp.weight": np.zeros((6, 8), np.float32)}),
            "unexpected tensor 'blk.1.ffn_gate_inp.weight'",
        ),
        (
            dict(
                tensors={
                    "learned.1.weight": np.full((6, 8), np.nan, np.float32),
                    "learned.1.bias": np.zeros(6, np.float32),
                }
            ),
            "tensor learned.1.weight holds a value that is not finite",
        ),
    ],
)
def test_reader_errors(tmp_path, kw, message):
    path = write_raw(tmp_path / "bad.gguf", **kw)
    with pytest.raises(L.LearnedError) as e:
        L.read_learned(path)
    assert message in str(e.value)
    assert str(path) in str(e.value)


def test_reader_error_not_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(L.LearnedError, match="not a readable GGUF file"):
        L.read_learned(path)
    with pytest.raises(L.LearnedError, match="not a readable GGUF file"):
        L.read_learned(tmp_path / "absent.gguf")


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(ahead=0), "out of range 1..3"),
        (dict(ahead=4, n_layer=6), "out of range 1..3"),
        (dict(trained_on="both"), "is not one of"),
        (dict(tokens=-1), "is not a u32"),
        (dict(n_expert=1), "at least 2 experts"),
        (dict(model_name=""), "model_name is empty"),
        (dict(model_arch=""), "model.architecture is empty"),
        (dict(model_arch=None), "model.architecture is empty or not a string"),
        (dict(router_hash=-1), "router_hash = -1 is not a u64"),
        (dict(router_hash=2**64), "router_hash = 18446744073709551616 is not a u64"),
        (dict(router_hash=None), "router_hash = None is not a u64"),
    ],
)
def test_writer_refuses(tmp_path, kw, message):
    with pytest.raises(L.LearnedError, match=message):
        L.write_learned(tmp_path / "p.gguf", make_pred(**kw))
    assert not (tmp_path / "p.gguf").exists()


def test_writer_refuses_gap_and_shape(tmp_path):
    pred = make_pred(ahead=1, n_layer=4)
    gap = L.LearnedPredictor(**{**pred.__dict__, "layers": {1: pred.layers[1], 3: pred.layers[3]}})
    with pytest.raises(L.LearnedError, match="not every layer"):
        L.write_learned(tmp_path / "p.gguf", gap)
    bad = L.LearnedPredictor(
        **{
            **pred.__dict__,
            "layers": {**pred.layers, 2: L.LearnedLayer(pred.layers[2].weight.T.copy(), pred.layers[2].bias)},
        }
    )
    with pytest.raises(L.LearnedError, match=r"learned.2.weight has numpy shape \(8, 6\), expected \(6, 8\)"):
        L.write_learned(tmp_path / "p.gguf", bad)


@pytest.mark.parametrize("name", ["qwen3moe-tiny", "qwen4exp-tiny", "olmoe-tiny"])
@pytest.mark.parametrize("ahead", [1, 2, 3])
def test_committed_sidecars(name, ahead):
    """The committed generation-trained sidecars read back and fit their model."""
    path = REPO / "models" / f"{name}.learned-k{ahead}.gguf"
    assert path.is_file(), f"{path} is missing: it is committed (tools/train_learned.py writes it)"
    pred = L.read_learned(path)
    assert pred.ahead == ahead and pred.trained_on == "generation"
    assert (pred.model_arch, pred.router_hash) == IDENTITY[name]
    L.check_model(pred, REPO / "models" / f"{name}.gguf")


def test_committed_sidecars_are_far_below_the_gain_bound():
    """||W||_F and max|b| of every committed sidecar's layers (at most 37 and 2.7 when measured)."""
    for path in sorted(MODELS.glob("*.learned-k*.gguf")):
        pred = L.read_learned(path)
        assert max(frobenius(ly.weight) for ly in pred.layers.values()) < SIDECAR_MAX_GAIN / 1000, path
        assert max(float(np.abs(ly.bias).max()) for ly in pred.layers.values()) < SIDECAR_MAX_GAIN / 1000, path


def _huge_weight(tmp_path: Path, where: str, value: float) -> Path:
    tensors = {}
    for li in (1, 2):
        tensors[f"learned.{li}.weight"] = np.ones((6, 8), np.float32)
        tensors[f"learned.{li}.bias"] = np.ones(6, np.float32)
    tensors[where].reshape(-1)[3] = value
    return write_raw(tmp_path / "huge.gguf", tensors=tensors)


@pytest.mark.parametrize(
    "where, value, message",
    [
        ("learned.2.weight", 3e38, "layer 2: the map's gain bound ||W|| = 3e+38 exceeds 65504 (F16's largest value)"),
        ("learned.1.weight", 7e4, "layer 1: the map's gain bound ||W|| = 7e+04 exceeds 65504"),
        ("learned.1.bias", -3e38, "layer 1: the bias bound max|b| = 3e+38 exceeds 65504 (F16's largest value)"),
        ("learned.2.bias", 65600.0, "layer 2: the bias bound max|b| = 6.6e+04 exceeds 65504"),
    ],
)
def test_reader_refuses_a_huge_finite_value(tmp_path, where, value, message):
    path = _huge_weight(tmp_path, where, value)
    with pytest.raises(L.LearnedError) as e:
        L.read_learned(path)
    assert f"{path}: {message}" in str(e.value)


def test_the_bounds_edge_reads(tmp_path):
    assert sorted(L.read_learned(_huge_weight(tmp_path, "learned.1.bias", -SIDECAR_MAX_GAIN)).layers) == [1, 2]
    pred = make_pred()
    huge = pred.layers[2].weight.copy()
    huge[0, 0] = 3e38
    bad = L.LearnedPredictor(
        **{**pred.__dict__, "layers": {**pred.layers, 2: L.LearnedLayer(huge, pred.layers[2].bias)}}
    )
    with pytest.raises(L.LearnedError, match=r"layer 2: the map's gain bound \|\|W\|\| = 3e\+38 exceeds 65504"):
        L.write_learned(tmp_path / "p.gguf", bad)
    assert not (tmp_path / "p.gguf").exists()


def test_check_refuses_a_sidecar_with_a_huge_finite_weight(tmp_path, capsys):
    from onebit_predict.commands.learned import main as learned_main

    q3 = bundled("qwen3moe-tiny")
    huge = copy_sidecar(
        MODELS / "qwen3moe-tiny.learned-k1.gguf", tmp_path / "h.gguf", poison="learned.3.weight", value=3e38
    )
    assert learned_main(["check", str(huge), str(q3)]) == 2
    err = capsys.readouterr().err
    assert f"{huge}: layer 3: the map's gain bound ||W|| = 3e+38 exceeds 65504 (F16's largest value): refused" in err
    assert "Traceback" not in err


def test_check_model_mismatch(tmp_path):
    model = bundled("qwen3moe-tiny")
    ident = dict(zip(("model_arch", "router_hash"), IDENTITY["qwen3moe-tiny"]))
    pred = make_pred(ahead=1, n_layer=8, n_embd=64, n_expert=16, model_name="onebit-tiny-qwen3moe", **ident)
    L.check_model(pred, model)
    with pytest.raises(L.LearnedError, match="n_expert 8 != 16"):
        L.check_model(
            make_pred(ahead=1, n_layer=8, n_embd=64, n_expert=8, model_name="onebit-tiny-qwen3moe", **ident), model
        )
    with pytest.raises(L.LearnedError, match="model_name 'x'"):
        L.check_model(make_pred(ahead=1, n_layer=8, n_embd=64, n_expert=16, model_name="x", **ident), model)


def test_check_model_refuses_another_models_sidecar():
    """Issue 21: qwen4exp-tiny's sidecar has qwen3moe-tiny's shapes (16 x 64, 8 layers) and, run on
    it, predicted silently and badly. check_model says which identity differs."""
    model, sidecar = bundled("qwen3moe-tiny"), MODELS / "qwen4exp-tiny.learned-k1.gguf"
    pred = L.read_learned(sidecar)
    assert (pred.n_embd, pred.n_expert, pred.n_layer) == (64, 16, 8)  # the shapes fit
    with pytest.raises(L.LearnedError) as e:
        L.check_model(pred, model)
    msg = str(e.value)
    assert "trained on another model" in msg
    assert "onebit_learned.model.architecture 'qwen4exp' != 'qwen3moe'" in msg
    assert "onebit_learned.model.router_hash 51b4e94fe8de380c != 58f31edc0b5a23b0" in msg
    # the same architecture and name, another router: only the hash differs, and the message says so
    own = L.read_learned(MODELS / "qwen3moe-tiny.learned-k1.gguf")
    other = L.LearnedPredictor(**{**own.__dict__, "router_hash": own.router_hash ^ 1})
    with pytest.raises(L.LearnedError, match="router_hash 58f31edc0b5a23b1 != 58f31edc0b5a23b0") as e:
        L.check_model(other, model)
    assert "architecture" not in str(e.value) and "model_name" not in str(e.value)
    L.check_model(own, model)


# --- the model a sidecar names ----------------------------------------------------------------------


def test_fnv1a64_reference_values():
    """FNV-1a 64 (offset basis 0xcbf29ce484222325, prime 0x100000001b3): the published test vectors."""
    assert L.fnv1a64(b"") == 0xCBF29CE484222325
    assert L.fnv1a64(b"a") == 0xAF63DC4C8601EC8C
    assert L.fnv1a64(b"foobar") == 0x85944171F73967E8
    assert L.fnv1a64(b"bar", L.fnv1a64(b"foo")) == L.fnv1a64(b"foobar")  # it continues


def _identity_by_hand(path: Path) -> tuple[str, int]:
    """The definition, written out: FNV-1a 64 over expert 0's router row (little-endian float32) of
    every layer with a router, in layer order."""
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    tens = {t.name: t for t in r.tensors}
    data = b"".join(
        np.asarray(tens[f"blk.{li}.ffn_gate_inp.weight"].data[0], dtype="<f4").tobytes()
        for li in range(int(r.fields[f"{arch}.block_count"].contents()))
        if f"blk.{li}.ffn_gate_inp.weight" in tens
    )
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) % 2**64
    return arch, h


@pytest.mark.parametrize("name", BUNDLED)
def test_model_identity_of_the_bundled_models(name):
    """Stable (the pinned value, twice), the definition computed by hand, and different for each model."""
    path = bundled(name)
    assert L.model_identity(path) == L.model_identity(path) == IDENTITY[name] == _identity_by_hand(path)
    assert len({h for _, h in IDENTITY.values()}) == len(IDENTITY)


def _router_model(path: Path, routers: dict[int, tuple[np.ndarray, gguf.GGMLQuantizationType]], n_layer=4, nextn=0):
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_uint32("qwen3moe.block_count", n_layer)
    if nextn:
        w.add_uint32("qwen3moe.nextn_predict_layers", nextn)
    for li, (arr, qtype) in routers.items():
        if qtype == gguf.GGMLQuantizationType.F32:
            w.add_tensor(f"blk.{li}.ffn_gate_inp.weight", arr)
        elif qtype == gguf.GGMLQuantizationType.F16:
            w.add_tensor(f"blk.{li}.ffn_gate_inp.weight", arr.astype(np.float16))
        else:
            w.add_tensor(f"blk.{li}.ffn_gate_inp.weight", gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
    w.add_tensor("blk.0.attn_q.weight", np.ones((4, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_model_identity_per_router_type(tmp_path):
    """A router's values, not its encoding: F32, F16 and BF16 of the same (exactly representable)
    values hash alike; a quantized router hashes its dequantized values (ggml's to_float); layers
    without a router (dense) are skipped and llama.cpp's MTP layers (nextn_predict_layers) are not
    counted."""
    T = gguf.GGMLQuantizationType
    rng = np.random.default_rng(0)
    rows = [(rng.integers(-64, 64, (6, 64)) / 16).astype(np.float32) for _ in range(4)]
    want = L.fnv1a64(rows[0][0].tobytes() + rows[2][0].tobytes())  # layers 0 and 2; 1 is dense
    for qtype in (T.F32, T.F16, T.BF16):
        path = _router_model(tmp_path / f"{qtype.name}.gguf", {0: (rows[0], qtype), 2: (rows[2], qtype)})
        assert L.model_identity(path) == ("qwen3moe", want), qtype.name
    # layer 3 is an MTP layer (block_count 4, nextn 1): llama.cpp's n_layer() is 3
    path = _router_model(tmp_path / "mtp.gguf", {0: (rows[0], T.F32), 2: (rows[2], T.F32), 3: (rows[3], T.F32)}, 4, 1)
    assert L.model_identity(path)[1] == want
    q = gguf.quants.quantize(rows[1], T.Q8_0)
    path = _router_model(tmp_path / "q8.gguf", {1: (rows[1], T.Q8_0)})
    deq = gguf.quants.dequantize(q, T.Q8_0)[0].astype("<f4")
    assert not np.array_equal(deq, rows[1][0])  # Q8_0 is lossy here: the dequantized values are hashed
    assert L.model_identity(path)[1] == L.fnv1a64(deq.tobytes())
    with pytest.raises(L.LearnedError, match="not a MoE model"):
        L.model_identity(_router_model(tmp_path / "dense.gguf", {}))


def test_stamp_names_the_model_and_keeps_the_values(tmp_path):
    """An unstamped copy of a committed sidecar (a file trained before the keys): read_learned
    refuses it, stamp() writes it back byte for byte as committed; stamp refuses a model it does
    not fit (another model's name)."""
    committed = MODELS / "qwen3moe-tiny.learned-k2.gguf"
    model = bundled("qwen3moe-tiny")
    bare = copy_sidecar(committed, tmp_path / "bare.gguf", drop=L.IDENTITY_KEYS)
    with pytest.raises(L.LearnedError, match="the sidecar names no model .* stamp it with the model"):
        L.read_learned(bare)
    pred = L.stamp(bare, model, tmp_path / "stamped.gguf")
    assert (pred.model_arch, pred.router_hash) == IDENTITY["qwen3moe-tiny"]
    assert (tmp_path / "stamped.gguf").read_bytes() == committed.read_bytes()
    L.stamp(bare, model)  # in place
    assert bare.read_bytes() == committed.read_bytes()
    with pytest.raises(L.LearnedError, match="model_name 'onebit-tiny-qwen3moe'"):
        L.stamp(bare, bundled("qwen4exp-tiny"), tmp_path / "wrong.gguf")
    assert not (tmp_path / "wrong.gguf").exists()
    nan = copy_sidecar(committed, tmp_path / "nan.gguf", drop=L.IDENTITY_KEYS, poison="learned.2.weight")
    with pytest.raises(L.LearnedError, match="learned.2.weight holds a value that is not finite"):
        L.stamp(nan, model, tmp_path / "nan-stamped.gguf")


def test_command_line(tmp_path, capsys):
    from onebit_predict.commands.learned import main as learned_main

    q3, q4 = bundled("qwen3moe-tiny"), bundled("qwen4exp-tiny")
    assert learned_main(["identity", str(q3)]) == 0
    assert capsys.readouterr().out == "qwen3moe 58f31edc0b5a23b0\n"
    assert learned_main(["check", str(MODELS / "qwen3moe-tiny.learned-k1.gguf"), str(q3)]) == 0
    assert learned_main(["check", str(MODELS / "qwen4exp-tiny.learned-k1.gguf"), str(q3)]) == 1
    assert "trained on another model" in capsys.readouterr().err
    bare = copy_sidecar(MODELS / "qwen4exp-tiny.learned-k1.gguf", tmp_path / "bare.gguf", drop=L.IDENTITY_KEYS)
    assert learned_main(["check", str(bare), str(q4)]) == 2
    assert "names no model" in capsys.readouterr().err
    assert learned_main(["stamp", str(bare), str(q4), "--out", str(tmp_path / "s.gguf")]) == 0
    assert (tmp_path / "s.gguf").read_bytes() == (MODELS / "qwen4exp-tiny.learned-k1.gguf").read_bytes()
    assert learned_main(["identity", str(tmp_path / "absent.gguf")]) == 2


# --- the loss and the training step ------------------------------------------------------------------


def synthetic(n=4000, d=12, e=10, k=3, seed=0):
    """x -> the top-k of a hidden linear map of x; the start is a noisy copy of that map."""
    rng = np.random.default_rng(seed)
    w_true = rng.standard_normal((e, d)).astype(np.float32)
    x = rng.standard_normal((n, d)).astype(np.float32)
    actual = np.argsort(-(x @ w_true.T), axis=1, kind="stable")[:, :k]
    w0 = (0.3 * w_true + rng.standard_normal((e, d))).astype(np.float32)
    return x, actual, w0


def test_loss_value():
    logits = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.2, 0.7]]))
    actual = np.array([[0, 1], [2, 1]])
    want = -(np.log(0.5) + np.log(0.25) + np.log(0.7) + np.log(0.2)) / 4
    assert L.listwise_loss(logits, actual) == pytest.approx(want)


def test_gradient_matches_finite_differences():
    x, actual, w0 = synthetic(n=50, d=5, e=4, k=2)
    b0 = np.linspace(-0.2, 0.2, 4).astype(np.float32)
    w64, b64 = w0.astype(np.float64), b0.astype(np.float64)
    _, gw, gb = L.listwise_grad(w0, b0, x, actual)

    def f(w, b):
        return L.listwise_loss(x.astype(np.float64) @ w.T + b, actual)

    h = 1e-5
    for i, j in [(0, 0), (1, 3), (3, 4)]:
        dw = np.zeros_like(w64)
        dw[i, j] = h
        assert gw[i, j] == pytest.approx((f(w64 + dw, b64) - f(w64 - dw, b64)) / (2 * h), abs=1e-4)
    for i in range(4):
        db = np.zeros_like(b64)
        db[i] = h
        assert gb[i] == pytest.approx((f(w64, b64 + db) - f(w64, b64 - db)) / (2 * h), abs=1e-4)


def test_training_improves_recall():
    x, actual, w0 = synthetic()
    xt, at = x[:3000], actual[:3000]
    xv, av = x[3000:], actual[3000:]
    before = L.recall_hits(xv @ w0.T, av, 3) / av.size
    r = L.train_layer(xt, at, w0, epochs=5, lr=1e-2, batch=128, seed=0)
    after = L.recall_hits(xv @ r.weight.T + r.bias, av, 3) / av.size
    assert r.loss_after < r.loss_before
    assert after > before + 0.1, (before, after)
    assert r.steps == 5 * -(-3000 // 128)
    # deterministic for a seed
    r2 = L.train_layer(xt, at, w0, epochs=5, lr=1e-2, batch=128, seed=0)
    assert np.array_equal(r.weight, r2.weight) and np.array_equal(r.bias, r2.bias)


def test_train_layer_shape_error():
    x, actual, w0 = synthetic(n=10)
    with pytest.raises(ValueError, match="do not fit"):
        L.train_layer(x[:, :5], actual, w0)


def test_recall_and_previous_token():
    logits = np.array([[0.9, 0.1, 0.5, 0.3], [0.0, 0.0, 1.0, 2.0]])
    actual = np.array([[0, 1], [3, 2]])
    assert L.recall_hits(logits, actual, 1) == 2  # expert 0, expert 3
    assert L.recall_hits(logits, actual, 2) == 3  # + expert 2 in row 1
    assert L.recall_hits(logits, actual, 4) == 4
    # one sequence, 3 positions, k = 2
    acts = np.array([[[0, 1], [1, 2], [2, 1]]])
    assert L.prev_token_hits(acts, np.array([[False, True, True]])) == 1 + 2
    assert L.prev_token_hits(acts, np.array([[False, False, True]])) == 2
    with pytest.raises(ValueError, match="position 0"):
        L.prev_token_hits(acts, np.array([[True, True, False]]))
    with pytest.raises(ValueError, match="does not fit"):
        L.prev_token_hits(acts, np.array([[False, True]]))


def test_gradient_matches_torch():
    torch = pytest.importorskip(
        "torch", reason="torch is not installed (the optional 'train' extra): the autograd comparison is skipped"
    )
    x, actual, w0 = synthetic(n=64, d=6, e=5, k=2)
    b0 = np.zeros(5, np.float32)
    loss, gw, gb = L.listwise_grad(w0, b0, x, actual)
    tw = torch.tensor(w0, dtype=torch.float64, requires_grad=True)
    tb = torch.tensor(b0, dtype=torch.float64, requires_grad=True)
    ls = torch.log_softmax(torch.tensor(x, dtype=torch.float64) @ tw.T + tb, dim=-1)
    tl = -ls.gather(1, torch.tensor(actual)).mean()
    tl.backward()
    assert loss == pytest.approx(tl.item(), rel=1e-6)
    assert np.allclose(gw, tw.grad.numpy(), atol=1e-6)
    assert np.allclose(gb, tb.grad.numpy(), atol=1e-6)
