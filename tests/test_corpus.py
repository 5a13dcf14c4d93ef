"""The corpus rule (onebit_predict/corpus.py) is the one the committed models were trained with,
and the one every user of it shares: tools/train_tiny.py, the 2-bit study's texts and captures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from onebit_predict import corpus
from onebit_predict.int2 import capture, texts

REPO = Path(__file__).resolve().parent.parent


def test_the_held_out_snippet_s_files_are_validation_text():
    # models/README.md: heldout.txt comes from base64.py, copy.py, crypt.py, ctypes/test/test_pep3118.py,
    # the first four validation files of at least 2 KiB
    for rel in ("base64.py", "copy.py", "crypt.py", "ctypes/test/test_pep3118.py"):
        assert corpus.is_validation(rel), rel
    assert not corpus.is_validation("os.py") and not corpus.is_validation("json/decoder.py")


def test_the_corpus_skips_what_models_readme_says(tmp_path):
    for rel in ("a.py", "test/t.py", "site-packages/p.py", "pkg/__pycache__/c.py", "pkg/b.py", "pkg/x.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x")
    assert [r for r, _ in corpus.corpus_files(tmp_path)] == ["a.py", "pkg/b.py"]


def test_every_user_shares_the_one_rule():
    spec = importlib.util.spec_from_file_location("train_tiny_for_test", REPO / "tools" / "train_tiny.py")
    tt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tt)
    assert tt.corpus_files is corpus.corpus_files and tt.is_validation is corpus.is_validation
    assert texts.corpus_files is corpus.corpus_files and capture.is_validation is corpus.is_validation
    assert tt.EOD == texts.EOD == capture.EOD == corpus.EOD == 256
