"""The trained tiny MoE models in models/: they load in the patched llama.cpp, they are the
files models/README.md describes (sha256), they learned something (greedy next-byte accuracy
on a held-out snippet far above chance), and, where torch and transformers are installed
(the ``train`` extra), llama.cpp's logits match the transformers checkpoint they came from.

The models are byte-level: token id = byte value, 256 = end of file; see models/README.md.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest

from onebit_predict.grow.verify import heldout_sequences, llama_logits
from onebit_predict.llama.paths import build_info

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
HELDOUT = MODELS_DIR / "heldout.txt"

# name: (architecture, layers, minimum greedy top-1 accuracy on the held-out bytes)
# Chance is 1/257 (0.4 %); always predicting the snippet's most frequent byte (a space) gets
# 26.3 %. Measured: 56.7 % (qwen3moe-tiny), 58.4 % (qwen4exp-tiny), 57.4 % (olmoe-tiny), 67.3 %
# (qwen3moe-h256), see models/README.md; the bound sits well above the unigram baseline and well below all four.
MODELS = {
    "qwen3moe-tiny": ("qwen3moe", 8, 0.40),
    "qwen4exp-tiny": ("qwen4exp", 8, 0.40),
    "olmoe-tiny": ("olmoe", 12, 0.40),
    "qwen3moe-h256": ("qwen3moe", 4, 0.40),
}
N_VOCAB = 257
NMSE_MAX = 1e-4


def _train_tiny():
    """tools/train_tiny.py, the recipe (it imports torch only inside the functions that need it)."""
    from tools import train_tiny

    return train_tiny


def _readme_sha256(gguf_name: str) -> str:
    text = (MODELS_DIR / "README.md").read_text()
    m = re.search(rf"`{re.escape(gguf_name)}`[^\n]*?\b([0-9a-f]{{64}})\b", text)
    assert m, f"models/README.md has no sha256 line for {gguf_name}"
    return m.group(1)


@pytest.fixture(scope="module")
def patched_llama():
    """The patched libllama (the fixture marks the test needs_build: tests/conftest.py)."""
    return build_info()


@pytest.fixture(scope="module")
def heldout_seqs():
    return heldout_sequences(HELDOUT)


def test_heldout_snippet_shape(heldout_seqs):
    assert len(heldout_seqs) == 4
    assert all(len(s) == 256 for s in heldout_seqs)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_committed_model_loads_and_predicts(name, patched_llama, heldout_seqs):
    arch, n_layer, min_acc = MODELS[name]
    path = MODELS_DIR / f"{name}.gguf"
    assert path.is_file(), f"{path} is missing"
    assert hashlib.sha256(path.read_bytes()).hexdigest() == _readme_sha256(path.name), (
        f"{path.name} differs from the sha256 recorded in models/README.md"
    )

    from onebit_predict.llama.runner import Model

    with Model(path) as model:
        assert model.n_vocab == N_VOCAB
        assert model.n_layer == n_layer

    logits = llama_logits(path, heldout_seqs)
    assert logits.shape == (len(heldout_seqs), 256, N_VOCAB)
    assert np.isfinite(logits).all()
    targets = np.array(heldout_seqs)[:, 1:]
    acc = float(np.mean(logits[:, :-1].argmax(-1) == targets))
    assert acc > min_acc, f"{name} ({arch}): greedy next-byte accuracy {acc:.3f} <= {min_acc}"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gguf_matches_transformers(name, patched_llama):
    pytest.importorskip(
        "torch", reason="torch is not installed (the optional 'train' extra): the transformers comparison needs it"
    )
    pytest.importorskip("transformers", reason="transformers is not installed (the optional 'train' extra)")
    hf_dir = MODELS_DIR / f"{name}-hf"
    assert hf_dir.is_dir(), f"{hf_dir} (the transformers checkpoint of {name}) is missing"
    res = _train_tiny().check(MODELS_DIR / f"{name}.gguf", hf_dir, threads=1, heldout=HELDOUT)
    assert res["nmse"] < NMSE_MAX, res
    assert res["top1_agreement"] > 0.99, res
