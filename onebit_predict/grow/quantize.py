"""Run the patched tree's ``llama-quantize`` on a grown model and read what it decided.

``llama-quantize`` sits next to libllama in the build build.sh recorded
(``<LLAMA_BUILD_DIR>/bin/llama-quantize``, llama/paths.py). Where a tensor's rows are not a
multiple of the target type's block it falls back to another type and logs one line per
tensor (src/llama-quant.cpp ``tensor_type_fallback``)::

    warning: blk.0.ffn_gate_exps.weight - ncols     64 not divisible by 256 (required for type    q4_K) \
        -> falling back to    q5_0

(one line; cut here).

:func:`fallbacks` reads those lines back, and checks them against the log's own count.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..llama.paths import build_info
from .grow import QUANT_TYPES, GrowError

_FALLBACK = re.compile(
    r"warning:\s+(?P<name>\S+)\s+-\s+ncols\s+(?P<ncols>\d+)\s+not divisible by\s+(?P<block>\d+)\s+"
    r"\(required for type\s+(?P<target>\S+)\)\s*(?:\(WARNING: must use F16 due to unusual shape\)\s*)?"
    r"->\s*falling back to\s+(?P<to>\S+)"
)
_FALLBACK_COUNT = re.compile(r"WARNING: (\d+) of (\d+) tensor\(s\) required fallback quantization")


class QuantizeMissing(GrowError):
    """llama-quantize is not where the build puts it."""


class QuantizeFailed(RuntimeError):
    """llama-quantize ran and failed (its log's tail is in the message)."""


@dataclass(frozen=True)
class Fallback:
    tensor: str
    ncols: int
    block: int
    target: str  # the type llama-quantize wanted (ggml's name, e.g. q4_K)
    to: str  # the type it used


def quantize_binary() -> Path:
    """``<LLAMA_BUILD_DIR>/bin/llama-quantize``; QuantizeMissing (naming the path tried) if absent."""
    path = build_info().build_dir / "bin" / "llama-quantize"
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise QuantizeMissing(
            f"llama-quantize not found at {path} (LLAMA_BUILD_DIR of build/current.env): "
            f"build it with cmake --build {path.parent.parent} --target llama-quantize"
        )
    return path


def fallbacks(log: str) -> list[Fallback]:
    """The fallback lines of a llama-quantize log; ValueError if they disagree with its count."""
    found = [
        Fallback(m["name"], int(m["ncols"]), int(m["block"]), m["target"], m["to"]) for m in _FALLBACK.finditer(log)
    ]
    counted = _FALLBACK_COUNT.search(log)
    if (int(counted.group(1)) if counted else 0) != len(found):
        raise QuantizeFailed(
            f"llama-quantize reported {counted.group(1) if counted else 0} fallbacks, its log lists {len(found)}"
        )
    return found


def summarize(found: list[Fallback]) -> list[str]:
    """One line per (tensor kind, target, fallback): ``blk.{0-7}.ffn_gate_exps.weight q4_K->q5_0 (ncols 64 % 256)``."""
    groups: dict[tuple[str, str, str, int, int], list[int]] = {}
    for f in found:
        m = re.match(r"^blk\.(\d+)\.(.+)$", f.tensor)
        kind, layer = (f"blk.*.{m.group(2)}", int(m.group(1))) if m else (f.tensor, -1)
        groups.setdefault((kind, f.target, f.to, f.ncols, f.block), []).append(layer)
    lines = []
    for (kind, target, to, ncols, block), layers in groups.items():
        where = kind.replace("*", _layers(layers)) if kind.startswith("blk.*") else kind
        lines.append(f"{where} {target}->{to} (ncols {ncols} % {block})")
    return lines


def _layers(layers: list[int]) -> str:
    layers = sorted(set(layers))
    if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{{{layers[0]}-{layers[-1]}}}"
    return "{" + ",".join(map(str, layers)) + "}" if len(layers) > 1 else str(layers[0])


def quantize(src: Path, dst: Path, kind: str, threads: int) -> tuple[list[str], str]:
    """Quantize src to dst at ``kind`` (QUANT_TYPES); return (the command, the log).

    QuantizeFailed when llama-quantize exits non-zero or does not write dst.
    """
    if kind not in QUANT_TYPES:
        raise GrowError(f"llama-quantize makes {', '.join(QUANT_TYPES)}, not {kind!r}")
    cmd = [str(quantize_binary()), str(src), str(dst), QUANT_TYPES[kind], str(threads)]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    if proc.returncode != 0 or not dst.is_file():
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise QuantizeFailed(f"{' '.join(cmd)} exited {proc.returncode}:\n{tail}")
    return cmd, proc.stdout
