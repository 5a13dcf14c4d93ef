"""The bundled models' tokenizer (onebit_predict.grow.vocab, models/README.md "Token ids: bytes").

The committed GGUFs carry an RWKV vocabulary whose token ``i`` is byte ``i`` and id 256 the
end-of-file control token. What is proven here:

- the vocabulary is the only change: stripping it (:func:`strip_vocab`) gives back, byte for
  byte, the file the training run's converter wrote (its sha256 is in
  ``models/NAME.train.log``), and adding it again gives the committed file;
- with the patched build: the logits on the held-out bytes (the first 128 bytes; a prefill of
  16, then one token at a time; every row) are byte-identical between the committed model
  and its vocabulary-less copy written here; and llama.cpp's tokenizer maps text to exactly
  its UTF-8 bytes (no BOS, no EOS added) and the bytes back to the text.
"""

from __future__ import annotations

import ctypes
import hashlib
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from onebit_predict.commands.vocab import main as vocab_main
from onebit_predict.grow import vocab

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / "models"
HELDOUT = MODELS_DIR / "heldout.txt"
MODELS = ("qwen3moe-tiny", "qwen4exp-tiny", "olmoe-tiny")

# sha256 of the files the training runs' converter wrote (tokenizer model "none"), as
# models/NAME.train.log records them: the committed files minus the vocabulary
TRAINED_SHA256 = {
    "qwen3moe-tiny": "ad57f4c2f19738b72148f1d8f0f77abf73a0103f26813e69bf199bfb8b679670",
    "qwen4exp-tiny": "cba520c1d0bebd2ab143c8ed3d034846d64ed23e718e75d218833a7ea921bcdf",
    "olmoe-tiny": "56e83301e7bcdf960768f0ba221f9cd75d863fb669790aa55631a805529ec9d4",
}

TRICKY = [
    "",
    "def main():",
    "def main():\n    return 0\n",
    "  two  spaces,\ttab,\r\nCRLF\n\n",
    " leading space",
    "\x00nul\x00",
    "caf\u00e9 na\u00efve \u00fcber \u2581 \u2014 \u4e2d\u6587 \U0001f600",
    "back\\slash \\x41 \\n not escapes",
    "<s></s><|im_start|>[PAD]",
    "".join(chr(c) for c in range(1, 128)),
]


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _unescape_rwkv(text: str) -> bytes:
    """llama_unescape_rwkv_token (src/llama-vocab.cpp) in Python, to check the token texts."""
    out = bytearray()
    escaping, hex_left, acc = False, 0, 0
    for ch in text.encode():
        c = chr(ch)
        if hex_left:
            acc = (acc << 4) + (ch - ord("a") + 10 if c >= "a" else ch - ord("0"))
            hex_left -= 1
            if not hex_left:
                out.append(acc & 0xFF)
                acc = 0
        elif escaping:
            escaping = False
            if c == "x":
                hex_left = 2
            else:
                out.append({"t": 9, "n": 10, "r": 13}.get(c, ch))
        elif c == "\\":
            escaping = True
        else:
            out.append(ch)
    return bytes(out)


# --- the vocabulary and the files (gguf-py only) ----------------------------------------------


def test_token_texts_unescape_to_their_byte():
    tokens, types = vocab.byte_vocab()
    assert len(tokens) == len(types) == vocab.N_VOCAB == 257
    assert len(set(tokens)) == len(tokens)
    for i in range(256):
        assert _unescape_rwkv(tokens[i]) == bytes([i]), tokens[i]
        assert types[i] == gguf.TokenType.NORMAL
    assert tokens[vocab.EOF_ID] == vocab.EOF_TEXT
    assert types[vocab.EOF_ID] == gguf.TokenType.CONTROL


@pytest.mark.parametrize("name", MODELS)
def test_committed_model_carries_the_byte_vocab(name):
    r = gguf.GGUFReader(MODELS_DIR / f"{name}.gguf")
    arch = r.fields["general.architecture"].contents()
    tokens, types = vocab.byte_vocab()
    assert r.fields["tokenizer.ggml.model"].contents() == "rwkv"
    assert r.fields["tokenizer.ggml.tokens"].contents() == tokens
    assert r.fields["tokenizer.ggml.token_type"].contents() == types
    assert r.fields["tokenizer.ggml.eos_token_id"].contents() == 256
    assert r.fields["tokenizer.ggml.add_bos_token"].contents() is False
    assert r.fields["tokenizer.ggml.add_eos_token"].contents() is False
    assert r.fields[f"{arch}.vocab_size"].contents() == 257
    assert "tokenizer.ggml.bos_token_id" not in r.fields


@pytest.mark.parametrize("name", MODELS)
def test_vocab_is_the_only_change(name, tmp_path):
    committed = MODELS_DIR / f"{name}.gguf"
    plain = vocab.strip_vocab(committed, tmp_path / "plain.gguf")
    assert _sha256(plain) == TRAINED_SHA256[name]
    again = vocab.add_byte_vocab(plain, tmp_path / "again.gguf")
    assert again.read_bytes() == committed.read_bytes()
    # idempotent on its own output, in place
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(committed.read_bytes())
    vocab.add_byte_vocab(copy, copy)
    assert copy.read_bytes() == committed.read_bytes()
    # same tensors, same data
    a, b = gguf.GGUFReader(committed), gguf.GGUFReader(plain)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    assert all(x.data.tobytes() == y.data.tobytes() for x, y in zip(a.tensors, b.tensors, strict=True))


