"""Tiny random MoE models for checks (the ``onebit-tiny`` command: onebit_predict.commands.tiny).

The GGUF is written by the patched build's ``onebit-tiny-gguf`` tool, from the
architecture's own tensor list in llama.cpp (``llama_model_saver``), so it always matches
what this tree's loader expects, for hybrid architectures too. The weights are random:
these models are for bit-identity and plumbing checks, never for hit-rate figures.

The tool writes a temporary name next to the output; the file gets its name only once it
reads back whole (onebit_predict/atomic.py): a full disk is TinyModelError (exit 1), never
a half model under the name asked for.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from ..atomic import atomic_path
from ..grow.gguf_keys import check_gguf_whole
from .paths import NotBuiltError, build_info

TINY_ARCHS = ("qwen3moe", "olmoe", "qwen3next", "qwen35moe", "qwen4exp")
TINY_TOOL = "onebit-tiny-gguf"


class TinyModelError(RuntimeError):
    """The patched build could not write the tiny model."""


def write_tiny_model(arch: str, out: Path, seed: int = 1234) -> Path:
    """Write a tiny random ``arch`` model to ``out`` (deterministic for a given seed)."""
    if arch not in TINY_ARCHS:
        raise ValueError(f"unsupported architecture {arch!r} (one of {', '.join(TINY_ARCHS)})")
    if not 0 <= seed <= 0xFFFFFFFF:
        raise ValueError(f"seed {seed} is not an unsigned 32-bit integer")
    tool = build_info().build_dir / "bin" / TINY_TOOL
    if not tool.is_file():
        raise NotBuiltError(f"{tool} does not exist; run ./build.sh")
    out.parent.mkdir(parents=True, exist_ok=True)
    # the tool does not check its writes (llama_model_save_to_file): it writes a temporary
    # name, which becomes `out` only once it reads back whole
    try:
        with atomic_path(out) as tmp:
            proc = subprocess.run([str(tool), arch, str(tmp), str(seed)], capture_output=True, text=True)
            if proc.returncode != 0 or not tmp.is_file():
                raise TinyModelError(f"{TINY_TOOL} {arch} failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
            check_gguf_whole(tmp, TinyModelError, out)
    except OSError as e:  # the temporary file, its fsync or its rename: the model was not written
        raise TinyModelError(f"{out}: cannot write it: {e}") from None
    return out
