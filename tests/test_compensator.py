"""The 2-bit compensator (onebit_predict/int2/compensator.py, capture.py, moe_numpy.py): the sidecar's
round trip and every refusal of its reader, the experts hash, the least-squares fit and its rank
truncation on synthetic data, the numpy MoE block; with the patched build, the capture through the
eval callback and the ``onebit-compensator`` command end to end on the bundled tiny model."""

from __future__ import annotations

import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest

from onebit_predict.commands import compensator as cmd
from onebit_predict.constants import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE, SIDECAR_MAX_GAIN
from onebit_predict.int2 import capture as CAP
from onebit_predict.int2 import compensator as C
from onebit_predict.int2 import moe_numpy as M
from onebit_predict.learned import fnv1a64

REPO = Path(__file__).resolve().parent.parent
TINY = REPO / "models" / "qwen3moe-tiny.gguf"
T = gguf.GGMLQuantizationType


def make_comp(n_layer=3, n_embd=8, rank=3, seed=0, layers=None, **kw) -> C.Compensator:
    rng = np.random.default_rng(seed)
    layers = range(n_layer) if layers is None else layers
    lys = {
        li: C.CompensatorLayer(
            rng.standard_normal((rank, n_embd)).astype(np.float32),
            rng.standard_normal((n_embd, rank)).astype(np.float32),
        )
        for li in layers
    }
    args = dict(
        n_embd=n_embd, rank=rank, n_layer=n_layer, source="input", model_arch="qwen3moe", experts_hash=2**64 - 2
    )
    return C.Compensator(layers=lys, **(args | kw))


def write_raw(path: Path, *, arch=C.ARCH, keys=None, drop=(), tensors=None, n_embd=8, rank=3, n_layer=3) -> Path:
    """A sidecar written without the module's validation, to make bad files."""
    w = gguf.GGUFWriter(path, arch)
    vals = {
        C.KEY_N_EMBD: ("u32", n_embd),
        C.KEY_RANK: ("u32", rank),
        C.KEY_N_LAYER: ("u32", n_layer),
        C.KEY_SOURCE: ("str", "output"),
        C.KEY_MODEL_ARCH: ("str", "qwen3moe"),
        C.KEY_EXPERTS_HASH: ("u64", 12345),
    } | (keys or {})
    add = {"u32": w.add_uint32, "u64": w.add_uint64, "str": w.add_string, "i32": w.add_int32}
    for k, (kind, v) in vals.items():
        if k not in drop:
            add[kind](k, v)
    if tensors is None:
        tensors = {}
        for li in range(n_layer):
            tensors[f"compensator.{li}.down"] = np.zeros((rank, n_embd), np.float32)
            tensors[f"compensator.{li}.up"] = np.zeros((n_embd, rank), np.float32)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- the file ---------------------------------------------------------------------------------


def test_roundtrip(tmp_path):
    comp = make_comp(model_name="m", fitted_on="text", tokens=77)
    C.write_compensator(tmp_path / "c.gguf", comp)
    back = C.read_compensator(tmp_path / "c.gguf")
    assert (back.n_embd, back.rank, back.n_layer, back.source) == (8, 3, 3, "input")
    assert (back.model_arch, back.experts_hash, back.model_name, back.fitted_on, back.tokens) == (
        "qwen3moe",
        2**64 - 2,
        "m",
        "text",
        77,
    )
    for li, ly in comp.layers.items():
        np.testing.assert_array_equal(back.layers[li].down, ly.down)
        np.testing.assert_array_equal(back.layers[li].up, ly.up)
    r = gguf.GGUFReader(tmp_path / "c.gguf")
    down = next(t for t in r.tensors if t.name == "compensator.1.down")
    up = next(t for t in r.tensors if t.name == "compensator.1.up")
    assert [int(n) for n in down.shape] == [8, 3] and [int(n) for n in up.shape] == [3, 8]  # ggml ne
    np.testing.assert_allclose(comp.layers[1].matrix, comp.layers[1].up.astype(float) @ comp.layers[1].down)


