"""ONEBIT_MOE_PREDICT=learned in libllama: the committed sidecars run in the graph (the trace
records their predictions at their distance, and they beat the router they start from on the
held-out text), and every sidecar that does not fit refuses the context with its reason: one
made for another model (issue 21), one that names no model, one with a non-finite weight."""

from __future__ import annotations

from pathlib import Path

import pytest

from onebit_predict.checks.bitident import SCENARIOS, random_sidecar, run_once, run_problem
from onebit_predict.commands.trace import main as trace_main
from onebit_predict.constants import ENV_AHEAD, ENV_LEARNED, ENV_MODE, EXIT_OK
from onebit_predict.learned import IDENTITY_KEYS, model_identity
from onebit_predict.llama.runner import Context, ContextSettings, Model, RunError
from onebit_predict.llama.tiny import TINY_ARCHS
from onebit_predict.metrics.stats import compute_stats
from onebit_predict.trace import Trace
from tests.test_learned import copy_sidecar

pytestmark = pytest.mark.needs_build

MODELS = Path(__file__).resolve().parent.parent / "models"


def _context(model: Model, env: dict[str, str | None]) -> None:
    with Context(model, ContextSettings(n_ubatch=8, n_threads=1), env):
        pass


@pytest.mark.parametrize("ahead", [1, 3])
def test_committed_sidecar_runs_at_its_distance(ahead, tmp_path):
    """qwen3moe-tiny with its own sidecar, in the graph: every predicted row predicted K ahead
    (bitident's rule) on the check's scenario; and on the held-out text, where it was trained to
    predict, a read recall above the router's it starts from (one that ran but predicted noise
    would not; on the scenario's random token stream it need not)."""
    sidecar = MODELS / f"qwen3moe-tiny.learned-k{ahead}.gguf"
    with Model(MODELS / "qwen3moe-tiny.gguf") as model:
        path = tmp_path / "scenario.bin"
        out = run_once(model, SCENARIOS[0], f"learned@{ahead}", path, False, 0, sidecar)
        assert run_problem(path, out.n_routed, f"learned@{ahead}", False)[1] is None
    recall = {}
    for mode in ("router", "learned"):
        path = tmp_path / f"{mode}.bin"
        argv = [str(MODELS / "qwen3moe-tiny.gguf"), "--mode", mode, "--ahead", str(ahead), "--out", str(path)]
        argv += ["--prompt-file", str(MODELS / "heldout.txt"), "--bytes", "--window", "256", "--prefill", "16"]
        argv += ["--generate", "0", "--ctx", "256"] + (["--learned", str(sidecar)] if mode == "learned" else [])
        assert trace_main(argv) == EXIT_OK
        recall[mode] = compute_stats(Trace.open(path)).total_at(ahead).metrics()["read_recall"]
    assert recall["learned"] > recall["router"]


def _refused(model_path: Path, env: dict[str, str | None], capsys) -> str:
    with Model(model_path) as model:
        capsys.readouterr()
        with pytest.raises(RunError, match="could not create a context"):
            _context(model, env)
    return capsys.readouterr().err


def test_a_sidecar_that_does_not_fit_is_refused(tmp_path, capsys):
    qwen = MODELS / "qwen3moe-tiny.gguf"
    learned = {ENV_MODE: "learned"}
    err = _refused(qwen, learned, capsys)
    assert "ONEBIT_MOE_PREDICT=learned needs the sidecar's path in ONEBIT_MOE_PREDICT_LEARNED" in err
    err = _refused(qwen, {**learned, ENV_LEARNED: str(MODELS / "qwen3moe-tiny.learned-k2.gguf")}, capsys)
    assert "predicts 2 layer(s) ahead; set ONEBIT_MOE_PREDICT_AHEAD=2" in err
    err = _refused(qwen, {**learned, ENV_LEARNED: str(MODELS / "olmoe-tiny.learned-k1.gguf")}, capsys)
    assert "made for n_embd" in err and "this model has" in err
    err = _refused(qwen, {**learned, ENV_LEARNED: str(qwen)}, capsys)
    assert "not a learned-predictor sidecar" in err
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"junk")
    err = _refused(qwen, {**learned, ENV_LEARNED: str(junk)}, capsys)
    assert "cannot be read as a GGUF file" in err


