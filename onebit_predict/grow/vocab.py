"""Give a byte-level GGUF a tokenizer: an RWKV vocabulary of the 256 byte values.

The bundled trained models (models/README.md) read bytes: token id = byte value (0..255),
id 256 = the end-of-file token that separated the corpus files. Converted without a
tokenizer (``tokenizer.ggml.model = "none"``), every llama.cpp program that tokenizes text
aborts on them. llama.cpp's RWKV tokenizer (``src/llama-vocab.cpp``) is a greedy
longest match over the *unescaped* token texts, and its detokenizer unescapes the text
back (``llama_unescape_rwkv_token``: ``\\xNN`` with lower-case hex is the byte NN). So a
vocabulary whose token ``i`` (0..255) has the text ``\\xNN`` of byte ``i`` maps any text to
exactly its UTF-8 bytes, and the bytes back to the text, and every id keeps the value the
model was trained on: the weights and the logits are unchanged. (An SPM vocabulary of
``<0xNN>`` byte tokens would not do: SPM turns spaces into U+2581 before it looks anything
up.)

:func:`add_byte_vocab` rewrites a GGUF with this vocabulary:

- ``tokenizer.ggml.model = "rwkv"`` (in place of ``"none"``), followed by
  ``tokenizer.ggml.tokens`` (``\\x00`` .. ``\\xff``, then :data:`EOF_TEXT`) and
  ``tokenizer.ggml.token_type`` (NORMAL for the bytes, CONTROL for id 256);
- ``tokenizer.ggml.eos_token_id = 256`` (kept, or added when missing);
- ``tokenizer.ggml.add_bos_token = false`` and ``tokenizer.ggml.add_eos_token = false``
  (the models have no BOS: a sequence starts with its first byte; llama.cpp's RWKV
  defaults are the same, the keys say it to every reader);
- every other key (``{arch}.vocab_size`` = 257 included) and every tensor copied
  unchanged, in the source's order; the output is a function of the input alone.

:func:`strip_vocab` is the inverse (back to ``"none"``): ``strip_vocab(add_byte_vocab(f))``
is ``f`` byte for byte for the committed models, which is how the tests prove that the
vocabulary is the only change.

One property of llama.cpp's RWKV tokenizer to know: it matches every token's text,
control tokens included, whatever ``parse_special`` says, so the literal text
``<|endoftext|>`` in a prompt becomes token 256 (the end-of-file token) rather than its 13
bytes. Every other text tokenizes to exactly its bytes.

Command line (onebit_predict/commands/vocab.py)::

    python -m onebit_predict.commands.vocab IN.gguf OUT.gguf          # add the vocabulary
    python -m onebit_predict.commands.vocab --strip IN.gguf OUT.gguf  # back to "none"

(``OUT`` may be ``IN``: the file is replaced at the end.) Exit status 2 with a message when
``IN`` is not a byte-level GGUF of this layout (:class:`VocabError`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..atomic import atomic_path
from .gguf_keys import check_gguf_whole, copy_key, write_tensors_as_read

N_BYTES = 256  # ids 0..255: the byte values
EOF_ID = 256  # the end-of-file token the models were trained with
N_VOCAB = 257
EOF_TEXT = "<|endoftext|>"

K_MODEL = "tokenizer.ggml.model"
K_TOKENS = "tokenizer.ggml.tokens"
K_TYPES = "tokenizer.ggml.token_type"
K_EOS = "tokenizer.ggml.eos_token_id"
K_ADD_BOS = "tokenizer.ggml.add_bos_token"
K_ADD_EOS = "tokenizer.ggml.add_eos_token"
# keys this module writes (or drops); every other key is copied as it is
_OWN = (K_MODEL, K_TOKENS, K_TYPES, K_EOS, K_ADD_BOS, K_ADD_EOS)
# keys of other tokenizers: a file carrying any of them is not a byte-level model of this layout
_FOREIGN = (
    "tokenizer.ggml.pre",
    "tokenizer.ggml.scores",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.unknown_token_id",
)


class VocabError(ValueError):
    """The input is not a byte-level GGUF this module can (un)label."""


def _gguf() -> Any:
    import gguf  # a dependency of the package; imported here to keep `import onebit_predict` light

    return gguf


def byte_token_text(byte: int) -> str:
    """The RWKV token text of one byte: ``\\xNN``, lower-case hex (what llama.cpp unescapes)."""
    if not 0 <= byte < N_BYTES:
        raise ValueError(f"not a byte: {byte}")
    return f"\\x{byte:02x}"


def byte_vocab() -> tuple[list[str], list[int]]:
    """The token texts and token types of the vocabulary, id by id."""
    gguf = _gguf()
    tokens = [byte_token_text(b) for b in range(N_BYTES)] + [EOF_TEXT]
    types = [int(gguf.TokenType.NORMAL)] * N_BYTES + [int(gguf.TokenType.CONTROL)]
    return tokens, types


def _open(path: Path) -> Any:
    if not path.is_file():
        raise VocabError(f"{path}: no such file")
    try:
        return _gguf().GGUFReader(path)
    except (OSError, ValueError, KeyError, IndexError) as e:
        raise VocabError(f"{path}: cannot read it as a GGUF: {e}") from None


def _value(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _check(reader: Any, path: Path) -> str:
    """The architecture of a byte-level GGUF of this layout; VocabError otherwise."""
    arch = _value(reader, "general.architecture")
    if not isinstance(arch, str):
        raise VocabError(f"{path}: no general.architecture")
    model = _value(reader, K_MODEL)
    if model not in ("none", "rwkv"):
        raise VocabError(f"{path}: tokenizer.ggml.model is {model!r}: not a byte-level model (want 'none')")
    foreign = [k for k in _FOREIGN if k in reader.fields]
    if foreign:
        raise VocabError(f"{path}: carries another tokenizer's keys ({', '.join(foreign)})")
    if model == "rwkv":
        tokens, types = byte_vocab()
        if _value(reader, K_TOKENS) != tokens or _value(reader, K_TYPES) != types:
            raise VocabError(f"{path}: carries an RWKV vocabulary other than the byte vocabulary")
    n_vocab = _value(reader, f"{arch}.vocab_size")
    if n_vocab is None:
        n_vocab = len(_value(reader, K_TOKENS) or [])
    if n_vocab != N_VOCAB:
        raise VocabError(f"{path}: {n_vocab} tokens; a byte-level model has {N_VOCAB} (256 bytes + end of file)")
    emb = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    if emb is None:
        raise VocabError(f"{path}: no token_embd.weight")
    if len(emb.shape) != 2 or int(emb.shape[1]) != N_VOCAB:
        raise VocabError(f"{path}: token_embd.weight is {list(map(int, emb.shape))}, not [n_embd, {N_VOCAB}]")
    eos = _value(reader, K_EOS)
    if eos is not None and eos != EOF_ID:
        raise VocabError(f"{path}: eos_token_id is {eos}, not {EOF_ID} (the end-of-file token)")
    return arch


def _rewrite(src: Path, dst: Path, with_vocab: bool) -> Path:
    gguf = _gguf()
    vt = gguf.GGUFValueType
    src, dst = Path(src), Path(dst)
    reader = _open(src)
    arch = _check(reader, src)
    tokens, types = byte_vocab()
    dst.parent.mkdir(parents=True, exist_ok=True)
    # whole or absent (onebit_predict/atomic.py): a full disk is an OSError, never half a model at dst
    with atomic_path(dst) as tmp:
        writer = gguf.GGUFWriter(tmp, arch)
        try:
            for key, field in reader.fields.items():
                if key.startswith("GGUF.") or key == "general.architecture":  # the writer writes these
                    continue
                if key == K_MODEL:
                    if with_vocab:
                        writer.add_key_value(K_MODEL, "rwkv", vt.STRING)
                        writer.add_key_value(K_TOKENS, tokens, vt.ARRAY, sub_type=vt.STRING)
                        writer.add_key_value(K_TYPES, types, vt.ARRAY, sub_type=vt.INT32)
                    else:
                        writer.add_key_value(K_MODEL, "none", vt.STRING)
                    if f"{arch}.vocab_size" not in reader.fields:  # "none" needs it (llama.cpp's n_vocab)
                        writer.add_key_value(f"{arch}.vocab_size", N_VOCAB, vt.UINT32)
                    continue
                if key in _OWN:
                    if key == K_EOS:
                        writer.add_key_value(K_EOS, EOF_ID, vt.UINT32)
                    continue
                copy_key(writer, key, field, field.contents(), src, VocabError)
            if K_EOS not in reader.fields:
                writer.add_key_value(K_EOS, EOF_ID, vt.UINT32)
            if with_vocab:
                writer.add_key_value(K_ADD_BOS, False, vt.BOOL)
                writer.add_key_value(K_ADD_EOS, False, vt.BOOL)
            write_tensors_as_read(writer, reader)
        finally:
            writer.close()
        check_gguf_whole(tmp, OSError, dst)
    return dst


def add_byte_vocab(src: Path, dst: Path) -> Path:
    """Write ``dst``: the byte-level GGUF ``src`` with the RWKV byte vocabulary (see the module doc)."""
    return _rewrite(src, dst, with_vocab=True)


def strip_vocab(src: Path, dst: Path) -> Path:
    """Write ``dst``: ``src`` without the byte vocabulary (``tokenizer.ggml.model = "none"``)."""
    return _rewrite(src, dst, with_vocab=False)