def test_a_sparse_layer_set_reads(tmp_path):
    """Models with dense layers: the file holds only the MoE layers; check_model says which must be there."""
    C.write_compensator(tmp_path / "c.gguf", make_comp(n_layer=5, layers=[1, 3]))
    assert sorted(C.read_compensator(tmp_path / "c.gguf").layers) == [1, 3]


def test_correct_applies_the_source():
    comp = make_comp()
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((4, 8)).astype(np.float32), rng.standard_normal((4, 8)).astype(np.float32)
    c = comp.layers[0].matrix
    np.testing.assert_allclose(comp.correct(0, x, y), y + x @ c.T, rtol=1e-4, atol=1e-4)
    out = C.Compensator(**{**comp.__dict__, "source": "output"})
    np.testing.assert_allclose(out.correct(0, x, y), y + y @ c.T, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(comp.correct(7, x, y), y)  # a layer without a map


BAD_FILES = {
    "wrong architecture": (dict(arch="onebit_learned"), "expected 'onebit_compensator'"),
    "missing key": (dict(drop=(C.KEY_EXPERTS_HASH,)), "experts_hash is missing"),
    "mistyped key": (dict(keys={C.KEY_RANK: ("i32", 3)}), "rank is INT32, expected UINT32"),
    "rank 0": (dict(keys={C.KEY_RANK: ("u32", 0)}), "out of range 1..n_embd"),
    "rank above n_embd": (dict(keys={C.KEY_RANK: ("u32", 9)}), "out of range 1..n_embd=8"),
    "bad source": (dict(keys={C.KEY_SOURCE: ("str", "both")}), "is not one of input, output"),
    "unknown key": (dict(keys={f"{C.ARCH}.extra": ("u32", 1)}), "unknown key"),
    "wrong shape": (
        dict(
            tensors={
                "compensator.0.down": np.zeros((8, 3), np.float32),
                "compensator.0.up": np.zeros((8, 3), np.float32),
            }
        ),
        "compensator.0.down has ggml ne [3, 8], expected [8, 3]",
    ),
    "missing layer half": (
        dict(tensors={"compensator.0.down": np.zeros((3, 8), np.float32)}),
        "no tensor compensator.0.up",
    ),
    "no layer": (dict(tensors={}), "no compensator"),
    "layer beyond n_layer": (
        dict(
            tensors={
                "compensator.3.down": np.zeros((3, 8), np.float32),
                "compensator.3.up": np.zeros((8, 3), np.float32),
            }
        ),
        "beyond n_layer=3",
    ),
    "extra tensor": (dict(tensors={"compensator.0.bias": np.zeros(8, np.float32)}), "unexpected tensor"),
    "not F32": (
        dict(
            tensors={
                "compensator.0.down": np.zeros((3, 8), np.float16),
                "compensator.0.up": np.zeros((8, 3), np.float32),
            }
        ),
        "is F16, expected F32",
    ),
    "non-finite": (
        dict(
            tensors={
                "compensator.0.down": np.full((3, 8), np.nan, np.float32),
                "compensator.0.up": np.zeros((8, 3), np.float32),
            }
        ),
        "not finite",
    ),
}


def _huge(value: float = 3e38) -> dict[str, np.ndarray]:
    """Layer 1 of write_raw's default file with up[0, 0] = value and down[0, 0] = 1: ||up||*||down|| = value."""
    down, up = np.zeros((3, 8), np.float32), np.zeros((8, 3), np.float32)
    down[0, 0], up[0, 0] = 1.0, value
    zero = {f"compensator.{li}.{k}": np.zeros(shape, np.float32) for li in (0, 2) for k, shape in
            (("down", (3, 8)), ("up", (8, 3)))}  # fmt: skip
    return zero | {"compensator.1.down": down, "compensator.1.up": up}


BAD_FILES["huge finite weight"] = (
    dict(tensors=_huge()),
    "layer 1: the map's gain bound ||up||*||down|| = 3e+38 exceeds 65504 (F16's largest value): refused",
)
BAD_FILES["gain just above the bound"] = (dict(tensors=_huge(65600.0)), "= 6.6e+04 exceeds 65504")


def test_the_gain_bound_is_f16s_largest_value(tmp_path):
    assert SIDECAR_MAX_GAIN == float(np.finfo(np.float16).max) == 65504.0
    assert sorted(C.read_compensator(write_raw(tmp_path / "edge.gguf", tensors=_huge(65504.0))).layers) == [0, 1, 2]
    ly = C.CompensatorLayer(np.full((3, 8), 2.0, np.float32), np.full((8, 3), 3.0, np.float32))
    assert ly.gain_bound == pytest.approx(np.sqrt(24) * 2 * np.sqrt(24) * 3)  # the Frobenius norms, not C's


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_reader_refuses(tmp_path, case):
    kw, message = BAD_FILES[case]
    path = write_raw(tmp_path / "bad.gguf", **kw)
    with pytest.raises(C.CompensatorError, match="bad.gguf") as e:
        C.read_compensator(path)
    assert message in str(e.value)


def test_reader_refuses_a_file_that_is_not_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(C.CompensatorError, match="not a readable GGUF"):
        C.read_compensator(tmp_path / "x.gguf")


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(rank=9), "out of range"),
        (dict(source="x"), "not one of"),
        (dict(experts_hash=2**64), "not a u64"),
        (dict(model_arch=""), "model.architecture"),
        (dict(layers={}), "no layer"),
        (dict(n_layer=2), "not layers of a 2-layer model"),
    ],
)
def test_writer_refuses_and_writes_nothing(tmp_path, change, message):
    comp = make_comp()
    bad = C.Compensator(**{**comp.__dict__, **change})
    with pytest.raises(C.CompensatorError, match=message):
        C.write_compensator(tmp_path / "c.gguf", bad)
    assert list(tmp_path.iterdir()) == []


