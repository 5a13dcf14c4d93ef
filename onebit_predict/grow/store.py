"""The cache of grown models: ``$ONEBIT_CACHE/grown/<source sha256>/w<WIDTH>-<TYPE>.gguf``.

Each output is keyed by the source model's sha256, the width and the type, and has a
manifest next to it (``w<WIDTH>-<TYPE>.json``, sorted keys, no timestamps): its sha256 and
size, the bytes per expert it stores (measured from the file, and as predicted by
grow/grow.py, which must agree), its expert tensors' types, and for the quantized types
the llama-quantize command and the fallbacks it chose (its log is kept beside it as
``.quantize.log``). F32 and F16 are written by grow/grow.py; Q8_0 and Q4_K_M are made by
``llama-quantize`` from the F32 one. Files are written under a temporary name and renamed,
so a cache entry is whole or absent. A cached entry is used when its file still has the
manifest's size and sha256; otherwise it is made again.

Nothing here writes into the repository: a cache root inside the checkout is refused.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..atomic import atomic_path, atomic_write_text
from ..constants import CACHE_DIR_DEFAULT, ENV_CACHE
from ..llama.paths import REPO_ROOT
from .gguf_keys import check_gguf_whole
from .grow import (
    MIB,
    QUANT_TYPES,
    TYPES,
    WRITE_TYPES,
    GrowError,
    expert_bytes,
    expert_types,
    grow,
    measured_expert_bytes,
    model_info,
    sha256_file,
)
from .quantize import fallbacks, quantize, summarize

logger = logging.getLogger("onebit_predict")
MANIFEST_VERSION = 1


def default_root() -> Path:
    """``$ONEBIT_CACHE/grown`` (default ``~/.cache/onebit-predict/grown``)."""
    return Path(os.environ.get(ENV_CACHE) or Path.home() / CACHE_DIR_DEFAULT) / "grown"


def inside(path: Path, parent: Path) -> bool:
    """Whether ``path`` resolves to ``parent`` or below it (a cache must never be inside the checkout)."""
    try:
        path.resolve().relative_to(parent.resolve())
        return True
    except ValueError:
        return False


@dataclass(frozen=True)
class _Made:
    path: Path
    extra: dict[str, Any]  # the manifest's fields only the making knows
    log: str = ""  # llama-quantize's output


@dataclass(frozen=True)
class Output:
    path: Path
    manifest: dict[str, Any]
    cached: bool  # found in the cache (not made by this call)


class Store:
    """Grown models of one source, made on demand and cached."""

    def __init__(self, source: Path, root: Path | None = None, threads: int = 2) -> None:
        self.root = Path(root) if root else default_root()
        if inside(self.root, REPO_ROOT):
            raise GrowError(f"{self.root} is inside the repository ({REPO_ROOT}): grown models are never written there")
        self.source = Path(source)
        self.info = model_info(self.source)
        self.source_sha256 = sha256_file(self.source)
        self.dir = self.root / self.source_sha256
        self.threads = threads

    def path(self, width: int, kind: str) -> Path:
        return self.dir / f"w{width}-{kind}.gguf"

    def manifest_path(self, width: int, kind: str) -> Path:
        return self.dir / f"w{width}-{kind}.json"

    def _cached(self, width: int, kind: str) -> dict[str, Any] | None:
        path, mpath = self.path(width, kind), self.manifest_path(width, kind)
        if not (path.is_file() and mpath.is_file()):
            return None
        try:
            manifest = json.loads(mpath.read_text())
        except (OSError, ValueError):
            return None
        if manifest.get("version") != MANIFEST_VERSION or path.stat().st_size != manifest.get("bytes"):
            return None
        if sha256_file(path) != manifest.get("sha256"):
            logger.warning("%s: differs from its manifest's sha256: making it again", path)
            return None
        return manifest

    def get(self, width: int, kind: str, force: bool = False) -> Output:
        """The grown model at ``width`` in ``kind`` (TYPES): from the cache, or made now."""
        if kind not in TYPES:
            raise GrowError(f"unknown type {kind!r} (known: {', '.join(TYPES)})")
        if not force and (manifest := self._cached(width, kind)) is not None:
            return Output(self.path(width, kind), manifest, True)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.path(width, kind)
        with atomic_path(path) as tmp:
            made = self._make(width, kind, tmp)
            check_gguf_whole(tmp, OSError, path)  # llama-quantize does not check its writes
            manifest = self._manifest(width, kind, tmp, made.extra)
        if made.log:
            atomic_write_text(path.with_suffix(".quantize.log"), made.log)
        atomic_write_text(self.manifest_path(width, kind), json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        return Output(path, manifest, False)

    def _make(self, width: int, kind: str, tmp: Path) -> _Made:
        """Write the model to ``tmp``."""
        try:
            if kind in WRITE_TYPES:
                logger.info("growing %s to width %d (%s)", self.source.name, width, kind)
                grow(self.source, tmp, width, kind)
                return _Made(tmp, {"made_by": "onebit_predict.grow.grow"})
            src = self.get(width, "f32", force=False)  # the canonical input: the values exactly
            logger.info("quantizing %s to %s", src.path.name, QUANT_TYPES[kind])
            cmd, log = quantize(src.path, tmp, kind, self.threads)
            found = fallbacks(log)
            return _Made(
                tmp,
                {
                    "made_by": "llama-quantize",
                    "input": src.path.name,
                    "input_sha256": src.manifest["sha256"],
                    "quantize_args": [Path(cmd[0]).name, src.path.name, self.path(width, kind).name, *cmd[3:]],
                    "llama_quantize": cmd[0],
                    "fallbacks": [f.__dict__ for f in found],
                    "fallback_summary": summarize(found),
                },
                log,
            )
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def _manifest(self, width: int, kind: str, path: Path, extra: dict[str, Any]) -> dict[str, Any]:
        measured = measured_expert_bytes(path)
        predicted = expert_bytes(self.info, width, kind)
        return {
            "version": MANIFEST_VERSION,
            "tool": f"onebit-predict {__version__}",
            "source": self.source.name,
            "source_sha256": self.source_sha256,
            "arch": self.info.arch,
            "n_embd": self.info.n_embd,
            "n_expert": self.info.n_expert,
            "n_ff_source": self.info.n_ff,
            "width": width,
            "type": kind,
            "file": self.path(width, kind).name,
            "bytes": path.stat().st_size,
            "sha256": sha256_file(path),
            "expert_bytes": {str(k): v for k, v in measured.items()},
            "expert_bytes_mean_mib": sum(measured.values()) / len(measured) / MIB,
            "expert_bytes_predicted_match": predicted == measured,
            "expert_types": expert_types(path),
            **extra,
        }

    def check_determinism(self, width: int, kind: str) -> tuple[bool, str]:
        """Make the output again beside the cached one; (same sha256, the new sha256). The copy is removed."""
        cached = self.get(width, kind)
        tmp = self.path(width, kind).with_name(f".{self.path(width, kind).name}.{os.getpid()}.again.tmp")
        made = self._make(width, kind, tmp)
        try:
            again = sha256_file(made.path)
        finally:
            made.path.unlink(missing_ok=True)
        return again == cached.manifest["sha256"], again
