"""The compensator in llama.cpp's graph (patch 0023, ``ONEBIT_MOE_COMPENSATOR``).

- Absent, the patched build's logits are the unpatched pin's, byte for byte, on a 2-bit model; the
  same comparison with the compensator set differs (the check can fail).
- Present, the logits change, and the KL divergence against the F16 model goes down on fixed
  held-out tokens (a sidecar fitted here, on training text, by ``onebit-compensator fit``).
- The graph applies the sidecar's map: layer 0's MoE output is numpy's ``y + up @ (down @ y)``.
- Every refusal the loader documents refuses the context, with its reason.

The 2-bit model is qwen3moe-h256's Q2_K variant made in a scratch cache with a small importance
matrix (int2/variants.py; a few seconds).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from onebit_predict.commands.compensator import main as compensator_main
from onebit_predict.constants import ENV_ALL, ENV_COMPENSATOR, EXIT_OK
from onebit_predict.int2 import compensator as C
from onebit_predict.int2.capture import Capturer
from onebit_predict.int2.variants import Store
from onebit_predict.llama.runner import Context, ContextSettings, Model, RunError

pytestmark = pytest.mark.needs_build

REPO = Path(__file__).resolve().parent.parent
H256 = REPO / "models" / "qwen3moe-h256.gguf"
HELDOUT = REPO / "models" / "heldout.txt"
N_TOKENS = 128  # per held-out sequence
SETTINGS = ContextSettings(n_ctx=256, n_batch=128, n_ubatch=128, n_threads=1)

# one process, one libllama: the unpatched pin's logits come from a child
PRISTINE_LOGITS = """
import sys
from pathlib import Path
from onebit_predict.llama import runner
runner.use_unpatched()
model_path, tokens = Path(sys.argv[1]), [int(t) for t in sys.argv[2].split(",")]
settings = runner.ContextSettings(n_ctx=256, n_batch=128, n_ubatch=128, n_threads=1)
with runner.Model(model_path) as m:
    ctx = runner.Context(m, settings, {})
    rows = ctx.decode(tokens, list(range(len(tokens))), [0] * len(tokens), [True] * len(tokens))