def test_writer_refuses_a_huge_map_and_writes_nothing(tmp_path):
    comp = make_comp()
    up = comp.layers[2].up.copy()
    up[4, 1] = 3e38
    bad = C.Compensator(**{**comp.__dict__, "layers": {**comp.layers, 2: C.CompensatorLayer(comp.layers[2].down, up)}})
    with pytest.raises(
        C.CompensatorError, match=r"layer 2: the map's gain bound \|\|up\|\|\*\|\|down\|\| = .* exceeds"
    ):
        C.write_compensator(tmp_path / "c.gguf", bad)
    assert list(tmp_path.iterdir()) == []


def test_a_fitted_compensator_is_far_below_the_gain_bound(tmp_path):
    rng = np.random.default_rng(5)
    n = 16
    s = correlated(rng, 3000, n)
    m = C.Moments.zeros(n)
    m.add(s, s @ rng.standard_normal((n, n)).T + 0.1 * rng.standard_normal((3000, n)))
    for rank in (4, n):
        comp = C.Compensator(
            n, rank, 2, "input", "qwen3moe", 7, layers={0: C.fit_layer(m, rank), 1: C.fit_layer(m, rank)}
        )
        C.write_compensator(tmp_path / f"c{rank}.gguf", comp)
        back = C.read_compensator(tmp_path / f"c{rank}.gguf")
        assert max(ly.gain_bound for ly in back.layers.values()) < SIDECAR_MAX_GAIN / 100


# --- the model it names -----------------------------------------------------------------------


