"""The texts of the 2-bit measurements, made once and written under the cache: the imatrix's
training text, the held-out texts quality.py, agreement.py and blame.py score.

The corpus is tools/train_tiny.py's (the CPython stdlib's ``*.py``, sorted; a file is validation
when ``int(sha1(relpath), 16) % 20 == 0``), each split a stream of files separated by the
end-of-file token, written as text: the file's bytes and ``<|endoftext|>`` between files, which the
models' byte tokenizer reads as token 256 (models/README.md). The training text feeds the imatrix;
the held-out (validation) text, the quality and agreement measurements. ``outside``
(:data:`OUTSIDE`) is a second held-out text from outside the training corpus: the installed
llama-cpp-python's own ``*.py`` (pinned by pyproject.toml), every file, whatever its split.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_bytes
from ..corpus import EOD, corpus_files, is_validation

logger = logging.getLogger("onebit_predict")

EOD_TEXT = b"<|endoftext|>"  # its text: the byte tokenizer maps it to token 256
SPLITS = ("train", "val")
OUTSIDE = "outside"  # the second held-out text: from outside the training corpus (outside_files)
OUTSIDE_PACKAGE, OUTSIDE_DIST = "llama_cpp", "llama-cpp-python"  # its Python sources, pinned in pyproject.toml
TEXTS = ("val", OUTSIDE)  # the held-out texts quality.py scores


class TextError(ValueError):
    """A text cannot be made as asked (input: exit 2)."""


@dataclass(frozen=True)
class Text:
    """A text file cut from one split of the corpus: the first ``n_tokens`` tokens of its stream."""

    path: Path
    split: str  # train or val
    n_tokens: int  # what the byte tokenizer makes of it (at most the tokens asked for: a cut ends on a character)
    files: tuple[str, ...]  # the corpus files it holds (the last one may be cut)
    sha256: str
    corpus_fingerprint: str  # tools/train_tiny.py's: sha256 over the relative paths and the files' sha256
    python: str  # the CPython whose stdlib it is
    package: str | None = None  # OUTSIDE: the distribution and version whose sources it is

    @property
    def description(self) -> str:
        files = f"({len(self.files)} files, {self.files[0]} .. {self.files[-1]})"
        if self.split == OUTSIDE:
            return (
                f"{self.package}'s own Python sources (outside the training corpus), first {self.n_tokens} tokens "
                f"{files}, text sha256 {self.sha256[:16]}"
            )
        what = "training" if self.split == "train" else "held-out (validation)"
        return (
            f"CPython {self.python} stdlib {what} split, first {self.n_tokens} tokens "
            f"{files}, corpus {self.corpus_fingerprint[:16]}, text sha256 {self.sha256[:16]}"
        )

    def summary(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "split": self.split,
            "n_tokens": self.n_tokens,
            "n_files": len(self.files),
            "files": [self.files[0], self.files[-1]],
            "sha256": self.sha256,
            "corpus_fingerprint": self.corpus_fingerprint,
            "python": self.python,
            "package": self.package,
            "description": self.description,
        }

    def tokens(self) -> list[int]:
        """The token ids of the text (bytes; ``<|endoftext|>`` is 256)."""
        out: list[int] = []
        parts = self.path.read_bytes().split(EOD_TEXT)
        for i, part in enumerate(parts):
            out += part
            if i < len(parts) - 1:
                out.append(EOD)
        return out


def _utf8_prefix(data: bytes) -> bytes:
    """``data`` without a character cut at its end."""
    for cut in range(4):
        try:
            (data[: len(data) - cut] if cut else data).decode("utf-8")
            return data[: len(data) - cut] if cut else data
        except UnicodeDecodeError:
            continue
    raise TextError("a corpus file is not UTF-8")


def build_text(split: str, n_tokens: int, files: Sequence[tuple[str, Path]]) -> tuple[bytes, int, list[str], str]:
    """(text, tokens, files used, corpus fingerprint) of the first ``n_tokens`` of ``split``'s stream."""
    if split not in (*SPLITS, OUTSIDE):
        raise TextError(f"split {split!r} is not one of {(*SPLITS, OUTSIDE)}")
    fingerprint = hashlib.sha256()
    out, n, used, cut = bytearray(), 0, [], False
    for rel, path in files:
        data = path.read_bytes()
        fingerprint.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        if cut or (split != OUTSIDE and is_validation(rel) != (split == "val")):
            continue
        take = data[: n_tokens - n]
        if EOD_TEXT in take:  # only in what the text holds (llama-cpp-python's chat templates name it)
            raise TextError(f"{path} holds {EOD_TEXT!r}: it would read as the end-of-file token")
        if len(take) < len(data):
            take, cut = _utf8_prefix(take), True
        out += take
        n += len(take)
        used.append(rel)
        if not cut:
            out += EOD_TEXT
            n += 1
            cut = n >= n_tokens
    if n == 0:
        raise TextError(f"the corpus has no {split} files")
    return bytes(out), n, used, fingerprint.hexdigest()


def outside_files() -> list[tuple[str, Path]]:
    """(relative path, path) of the installed llama-cpp-python's ``*.py``, sorted: Python source that is
    not the CPython stdlib, pinned by pyproject.toml, on every machine the project runs on."""
    spec = importlib.util.find_spec(OUTSIDE_PACKAGE)
    if spec is None or spec.origin is None:
        raise TextError(f"{OUTSIDE_DIST} is not installed: it is the {OUTSIDE} text's source")
    root = Path(spec.origin).parent
    return sorted((p.relative_to(root).as_posix(), p) for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def corpus_text(split: str, n_tokens: int, root: Path, stdlib: Path | None = None) -> Text:
    """The text of the first ``n_tokens`` tokens of ``split`` (or of the OUTSIDE text), written once
    under ``<root>/texts``."""
    package = None
    if split == OUTSIDE:
        files, package = outside_files(), f"{OUTSIDE_DIST} {importlib.metadata.version(OUTSIDE_DIST)}"
    else:
        files = corpus_files(stdlib)
    if not files:
        raise TextError("no stdlib sources found (sysconfig's stdlib path)")
    data, n, used, fingerprint = build_text(split, n_tokens, files)
    python = ".".join(map(str, sys.version_info[:3]))
    path = Path(root) / "texts" / f"{split}-{n_tokens}-{fingerprint[:16]}.txt"
    if not (path.is_file() and path.read_bytes() == data):
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
    return Text(path, split, n, tuple(used), hashlib.sha256(data).hexdigest(), fingerprint, python, package)


def trained_corpus(model: Path) -> str | None:
    """The corpus fingerprint the model's training record (``NAME.json`` beside it) names, if any."""
    record = model.with_suffix(".json")
    try:
        return json.loads(record.read_text())["corpus"]["fingerprint"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_corpus(model: Path, text: Text) -> None:
    """Warn when the model's training record names another corpus than the text's (held-out may be trained on)."""
    trained = trained_corpus(model)
    if trained is not None and trained != text.corpus_fingerprint:
        logger.warning(
            "%s was trained on corpus %s, the texts come from %s (another CPython's stdlib): "
            "the held-out text may not be held out",
            model.name,
            trained[:16],
            text.corpus_fingerprint[:16],
        )