def _write_gguf(path: Path, model: str, n_vocab: int = 257) -> Path:
    w = gguf.GGUFWriter(path, "llama")
    w.add_tokenizer_model(model)
    w.add_vocab_size(n_vocab)
    w.add_tensor("token_embd.weight", np.zeros((n_vocab, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.gguf", "no such file"),
        (lambda d: (d / "text.gguf").write_text("not a gguf") and d / "text.gguf", "cannot read it as a GGUF"),
        (lambda d: _write_gguf(d / "gpt2.gguf", "gpt2"), "not a byte-level model"),
        (lambda d: _write_gguf(d / "v300.gguf", "none", 300), "300 tokens"),
    ],
)
def test_bad_input(make, message, tmp_path, capsys):
    src = make(tmp_path)
    assert vocab_main([str(src), str(tmp_path / "out.gguf")]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (tmp_path / "out.gguf").exists()
    assert not list(tmp_path.glob("*.tmp"))


def test_module_entry_point(tmp_path):
    src = _write_gguf(tmp_path / "tiny.gguf", "none")
    out = tmp_path / "out.gguf"
    proc = subprocess.run(
        [sys.executable, "-m", "onebit_predict.commands.vocab", str(src), str(out)], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert gguf.GGUFReader(out).fields["tokenizer.ggml.model"].contents() == "rwkv"
    proc = subprocess.run(
        [sys.executable, "-m", "onebit_predict.commands.vocab", str(tmp_path / "nope.gguf"), str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert "no such file" in proc.stderr


# --- through the patched llama.cpp -----------------------------------------------------------


def _lib_vocab(model):
    from onebit_predict.llama.runner import llama

    lib = llama()
    return lib, lib.llama_model_get_vocab(model.ptr)


def _detokenize(model, ids: list[int], special: bool = False) -> bytes:
    lib, v = _lib_vocab(model)
    arr = (lib.llama_token * max(1, len(ids)))(*ids)
    size = 4 * len(ids) + 64
    buf = ctypes.create_string_buffer(size)
    n = lib.llama_detokenize(v, arr, len(ids), buf, size, False, special)
    assert n >= 0, n
    return buf.raw[:n]


def _tokenize_bytes(model, data: bytes, add_special: bool = True, parse_special: bool = False) -> list[int]:
    lib, v = _lib_vocab(model)
    n_max = len(data) + 16
    buf = (lib.llama_token * n_max)()
    n = lib.llama_tokenize(v, data, len(data), buf, n_max, add_special, parse_special)
    assert n >= 0, n
    return list(buf[:n])


@pytest.mark.needs_build
@pytest.mark.parametrize("name", MODELS)
def test_tokenizer_maps_text_to_its_bytes(name):
    from onebit_predict.llama.runner import Model, llama

    heldout = HELDOUT.read_bytes()
    with Model(MODELS_DIR / f"{name}.gguf") as model:
        lib, v = _lib_vocab(model)
        assert lib.llama_vocab_type(v) == llama().LLAMA_VOCAB_TYPE_RWKV
        assert model.n_vocab == 257
        assert lib.llama_vocab_eos(v) == 256
        assert lib.llama_vocab_is_eog(v, 256)
        assert lib.llama_vocab_bos(v) == -1
        assert not lib.llama_vocab_get_add_bos(v)
        assert not lib.llama_vocab_get_add_eos(v)
        for text in [heldout.decode(), *TRICKY]:
            ids = model.tokenize(text)
            assert ids == list(text.encode()), text
            assert _tokenize_bytes(model, text.encode(), parse_special=True) == ids, text
            assert _detokenize(model, ids) == text.encode(), text
        # any byte string, valid UTF-8 or not
        every = bytes(range(256)) + bytes(range(255, -1, -1))
        assert _tokenize_bytes(model, every) == list(every)
        assert _detokenize(model, list(every)) == every
        # the end-of-file token: invisible unless asked for; its text (the RWKV tokenizer
        # matches every token's text, parse_special or not) is that token
        assert _detokenize(model, [104, 105, 256]) == b"hi"
        assert _detokenize(model, [104, 105, 256], special=True) == b"hi<|endoftext|>"
        assert model.tokenize("a<|endoftext|>b") == [97, 256, 98]


def _heldout_logits(path: Path, n: int = 128, prefill: int = 16) -> bytes:
    """Every row's logits (float32 bytes) of the first n held-out bytes: prefill, then one at a time."""
    from onebit_predict.llama.runner import Context, ContextSettings, Model

    tokens = list(HELDOUT.read_bytes()[:n])
    env = {k: None for k in ("ONEBIT_MOE_PREDICT", "ONEBIT_MOE_PREDICT_OUT", "ONEBIT_MOE_PREDICT_STATS")}
    rows: list[bytes] = []
    with Model(path) as model, Context(model, ContextSettings(n_ctx=256, n_threads=1), env) as ctx:
        rows += ctx.decode(tokens[:prefill], list(range(prefill)), [0] * prefill, [True] * prefill)
        for i in range(prefill, n):
            rows += ctx.decode([tokens[i]], [i], [0], [True])
    assert len(rows) == n and all(len(r) == 257 * 4 for r in rows)
    return b"".join(rows)


@pytest.mark.needs_build
@pytest.mark.parametrize("name", MODELS)
def test_logits_unchanged_by_the_vocab(name, tmp_path):
    committed = MODELS_DIR / f"{name}.gguf"
    plain = vocab.strip_vocab(committed, tmp_path / f"{name}-none.gguf")
    assert gguf.GGUFReader(plain).fields["tokenizer.ggml.model"].contents() == "none"
    a = _heldout_logits(committed)
    b = _heldout_logits(plain)
    values = np.frombuffer(a, dtype=np.float32)
    assert np.isfinite(values).all() and values.std() > 0.1
    assert a == b, f"{name}: logits differ between the model with and without the vocabulary"