def write_model(
    path: Path, expert_type: T, *, n_layer=3, nextn=0, dense=(), n_embd=256, n_ff=256, n_expert=4, seed=0, router_seed=0
):
    """A model GGUF with just what model_identity reads: keys, the routers (F32, from router_seed) and
    the expert tensors (expert_type, from seed)."""
    rng = np.random.default_rng(seed)
    router_rng = np.random.default_rng(router_seed)
    w = gguf.GGUFWriter(path, "qwen3moe")
    w.add_uint32("qwen3moe.block_count", n_layer + nextn)
    w.add_uint32("qwen3moe.embedding_length", n_embd)
    if nextn:
        w.add_uint32("qwen3moe.nextn_predict_layers", nextn)
    w.add_string("general.name", "synthetic")
    for li in range(n_layer + nextn):
        if li in dense:
            continue
        w.add_tensor(f"blk.{li}.ffn_gate_inp.weight", router_rng.standard_normal((n_expert, n_embd)).astype(np.float32))
        for role, shape in (("gate", (n_expert, n_ff, n_embd)), ("up", (n_expert, n_ff, n_embd)),
                            ("down", (n_expert, n_embd, n_ff))):  # fmt: skip
            name = f"blk.{li}.ffn_{role}_exps.weight"
            if expert_type == T.F16:
                w.add_tensor(name, rng.standard_normal(shape).astype(np.float16))
            else:
                row = gguf.quants.quant_shape_to_byte_shape((shape[-1],), expert_type)[0]
                raw = rng.integers(0, 256, (*shape[:-1], row), dtype=np.uint8)
                w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=expert_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def spec_hash(path: Path, n_layer: int) -> int:
    """The experts hash as the format states it, computed independently of the module: every MoE
    layer's router row 0 as float32, then every MoE layer's gate, up and down expert type ids."""
    r = gguf.GGUFReader(path)
    tensors = {t.name: t for t in r.tensors}
    moe = [li for li in range(n_layer) if f"blk.{li}.ffn_gate_inp.weight" in tensors]
    h = 0xCBF29CE484222325
    for li in moe:
        h = fnv1a64(np.asarray(tensors[f"blk.{li}.ffn_gate_inp.weight"].data)[0].astype("<f4").tobytes(), h)
    for li in moe:
        for role in ("gate", "up", "down"):
            t = tensors.get(f"blk.{li}.ffn_{role}_exps.weight")
            h = fnv1a64((0xFFFFFFFF if t is None else int(t.tensor_type)).to_bytes(4, "little"), h)
    return h


@pytest.mark.parametrize("qtype", [T.F16, T.Q2_K, T.IQ2_XXS])
def test_experts_hash_is_the_format(tmp_path, qtype):
    path = write_model(tmp_path / "m.gguf", qtype)
    ident = C.model_identity(path)
    assert ident.experts_hash == spec_hash(path, 3) == C.experts_hash(path)
    assert (ident.arch, ident.n_embd, ident.n_layer, ident.moe_layers) == ("qwen3moe", 256, 3, (0, 1, 2))


def test_experts_hash_tells_the_types_apart(tmp_path):
    hashes = {q: C.experts_hash(write_model(tmp_path / f"{q.name}.gguf", q)) for q in (T.F16, T.Q2_K, T.IQ2_XXS)}
    assert len(set(hashes.values())) == 3
    # another model (another router) under the same types is another hash too
    other = write_model(tmp_path / "other.gguf", T.Q2_K, router_seed=1)
    assert C.experts_hash(other) != hashes[T.Q2_K]
    # the documented limit: the same model's experts quantized twice to the same types (with and
    # without an importance matrix) are not told apart; llama.cpp cannot read the file's bytes back
    again = write_model(tmp_path / "again.gguf", T.Q2_K, seed=7)
    assert C.experts_hash(again) == hashes[T.Q2_K]


def test_experts_hash_skips_dense_and_nextn_layers(tmp_path):
    plain = C.model_identity(write_model(tmp_path / "p.gguf", T.Q2_K, n_layer=3))
    mtp = C.model_identity(write_model(tmp_path / "n.gguf", T.Q2_K, n_layer=3, nextn=1))
    assert (mtp.n_layer, mtp.moe_layers, mtp.experts_hash) == (3, (0, 1, 2), plain.experts_hash)
    dense = C.model_identity(write_model(tmp_path / "d.gguf", T.Q2_K, n_layer=3, dense=(0,)))
    assert dense.moe_layers == (1, 2) and dense.experts_hash == spec_hash(tmp_path / "d.gguf", 3)


