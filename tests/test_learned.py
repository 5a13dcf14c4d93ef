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

REPO = Path(__file__).resolve().parent.parent


def make_pred(ahead=1, n_layer=4, n_embd=8, n_expert=6, seed=0, **kw) -> L.LearnedPredictor:
    rng = np.random.default_rng(seed)
    layers = {
        li: L.LearnedLayer(
            rng.standard_normal((n_expert, n_embd)).astype(np.float32),
            rng.standard_normal(n_expert).astype(np.float32),
        )
        for li in range(ahead, n_layer)
    }
    args = (
        dict(ahead=ahead, n_embd=n_embd, n_expert=n_expert, model_name="m", trained_on="generation", tokens=1234) | kw
    )
    return L.LearnedPredictor(layers=layers, **args)


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
    } | (keys or {})
    for k, (kind, v) in vals.items():
        if k in drop:
            continue
        {"u32": w.add_uint32, "str": w.add_string, "i32": w.add_int32, "f32": w.add_float32}[kind](k, v)
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
    if not path.exists():
        pytest.skip(f"{path.name} not present (tools/train_learned.py writes it)")
    pred = L.read_learned(path)
    assert pred.ahead == ahead and pred.trained_on == "generation"
    L.check_model(pred, REPO / "models" / f"{name}.gguf")


def test_check_model_mismatch(tmp_path):
    model = REPO / "models" / "qwen3moe-tiny.gguf"
    if not model.exists():
        pytest.skip("models/qwen3moe-tiny.gguf not present")
    pred = make_pred(ahead=1, n_layer=8, n_embd=64, n_expert=16, model_name="onebit-tiny-qwen3moe")
    L.check_model(pred, model)
    with pytest.raises(L.LearnedError, match="n_expert 8 != 16"):
        L.check_model(make_pred(ahead=1, n_layer=8, n_embd=64, n_expert=8, model_name="onebit-tiny-qwen3moe"), model)
    with pytest.raises(L.LearnedError, match="model_name 'x'"):
        L.check_model(make_pred(ahead=1, n_layer=8, n_embd=64, n_expert=16, model_name="x"), model)


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