sys.stdout.buffer.write(b"".join(rows))
"""


def sequences() -> list[list[int]]:
    data = HELDOUT.read_bytes()
    return [list(data[i * 256 : i * 256 + N_TOKENS]) for i in range(4)]


def logits(model: Path, tokens: list[int], compensator: Path | str | None = None) -> bytes:
    """Every row's logits through the patched build, every knob cleared but the compensator's."""
    env = dict.fromkeys(ENV_ALL) | ({ENV_COMPENSATOR: str(compensator)} if compensator is not None else {})
    with Model(model) as m:
        ctx = Context(m, SETTINGS, env)
        try:
            return b"".join(ctx.decode(tokens, list(range(len(tokens))), [0] * len(tokens), [True] * len(tokens)))
        finally:
            ctx.close()


def log_softmax(raw: bytes) -> np.ndarray:
    z = np.frombuffer(raw, np.float32).reshape(N_TOKENS, -1).astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def kl(p_raw: bytes, q_raw: bytes) -> float:
    """Mean KL(p || q) per row."""
    lp, lq = log_softmax(p_raw), log_softmax(q_raw)
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), axis=1)))


@pytest.fixture(scope="module")
def q2(tmp_path_factory) -> Path:
    return Store(H256, tmp_path_factory.mktemp("int2"), threads=1, train_tokens=2048).variant("q2_k").path


@pytest.fixture(scope="module")
def sidecar(q2, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("comp") / "q2_k.comp.gguf"
    argv = ["fit", "--model", str(H256), "--quantized", str(q2), "--out", str(out), "--source", "output"]
    argv += ["--ranks", "256", "--tokens", "8192", "--heldout-tokens", "1024", "--json"]
    assert compensator_main(argv) == EXIT_OK
    return out


def test_absent_is_the_unpatched_build_byte_for_byte(q2, sidecar, pristine_dir):
    tokens = sequences()[0]
    env = {k: v for k, v in os.environ.items() if k not in ENV_ALL}
    child = subprocess.run(
        [sys.executable, "-c", PRISTINE_LOGITS, str(q2), ",".join(map(str, tokens))],
        capture_output=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr.decode(errors="replace")[-2000:]
    assert len(child.stdout) == N_TOKENS * 257 * 4
    assert logits(q2, tokens) == child.stdout  # knob absent
    assert logits(q2, tokens, "") == child.stdout  # knob empty: the default
    assert logits(q2, tokens, sidecar) != child.stdout  # the control: the comparison can fail


def test_the_compensator_lowers_the_kl_against_f16(q2, sidecar, capsys):
    comp = C.read_compensator(sidecar)
    assert (comp.source, comp.rank, sorted(comp.layers)) == ("output", 256, [0, 1, 2, 3])
    C.check_model(comp, q2)
    capsys.readouterr()
    before = after = 0.0
    for tokens in sequences():
        f16, plain, comp = logits(H256, tokens), logits(q2, tokens), logits(q2, tokens, sidecar)
        assert comp != plain
        before += kl(f16, plain)
        after += kl(f16, comp)
    assert f"onebit: compensator '{sidecar}'" in capsys.readouterr().err  # it said it ran
    assert after < 0.8 * before, (before, after)


def test_the_graph_applies_the_sidecar_s_map(q2, sidecar):
    """Layer 0 reads the same input with and without the compensator: there the graph's MoE output
    must be numpy's ``y + up @ (down @ y)`` of the plain run's ``y``; deeper layers read inputs the
    correction already changed, and a near-tie router choice can flip, so they are only checked changed."""
    comp = C.read_compensator(sidecar)
    tokens = np.array(sequences()[1])
    with Capturer(q2, 1, compensator=sidecar) as graph, Capturer(q2, 1) as plain:
        g, p = graph.run([tokens]).layers, plain.run([tokens]).layers
    assert np.array_equal(g[0].x, p[0].x)
    want = comp.correct(0, p[0].x, p[0].y)
    assert np.max(np.abs(g[0].y - want)) < 1e-5 * np.max(np.abs(want))
    assert np.max(np.abs(p[0].y - want)) > 1e-3 * np.max(np.abs(want))  # the map is not nothing
    assert all(not np.allclose(g[li].y, p[li].y) for li in sorted(g))


def write_raw(path: Path, model: Path, *, tensors=None, drop=(), **keys) -> Path:
    """A compensator sidecar written key by key (the package's writer refuses bad ones)."""
    ident = C.model_identity(model)
    rank = keys.pop("rank", 4)
    values = {
        C.KEY_N_EMBD: ("u32", ident.n_embd),
        C.KEY_RANK: ("u32", rank),
        C.KEY_N_LAYER: ("u32", ident.n_layer),
        C.KEY_SOURCE: ("str", keys.pop("source", "output")),
        C.KEY_MODEL_ARCH: ("str", ident.arch),
        C.KEY_EXPERTS_HASH: ("u64", keys.pop("experts_hash", ident.experts_hash)),
    }
    w = gguf.GGUFWriter(path, C.ARCH)
    for key, (kind, value) in values.items():
        if key not in drop:
            {"u32": w.add_uint32, "u64": w.add_uint64, "str": w.add_string}[kind](key, value)
    rng = np.random.default_rng(0)
    if tensors is None:
        tensors = {}
        for li in ident.moe_layers:
            tensors[f"compensator.{li}.down"] = (0.01 * rng.standard_normal((rank, ident.n_embd))).astype(np.float32)
            tensors[f"compensator.{li}.up"] = (0.01 * rng.standard_normal((ident.n_embd, rank))).astype(np.float32)
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def refusal(model: Path, sidecar: Path | str, capsys) -> str:
    capsys.readouterr()
    with pytest.raises(RunError):
        logits(model, sequences()[0][:8], sidecar)
    return capsys.readouterr().err


def test_the_loader_refuses_with_its_reason(q2, sidecar, tmp_path, capsys):
    # fitted for the Q2_K experts: refused on their F16 source (same router, same shapes)
    err = refusal(H256, sidecar, capsys)
    assert "fitted for another model or quantization" in err and f"{C.experts_hash(q2):016x}" in err
    ok = write_raw(tmp_path / "ok.gguf", q2)
    assert logits(q2, sequences()[0][:8], ok)  # the raw writer's good file loads: each case below is its fault
    n_embd = C.model_identity(q2).n_embd
    nan = np.zeros((4, n_embd), np.float32)
    nan[1, 2] = np.nan
    huge = np.full((4, n_embd), 0.01, np.float32)
    huge[1, 2] = 3e38  # finite, and garbage: the output turned to "&&&&" before the gain bound
    base = {
        f"compensator.{li}.{part}": np.zeros((4, n_embd) if part == "down" else (n_embd, 4), np.float32)
        for li in range(4)
        for part in ("down", "up")
    }
    cases = {
        "no such file": (tmp_path / "missing.gguf", "cannot be read as a GGUF file"),
        "not a sidecar": (REPO / "models" / "qwen3moe-tiny.learned-k1.gguf", "not a compensator sidecar"),
        "no hash": (write_raw(tmp_path / "h.gguf", q2, drop=(C.KEY_EXPERTS_HASH,)), "experts_hash"),
        "rank 0": (write_raw(tmp_path / "r0.gguf", q2, rank=0, tensors={}), "rank 0 is not in 1..n_embd"),
        "rank above n_embd": (write_raw(tmp_path / "r.gguf", q2, rank=n_embd + 1, tensors={}), "is not in 1..n_embd"),
        "bad source": (write_raw(tmp_path / "s.gguf", q2, source="sideways"), "not input|output"),
        "missing layer": (
            write_raw(
                tmp_path / "m.gguf", q2, tensors={k: v for k, v in base.items() if not k.startswith("compensator.3.")}
            ),
            "holds 6 tensors; a compensator of 4 MoE layers has 8",
        ),
        "a layer the model lacks": (
            write_raw(
                tmp_path / "l.gguf",
                q2,
                tensors={k.replace("compensator.3.", "compensator.7."): v for k, v in base.items()},
            ),
            "no compensator.3.down or compensator.3.up for MoE layer 3",
        ),
        "extra tensor": (
            write_raw(tmp_path / "x.gguf", q2, tensors=base | {"extra": np.zeros(4, np.float32)}),
            "holds 9 tensors",
        ),
        "non-finite": (
            write_raw(tmp_path / "n.gguf", q2, tensors=base | {"compensator.2.down": nan}),
            "layer 2: compensator.2.down or compensator.2.up holds a non-finite value",
        ),
        "huge finite weight": (
            write_raw(
                tmp_path / "g.gguf", q2, tensors=base | {"compensator.2.down": huge, "compensator.2.up": huge.T.copy()}
            ),
            "layer 2: the map's gain bound ||compensator.2.up|| ||compensator.2.down|| = 9e+76 exceeds 65504",
        ),
        "wrong shape": (
            write_raw(tmp_path / "w.gguf", q2, tensors=base | {"compensator.1.up": base["compensator.1.down"]}),
            "layer 1: down must be F32",
        ),
    }
    for what, (path, reason) in cases.items():
        err = refusal(q2, path, capsys)
        assert reason in err and "ONEBIT_MOE_COMPENSATOR" in err, (what, err[-600:])