def test_check_model(tmp_path):
    f16 = write_model(tmp_path / "f16.gguf", T.F16)
    q2 = write_model(tmp_path / "q2.gguf", T.Q2_K)
    ident = C.model_identity(q2)
    comp = make_comp(n_embd=256, rank=2, experts_hash=ident.experts_hash)
    C.check_model(comp, q2)
    with pytest.raises(C.CompensatorError) as e:
        C.check_model(comp, f16)
    assert f"{ident.experts_hash:016x}" in str(e.value) and f"{C.experts_hash(f16):016x}" in str(e.value)
    with pytest.raises(C.CompensatorError, match=r"missing MoE layer\(s\) \[2\]"):
        C.check_model(make_comp(n_embd=256, rank=2, experts_hash=ident.experts_hash, layers=[0, 1]), q2)
    with pytest.raises(C.CompensatorError, match="model.architecture 'olmoe'"):
        C.check_model(make_comp(n_embd=256, rank=2, experts_hash=ident.experts_hash, model_arch="olmoe"), q2)
    with pytest.raises(C.CompensatorError, match="n_embd 8 != 256"):
        C.check_model(make_comp(experts_hash=ident.experts_hash), q2)


# --- the fit ----------------------------------------------------------------------------------


def correlated(rng, n_rows: int, n: int) -> np.ndarray:
    """Rows with very unequal variances along skewed directions (not white)."""
    mix = rng.standard_normal((n, n)) * np.logspace(0, -2, n)[None, :]
    return rng.standard_normal((n_rows, n)) @ mix.T


def test_moments_add_up_and_give_the_residual():
    rng = np.random.default_rng(0)
    s, r = rng.standard_normal((300, 6)), rng.standard_normal((300, 6))
    a, b, whole = C.Moments.zeros(6), C.Moments.zeros(6), C.Moments.zeros(6)
    a.add(s[:100], r[:100])
    b.add(s[100:], r[100:])
    whole.add(s, r)
    both = a + b
    np.testing.assert_allclose(both.gram, whole.gram)
    assert both.n == 300
    c = rng.standard_normal((6, 6))
    assert both.residual(c) == pytest.approx(float(np.sum((r - s @ c.T) ** 2)), rel=1e-10)


def test_full_rank_fit_recovers_c_and_is_least_squares():
    rng = np.random.default_rng(1)
    n = 12
    c_true = rng.standard_normal((n, n))
    s = correlated(rng, 2000, n)
    m = C.Moments.zeros(n)
    m.add(s, s @ c_true.T)
    np.testing.assert_allclose(C.fit_layer(m, n).matrix, c_true, rtol=1e-4, atol=1e-4)
    noisy = s @ c_true.T + 0.3 * rng.standard_normal((2000, n))
    m = C.Moments.zeros(n)
    m.add(s, noisy)
    lstsq = np.linalg.lstsq(s, noisy, rcond=None)[0].T
    np.testing.assert_allclose(C.fit_layer(m, n).matrix, lstsq, rtol=1e-5, atol=1e-5)
    assert m.removed(C.fit_layer(m, n).matrix) > 0.5


def _als(s, r, rank, rng, steps=300):
    """Alternating least squares for min ||R - S D^T U^T||: a local search to compare with."""
    n = s.shape[1]
    u = np.linalg.qr(rng.standard_normal((n, rank)))[0]
    for _ in range(steps):
        d = np.linalg.lstsq(s, r @ u, rcond=None)[0].T  # (rank, n): with U orthonormal, D given U
        t = s @ d.T
        u = np.linalg.lstsq(t, r, rcond=None)[0].T
        u, tri = np.linalg.qr(u)
        d = tri @ d
    return u @ d