@pytest.mark.parametrize("name", ["qwen3moe-tiny", "qwen4exp-tiny", "olmoe-tiny"])
def test_committed_sidecars_name_their_model(name):
    """Each committed (stamped) sidecar is accepted by its own model at its K: llama.cpp's router
    hash of the model equals the one the sidecar names (learned.model_identity's)."""
    with Model(MODELS / f"{name}.gguf") as model:
        for ahead in (1, 2, 3):
            sidecar = MODELS / f"{name}.learned-k{ahead}.gguf"
            _context(model, {ENV_MODE: "learned", ENV_AHEAD: str(ahead), ENV_LEARNED: str(sidecar)})


def test_a_sidecar_of_another_model_is_refused(tmp_path, capsys):
    """Issue 21: qwen4exp-tiny's K=1 sidecar has qwen3moe-tiny's shapes; it used to run there
    silently (recall 16.8 % against 92.7 %). Now the context is refused, naming both models, with
    the hashes Python computes (llama.cpp's and learned.model_identity agree)."""
    qwen = MODELS / "qwen3moe-tiny.gguf"
    learned = {ENV_MODE: "learned", ENV_AHEAD: "1"}
    (s_arch, s_hash), (m_arch, m_hash) = model_identity(MODELS / "qwen4exp-tiny.gguf"), model_identity(qwen)
    err = _refused(qwen, {**learned, ENV_LEARNED: str(MODELS / "qwen4exp-tiny.learned-k1.gguf")}, capsys)
    assert (
        f"trained on another model ({s_arch}, router hash {s_hash:016x}; this one is {m_arch}, {m_hash:016x})" in err
    ), err
    # the same architecture, another router (a hash one bit off): refused too
    other = copy_sidecar(
        MODELS / "qwen3moe-tiny.learned-k1.gguf", tmp_path / "o.gguf", keys={IDENTITY_KEYS[1]: ("u64", m_hash ^ 1)}
    )
    err = _refused(qwen, {**learned, ENV_LEARNED: str(other)}, capsys)
    assert f"router hash {m_hash ^ 1:016x}; this one is qwen3moe, {m_hash:016x})" in err, err


def test_a_sidecar_that_names_no_model_is_refused(tmp_path, capsys):
    """A sidecar trained before the model keys (the committed one without them)."""
    qwen = MODELS / "qwen3moe-tiny.gguf"
    bare = copy_sidecar(MODELS / "qwen3moe-tiny.learned-k1.gguf", tmp_path / "bare.gguf", drop=IDENTITY_KEYS)
    err = _refused(qwen, {ENV_MODE: "learned", ENV_AHEAD: "1", ENV_LEARNED: str(bare)}, capsys)
    assert "names no model" in err, err


@pytest.mark.parametrize("tensor", ["learned.3.weight", "learned.5.bias"])
def test_a_sidecar_with_a_nan_is_refused(tensor, tmp_path, capsys):
    """The committed sidecar, its model's own, with one NaN: refused, naming the layer."""
    qwen = MODELS / "qwen3moe-tiny.gguf"
    nan = copy_sidecar(MODELS / "qwen3moe-tiny.learned-k1.gguf", tmp_path / "nan.gguf", poison=tensor)
    err = _refused(qwen, {ENV_MODE: "learned", ENV_AHEAD: "1", ENV_LEARNED: str(nan)}, capsys)
    layer = tensor.split(".")[1]
    assert f"layer {layer}: learned.{layer}.weight or learned.{layer}.bias holds a non-finite value" in err, err


@pytest.mark.parametrize("arch", TINY_ARCHS[:1])
def test_random_sidecar_covers_the_predicted_layers(arch, tiny_model, tmp_path):
    """bitident's sidecar of random weights fits the model it is made for, at K = 2."""
    path = random_sidecar(tiny_model(arch), 2, tmp_path / "s.gguf", 0)
    with Model(tiny_model(arch)) as model:
        _context(model, {ENV_MODE: "learned", ENV_AHEAD: "2", ENV_LEARNED: str(path)})


def test_a_sidecar_with_a_huge_finite_weight_is_refused(tmp_path, capsys):
    """One weight of 3e38 is finite, and its logits overflow: llama.cpp refuses it by the gain bound
    (65504, F16's largest value), as the package's reader does."""
    qwen = MODELS / "qwen3moe-tiny.gguf"
    huge = copy_sidecar(
        MODELS / "qwen3moe-tiny.learned-k1.gguf", tmp_path / "huge.gguf", poison="learned.3.weight", value=3e38
    )
    err = _refused(qwen, {ENV_MODE: "learned", ENV_AHEAD: "1", ENV_LEARNED: str(huge)}, capsys)
    assert "layer 3: ||learned.3.weight|| = 3e+38 or max |learned.3.bias|" in err and "exceeds 65504" in err, err
