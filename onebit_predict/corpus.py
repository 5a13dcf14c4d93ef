"""The text corpus of the trained tiny models: which files, in which order, which split.

The CPython standard library sources of the Python that runs (``sysconfig.get_paths()["stdlib"]``),
every ``*.py`` outside the top-level directories of :data:`EXCLUDED_TOP` and ``__pycache__``,
read as raw bytes in sorted relative-path order, each file followed by the end-of-file token
:data:`EOD`. A file is validation text when ``int(sha1(relpath), 16) % VAL_MODULUS == 0``.
tools/train_tiny.py trains on the rest; the 2-bit study (int2/) fits and calibrates on training
text only and measures on validation text. models/README.md, section "Corpus", has the figures.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

EOD = 256  # end-of-file token between corpus files
VOCAB = 257  # 256 byte values + EOD
VAL_MODULUS = 20  # a file is in validation when sha1(relpath) % 20 == 0 (about 5 %)
# top-level stdlib directories left out: third-party packages, the test suite (mostly
# generated data and very repetitive), and a few directories of GUI/demo code
EXCLUDED_TOP = ("site-packages", "dist-packages", "test", "idlelib", "lib2to3", "turtledemo", "tkinter")


def stdlib_root() -> Path:
    """This Python's standard library directory: the corpus's root."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of every stdlib ``*.py`` in the corpus, sorted by relative path."""
    root = Path(root or stdlib_root())
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if rel.parts[0] in EXCLUDED_TOP or "__pycache__" in rel.parts:
            continue
        out.append((rel.as_posix(), path))
    out.sort()
    return out


def is_validation(rel: str) -> bool:
    """Whether the corpus file at relative path ``rel`` is validation (held-out) text."""
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % VAL_MODULUS == 0