@pytest.mark.parametrize("rank", [1, 3, 6])
def test_rank_truncation_is_the_best_rank_r_fit_in_the_data_norm(rank):
    rng = np.random.default_rng(2)
    n = 10
    s = correlated(rng, 1500, n)
    r = s @ rng.standard_normal((n, n)).T + 0.1 * rng.standard_normal((1500, n))
    m = C.Moments.zeros(n)
    m.add(s, r)
    ours = C.fit_layer(m, rank)
    assert ours.down.shape == (rank, n) and ours.up.shape == (n, rank)
    best = m.residual(ours.matrix)
    # the truncated SVD of the full-rank C is the best rank-r C in the Frobenius norm of C, not of the data
    u, sv, vt = np.linalg.svd(C.fit_layer(m, n).matrix)
    naive = m.residual((u[:, :rank] * sv[:rank]) @ vt[:rank])
    assert best <= naive * (1 + 1e-9)
    for seed in range(3):
        assert best <= m.residual(_als(s, r, rank, np.random.default_rng(seed))) * (1 + 1e-6)
    # reduced-rank regression: the residual is ||R||^2 less the top-r eigenvalues of the fitted values' Gram
    fitted = s @ np.linalg.lstsq(s, r, rcond=None)[0]
    top = np.sort(np.linalg.eigvalsh(fitted.T @ fitted))[::-1][:rank].sum()
    assert best == pytest.approx(float(np.sum(r * r)) - top, rel=1e-8)


def test_ridge_shrinks_and_sweep_picks_the_better_source():
    rng = np.random.default_rng(3)
    n, rows = 8, 1200
    x = rng.standard_normal((rows, n))
    y = rng.standard_normal((rows, n))
    resid = y @ rng.standard_normal((n, n)).T * 0.5 + 0.05 * rng.standard_normal((rows, n))  # explained by y
    parts = []
    for sl in (slice(0, 800), slice(800, 1000), slice(1000, 1200)):
        d = {}
        for src, s in (("input", x), ("output", y)):
            d[src, 0] = C.Moments.zeros(n)
            d[src, 0].add(s[sl], resid[sl])
        parts.append(d)
    assert np.linalg.norm(C.fit_layer(parts[0]["input", 0], n, 1.0).matrix) < np.linalg.norm(
        C.fit_layer(parts[0]["input", 0], n, 0.0).matrix
    )
    scores, fitted = C.sweep(*parts, ranks=[2, n])
    assert {(s.source, s.rank) for s in scores} == {("input", 2), ("input", n), ("output", 2), ("output", n)}
    assert C.choose(parts[2], scores, None, None) == ("output", n)
    assert C.choose(parts[2], scores, "input", 2) == ("input", 2)
    out = next(s for s in scores if s.source == "output" and s.rank == n)
    assert out.heldout_removed > 0.95 and fitted["output", 0, n].up.shape == (n, n)


# --- the numpy MoE block ------------------------------------------------------------------------


def test_moe_forward_is_the_per_token_definition():
    rng = np.random.default_rng(4)
    n, ff, e, k = 6, 5, 4, 2
    ly = M.MoeLayer(
        *(rng.standard_normal(s).astype(np.float32) for s in ((e, n), (e, ff, n), (e, ff, n), (e, n, ff))), "F32"
    )
    model = M.MoeModel(Path("x"), "qwen3moe", n, e, k, True, {0: ly})
    x = rng.standard_normal((9, n)).astype(np.float32)
    want = np.zeros((9, n))
    for i, xi in enumerate(x.astype(np.float64)):
        p = np.exp(ly.router @ xi - (ly.router @ xi).max())
        p /= p.sum()
        top = np.argsort(-p)[:k]
        for j in top:
            g, u = ly.gate[j] @ xi, ly.up[j] @ xi
            want[i] += p[j] / p[top].sum() * (ly.down[j] @ (g / (1 + np.exp(-g)) * u))
    np.testing.assert_allclose(M.moe_forward(model, 0, x), want, rtol=1e-4, atol=1e-5)
    experts, weights = M.route(model, 0, x)
    np.testing.assert_allclose(M.moe_forward(model, 0, x, experts, weights), want, rtol=1e-4, atol=1e-5)


def test_windows_are_evenly_spaced():
    wins = CAP.windows(np.arange(10_000), 7)
    assert len(wins) == 7 and all(len(w) == 256 for w in wins) and wins[0][0] == 0
    assert len({int(w[1][0] - w[0][0]) for w in (wins[i : i + 2] for i in range(6))}) == 1


