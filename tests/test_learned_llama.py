"""ONEBIT_MOE_PREDICT=learned in libllama: the committed sidecars run in the graph (the trace
records their predictions at their distance, and they beat the router they start from on the
held-out text), and every sidecar that does not fit refuses the context with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest

from onebit_predict.checks.bitident import SCENARIOS, random_sidecar, run_once, run_problem
from onebit_predict.commands.trace import main as trace_main
from onebit_predict.constants import ENV_AHEAD, ENV_LEARNED, ENV_MODE, EXIT_OK
from onebit_predict.llama.runner import Context, ContextSettings, Model, RunError
from onebit_predict.llama.tiny import TINY_ARCHS
from onebit_predict.metrics.stats import compute_stats
from onebit_predict.trace import Trace

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


@pytest.mark.parametrize("arch", TINY_ARCHS[:1])
def test_random_sidecar_covers_the_predicted_layers(arch, tiny_model, tmp_path):
    """bitident's sidecar of random weights fits the model it is made for, at K = 2."""
    path = random_sidecar(tiny_model(arch), 2, tmp_path / "s.gguf", 0)
    with Model(tiny_model(arch)) as model:
        _context(model, {ENV_MODE: "learned", ENV_AHEAD: "2", ENV_LEARNED: str(path)})