# --- the command --------------------------------------------------------------------------------


def test_show_and_check(tmp_path, run_cli):
    q2 = write_model(tmp_path / "q2.gguf", T.Q2_K)
    comp = make_comp(n_embd=256, rank=2, experts_hash=C.experts_hash(q2))
    C.write_compensator(tmp_path / "c.gguf", comp)
    rc, out, _ = run_cli(cmd.main, "show", tmp_path / "c.gguf", "--model", q2)
    assert rc == EXIT_OK and "fits" in out and "C_spectral" in out
    f16 = write_model(tmp_path / "f16.gguf", T.F16)
    rc, out, err = run_cli(cmd.main, "show", tmp_path / "c.gguf", "--model", f16)
    assert rc == EXIT_CHECK_FAILED and "does NOT fit" in out and "experts_hash" in err
    rc, _, err = run_cli(cmd.main, "show", write_raw(tmp_path / "bad.gguf", arch="x"))
    assert rc == EXIT_USAGE and "expected 'onebit_compensator'" in err
    rc, _, err = run_cli(cmd.main, "fit", "--model", tmp_path / "none.gguf", "--quantized", q2, "--out", tmp_path / "o")
    assert rc == EXIT_USAGE and "no such file" in err


def test_show_refuses_a_sidecar_with_a_huge_finite_weight(tmp_path, run_cli):
    q2 = write_model(tmp_path / "q2.gguf", T.Q2_K)
    good = make_comp(n_embd=256, rank=2, experts_hash=C.experts_hash(q2))
    tensors = {}
    for li, ly in good.layers.items():
        tensors[f"compensator.{li}.down"], tensors[f"compensator.{li}.up"] = ly.down, ly.up.copy()
    tensors["compensator.1.up"][7, 0] = 3e38  # finite: the reader's finiteness check lets it through
    keys = {C.KEY_EXPERTS_HASH: ("u64", good.experts_hash), C.KEY_SOURCE: ("str", "input")}
    bad = write_raw(tmp_path / "huge.gguf", keys=keys, tensors=tensors, n_embd=256, rank=2)
    rc, out, err = run_cli(cmd.main, "show", bad, "--model", q2)
    assert rc == EXIT_USAGE, (rc, out, err)
    gain = np.linalg.norm(tensors["compensator.1.up"].astype(np.float64)) * np.linalg.norm(good.layers[1].down)
    assert f"{bad}: layer 1: the map's gain bound ||up||*||down|| = {gain:.2g} exceeds 65504" in err, err
    assert "fits" not in out
    C.write_compensator(tmp_path / "good.gguf", good)  # the same sidecar without the huge weight fits
    rc, out, _ = run_cli(cmd.main, "show", tmp_path / "good.gguf", "--model", q2)
    assert rc == EXIT_OK and "fits" in out


def test_fit_refuses_an_out_it_cannot_write_before_any_work(tmp_path, run_cli, monkeypatch):
    f16, q2 = write_model(tmp_path / "f16.gguf", T.F16), write_model(tmp_path / "q2.gguf", T.Q2_K)

    def work(*args, **kwargs):
        raise AssertionError("the fit started before --out was checked")

    monkeypatch.setattr(CAP, "corpus_streams", work)
    fit = ("fit", "--model", f16, "--quantized", q2, "--out")
    rc, _, err = run_cli(cmd.main, *fit, tmp_path / "absent" / "c.gguf")
    assert rc == EXIT_USAGE and f"the directory {tmp_path / 'absent'} does not exist" in err, err
    rc, _, err = run_cli(cmd.main, *fit, tmp_path)
    assert rc == EXIT_USAGE and f"--out {tmp_path}: is a directory" in err, err
    monkeypatch.setattr(cmd.os, "access", lambda path, mode: False)
    rc, _, err = run_cli(cmd.main, *fit, tmp_path / "c.gguf")
    assert rc == EXIT_USAGE and f"the directory {tmp_path} is not writable" in err, err


# --- with the patched build -----------------------------------------------------------------------


@pytest.mark.needs_build
def test_capture_shapes_and_the_numpy_moe_matches_llama_cpp(tmp_path):
    _, val = CAP.corpus_streams()
    wins = CAP.windows(val, 2)
    ref = M.load_moe(TINY)
    with CAP.Capturer(TINY, threads=1) as cap:
        got = cap.run(wins)
    assert sorted(got.layers) == list(range(8)) and got.n_tokens == 512
    for act in got.layers.values():
        assert act.x.shape == act.y.shape == (512, 64) and act.x.dtype == np.float32
        assert act.experts.shape == act.weights.shape == (512, 4)
        np.testing.assert_allclose(act.weights.sum(axis=1), 1.0, rtol=1e-5)
    for check in CAP.check_reference(ref, got):
        assert check.rel_err < 1e-3 and check.routing_agree > 0.99, check
    # llama.cpp's own compensator: a map of zeros changes nothing; 0.5 I on the input adds 0.5 x
    ident = C.model_identity(TINY)
    n = ident.n_embd

    def sidecar(name: str, scale: float) -> Path:
        lys = {li: C.CompensatorLayer(scale * np.eye(n, dtype=np.float32), np.eye(n, dtype=np.float32))
               for li in ident.moe_layers}  # fmt: skip
        comp = C.Compensator(n, n, ident.n_layer, "input", ident.arch, ident.experts_hash, layers=lys)
        C.write_compensator(tmp_path / name, comp)
        return tmp_path / name

    with CAP.Capturer(TINY, threads=1, compensator=sidecar("zero.gguf", 0.0)) as cap:
        assert cap.run(wins).nll == pytest.approx(got.nll, rel=1e-6)
    with CAP.Capturer(TINY, threads=1, compensator=sidecar("half.gguf", 0.5)) as cap:
        assert abs(cap.run(wins).nll - got.nll) > 1e-3
        with CAP.Capturer(TINY, threads=1) as full:
            held = CAP.heldout_scores(full, {"patched": cap}, wins)
    assert held["full"].nll == pytest.approx(got.nll / got.n_predicted, rel=1e-6)
    assert (held["full"].kl, held["full"].top1) == (pytest.approx(0.0, abs=1e-9), 1.0)
    assert held["patched"].kl > 1e-3 and held["patched"].top1 < 1.0


@pytest.mark.needs_build
def test_fit_command_end_to_end(tmp_path, run_cli):
    from onebit_predict.llama.paths import build_info

    q4 = tmp_path / "tiny-q4.gguf"
    subprocess.run(
        [str(build_info().build_dir / "bin" / "llama-quantize"), "--tensor-type", "ffn_(gate|up|down)_exps=q4_0",
         "--tensor-type", ".*=f16", str(TINY), str(q4), "Q4_0", "1"],
        check=True, capture_output=True,
    )  # fmt: skip
    out_file = tmp_path / "c.gguf"
    rc, out, err = run_cli(
        cmd.main, "fit", "--model", TINY, "--quantized", q4, "--out", out_file,
        "--tokens", "1280", "--heldout-tokens", "512", "--ranks", "4,16", "--json",
    )  # fmt: skip
    assert rc == EXIT_OK, err
    comp = C.read_compensator(out_file)
    C.check_model(comp, q4)
    with pytest.raises(C.CompensatorError, match="fitted for other experts"):
        C.check_model(comp, TINY)
    assert comp.rank in (4, 16) and comp.source in C.SOURCES and sorted(comp.layers) == list(range(8))
    assert max(ly.gain_bound for ly in comp.layers.values()) < SIDECAR_MAX_GAIN / 100  # a fitted map: far below
    import json

    doc = json.loads(out)
    assert all(s["heldout_removed"] > 0 for s in doc["scores"])
    rc, _, err = run_cli(cmd.main, "fit", "--model", TINY, "--quantized", TINY, "--out", out_file)
    assert rc == EXIT_USAGE and "same experts" in err
