"""The variants of a trained MoE whose routed experts are stored in fewer bits, made with llama.cpp's tools.

A variant changes the type of the ROUTED EXPERT tensors only (``blk.N.ffn_{gate,up,down}_exps.weight``);
the router (``ffn_gate_inp``), attention, norms, embeddings and output stay exactly as in the
source, byte for byte (:func:`check_variant` reads both files with gguf-py and raises
:class:`VariantMismatch` otherwise). The variants (:data:`VARIANTS`, names fixed: docs and other
code use them):

=========  ==============  =====================================================================
name       expert type     note
=========  ==============  =====================================================================
f16        (the source)    the F16 model itself, no copy
q8_0       q8_0
q4_k_m     q4_K            "Q4_K_M experts" = q4_K on the expert tensors (the mix's ffn_down
                           q6_K layers are not applied: every expert tensor is q4_K)
q2_k       q2_K            imatrix
iq2_xxs    iq2_xxs         imatrix (required by llama-quantize)
iq2_xs     iq2_xs          imatrix (required)
iq2_s      iq2_s           imatrix (required)
tq2_0      tq2_0           ternary (made for ternary-trained weights); its quantizer takes no
                           imatrix. llama-quantize accepts it for 256-wide rows
=========  ==============  =====================================================================

Every type whose quantizer uses an importance matrix gets the same one (:meth:`Store.imatrix`:
``llama-imatrix -c 256`` on TRAINING text only, once per source model; q8_0's and tq2_0's
quantizers take none). The command (:meth:`Store.variant`)::

    llama-quantize [--imatrix IMATRIX] --tensor-type '^blk\\.\\d+\\.ffn_(gate|up|down)_exps\\.weight$=TYPE' \\
        --tensor-type '^blk\\.0\\.ffn_gate_inp\\.weight$=f32' ... --tensor-type '.*=f16' SRC DST FTYPE THREADS

The patterns after the first hold every other tensor to its own type (:func:`keep_patterns`: one per
tensor not of the commonest type, then ``.*=`` that type; the first pattern that matches wins).
llama-quantize applies ``--tensor-type`` only when the file type is a quantized one
(src/llama-quant.cpp ``llama_tensor_get_type``), so the file type is the experts' and the
patterns keep the rest at the source's type, which it then copies unchanged. Tensors it never
quantizes (norms, the router) keep their type whatever the patterns say. A type whose blocks do
not divide the rows (256 = QK_K for the K-, IQ2- and TQ2-types, 32 for q8_0:
models/qwen3moe-tiny.gguf's 64-wide experts take q8_0 only) would make llama-quantize fall back
to another type: :meth:`Store.check_rows` refuses such a type before any tool runs (Int2Error,
naming the tensor and its row length), and :func:`check_variant` still refuses a fallback.

The texts (the imatrix's training text, the held-out ones) are texts.py's.

Cache: ``$ONEBIT_CACHE/int2/<source sha256[:16]>/``, each output named by its recipe's key
(:func:`recipe_key`) with a JSON manifest beside it (the recipe, the exact command, the log's
tail, sha256 and size, expert types, expert bytes per token). A cached output is used only when
its manifest's recipe equals the one asked for and the file still has the manifest's size and
sha256; outputs are written under a temporary name and renamed (atomic.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shlex
import subprocess
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..atomic import atomic_path, atomic_write_text
from ..constants import CACHE_DIR_DEFAULT, ENV_CACHE
from ..gguf_experts import ExpertTensor, ModelError, read_experts
from ..grow.gguf_keys import check_gguf_whole
from ..grow.grow import sha256_file
from ..grow.store import inside
from ..llama.paths import REPO_ROOT, NotBuiltError, build_info
from .texts import check_corpus, corpus_text

logger = logging.getLogger("onebit_predict")

# --- constants ------------------------------------------------------------------------------------

MANIFEST_VERSION = 1
CTX = 256  # the models were trained on 256-token windows: llama-imatrix and llama-perplexity use -c 256
BATCH = 2048  # -b of llama-imatrix and llama-perplexity: 8 windows of CTX per batch
TRAIN_TOKENS = 256 * 1024  # the imatrix's training text
HELDOUT_TOKENS = 64 * 1024  # quality.py's and agreement.py's held-out text
EXPERT_PATTERN = r"^blk\.\d+\.ffn_(gate|up|down)_exps\.weight$"  # the tensors a variant changes
_EXPERT = re.compile(EXPERT_PATTERN)
COMPENSATOR_LOADED = "onebit: compensator '"  # the line libllama logs when it loaded a compensator
SCRUBBED_ENV_PREFIXES = ("ONEBIT_", "LLAMA_ARG_")  # never inherited by the tools: knobs and argument defaults
LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class Variant:
    """One variant: its expert tensors' ggml type and llama-quantize's file type (None: the source)."""

    name: str
    expert_type: str | None  # ggml's name (q4_K, iq2_xxs, ...)
    ftype: str | None  # llama-quantize's file type argument
    imatrix: bool  # made with the importance matrix (its quantizer uses one)
    bits: str  # bits per weight of the expert type, as llama-quantize lists it

    @property
    def gguf_type(self) -> str:
        """The expert type as gguf-py names it (Q4_K, IQ2_XXS, ...)."""
        return (self.expert_type or "F16").upper()


VARIANTS: dict[str, Variant] = {
    v.name: v
    for v in (
        Variant("f16", None, None, False, "16"),
        Variant("q8_0", "q8_0", "Q8_0", False, "8.5"),
        Variant("q4_k_m", "q4_K", "Q4_K_M", True, "4.5"),
        Variant("q2_k", "q2_K", "Q2_K", True, "2.625"),
        Variant("iq2_xxs", "iq2_xxs", "IQ2_XXS", True, "2.0625"),
        Variant("iq2_xs", "iq2_xs", "IQ2_XS", True, "2.3125"),
        Variant("iq2_s", "iq2_s", "IQ2_S", True, "2.5625"),
        Variant("tq2_0", "tq2_0", "TQ2_0", False, "2.0625"),
    )
}
TWO_BIT = ("q2_k", "iq2_xxs", "iq2_xs", "iq2_s", "tq2_0")
DEFAULT_VARIANTS = tuple(VARIANTS)  # tq2_0 included: llama-quantize accepts it for 256-wide expert rows


class Int2Error(ValueError):
    """The input cannot be made into variants (no such model, unknown variant, a source this cannot read)."""


class ToolMissing(Int2Error):
    """A llama.cpp tool is not where the build puts it."""


class ToolFailed(RuntimeError):
    """A llama.cpp tool ran and failed, or wrote nothing (its log's tail in the message)."""


class VariantMismatch(RuntimeError):
    """A made variant is not what its recipe says: a non-expert tensor changed, or an expert type fell back."""


# --- running the tools ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ToolRun:
    cmd: list[str]
    log: str
    seconds: float

    @property
    def command(self) -> str:
        return shlex.join(self.cmd)

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log.splitlines()[-lines:])


def tool_binary(name: str) -> Path:
    """``<LLAMA_BUILD_DIR>/bin/NAME``; ToolMissing (naming the path tried) if it is not there."""
    try:
        path = build_info().build_dir / "bin" / name
    except NotBuiltError as e:
        raise ToolMissing(str(e)) from None
    if not (path.is_file() and os.access(path, os.X_OK)):
        how = f"cmake --build {path.parent.parent} --target {name}"
        raise ToolMissing(f"{name} not found at {path}: build it with {how}")
    return path


def tool_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without any ``ONEBIT_*`` or ``LLAMA_ARG_*`` variable, plus ``extra``:
    a tool run reads only the knobs it is given."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED_ENV_PREFIXES)}
    env.update(extra or {})
    return env


def run_tool(cmd: Sequence[str], what: str, out: Path | None = None, env: Mapping[str, str] | None = None) -> ToolRun:
    """Run a tool with :func:`tool_env` (``env`` added), stdout and stderr together; ToolFailed if it
    exits non-zero or does not write ``out``."""
    cmd = [str(c) for c in cmd]
    start = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=tool_env(env))
    run = ToolRun(cmd, proc.stdout.decode("utf-8", "replace"), time.monotonic() - start)
    if proc.returncode != 0 or (out is not None and not (out.is_file() and out.stat().st_size > 0)):
        why = f"exited {proc.returncode}" if proc.returncode else f"wrote no {out}"
        raise ToolFailed(f"{what}: {run.command} {why}:\n{run.tail(15)}")
    return run


# --- the cache ---------------------------------------------------------------------------------------


def default_root() -> Path:
    """``$ONEBIT_CACHE/int2`` (default ``~/.cache/onebit-predict/int2``)."""
    return Path(os.environ.get(ENV_CACHE) or Path.home() / CACHE_DIR_DEFAULT) / "int2"


def recipe_key(recipe: Mapping[str, Any]) -> str:
    """12 hex digits of the sha256 of the recipe as canonical JSON (sorted keys): the same recipe,
    whatever its keys' order, has the same key; any change of a value changes it."""
    text = json.dumps(recipe, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def read_manifest(path: Path, manifest_path: Path, recipe: Mapping[str, Any]) -> dict[str, Any] | None:
    """The manifest of a cached output, when its recipe is ``recipe`` and the file is still its file."""
    if not (path.is_file() and manifest_path.is_file()):
        return None
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        return None
    if manifest.get("version") != MANIFEST_VERSION or manifest.get("recipe") != json.loads(json.dumps(recipe)):
        return None
    if path.stat().st_size != manifest.get("bytes") or sha256_file(path) != manifest.get("sha256"):
        logger.warning("%s: differs from its manifest: making it again", path)
        return None
    return manifest


def write_manifest(path: Path, manifest: Mapping[str, Any]) -> None:
    atomic_write_text(path, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


@dataclass(frozen=True)
class Made:
    """A cached output: its file, its manifest, whether it was found in the cache."""

    path: Path
    manifest: dict[str, Any]
    cached: bool


# --- the variants ---------------------------------------------------------------------------------


def _reader(path: Path) -> Any:
    import gguf  # a dependency of the package; imported here to keep `import onebit_predict` light

    try:
        return gguf.GGUFReader(path)
    except (OSError, ValueError, KeyError) as e:
        raise Int2Error(f"{path}: cannot read it as a GGUF: {e}") from None


def is_expert(name: str) -> bool:
    return _EXPERT.match(name) is not None


def block_size(variant: Variant) -> int:
    """The values per block of the variant's expert type (gguf-py's GGML_QUANT_SIZES: 256 = QK_K for
    the K-, IQ2- and TQ2-types, 32 for q8_0, 1 for F16): a row must be a whole number of them."""
    import gguf

    return int(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[variant.gguf_type]][0])


def keep_patterns(reader: Any) -> list[str]:
    """The ``--tensor-type`` patterns that hold every non-expert 2-D (or more) tensor to its own type:
    one per tensor not of the commonest type (the F32 routers of an F16 model), then ``.*=`` that type
    (llama-quantize takes the first pattern that matches)."""
    others = [t for t in reader.tensors if not is_expert(t.name) and len(t.shape) >= 2]
    if not others:
        return []
    names = [t.tensor_type.name.lower() for t in others]
    common = max(sorted(set(names)), key=names.count)
    odd = [f"^{re.escape(t.name)}$={n}" for t, n in zip(others, names) if n != common]
    return [*odd, f".*={common}"]


def expert_used(reader: Any, path: Path) -> int:
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields.get(f"{arch}.expert_used_count")
    if field is None:
        raise Int2Error(f"{path}: has no {arch}.expert_used_count")
    return int(field.contents())


def expert_bytes_per_token(path: Path) -> dict[str, Any]:
    """What one token reads of the routed experts: n_expert_used experts' three matrices in every MoE
    layer, from the tensors' byte sizes as the file stores them."""
    reader = _reader(path)
    try:
        per_layer = read_experts(path, reader).expert_bytes()
    except ModelError as e:
        raise Int2Error(str(e)) from None
    n_used = expert_used(reader, path)
    return {
        "n_expert_used": n_used,
        "expert_bytes_per_layer": {str(k): v for k, v in per_layer.items()},
        "expert_bytes_per_token": n_used * sum(per_layer.values()),
    }


def check_variant(source: Path, made: Path, variant: Variant, name: str | None = None) -> dict[str, list[str]]:
    """VariantMismatch unless ``made`` has the source's tensors, every non-expert one with the source's
    type, shape and bytes, and every routed expert tensor in ``variant``'s type. Returns the expert
    types per role. ``name``: what the messages call ``made`` (its final name)."""
    a, b = _reader(source), _reader(made)
    shown = name or made.name
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    if set(ta) != set(tb):
        raise VariantMismatch(f"{shown}: tensors differ from {source.name}: {sorted(set(ta) ^ set(tb))[:4]}")
    types: dict[str, list[str]] = {}
    for tname, x in ta.items():
        y = tb[tname]
        if list(x.shape) != list(y.shape):
            raise VariantMismatch(f"{shown}: {tname} has shape {list(y.shape)}, the source {list(x.shape)}")
        if is_expert(tname):
            if y.tensor_type.name != variant.gguf_type:
                raise VariantMismatch(
                    f"{shown}: {tname} is {y.tensor_type.name}, not {variant.gguf_type} "
                    f"(llama-quantize fell back: rows of {int(x.shape[0])} are not whole blocks of the type?)"
                )
            types.setdefault(tname.split(".")[2], []).append(y.tensor_type.name)
            continue
        if y.tensor_type != x.tensor_type:
            raise VariantMismatch(f"{shown}: {tname} is {y.tensor_type.name}, the source {x.tensor_type.name}")
        if bytes(a.data[x.data_offset : x.data_offset + x.n_bytes]) != bytes(
            b.data[y.data_offset : y.data_offset + y.n_bytes]
        ):
            raise VariantMismatch(f"{shown}: {tname} differs from the source's bytes")
    return types


class Store:
    """The variants of one source model, made on demand and cached under ``<root>/<sha256[:16]>/``."""

    def __init__(self, source: Path, root: Path | None = None, threads: int = 1, train_tokens: int = TRAIN_TOKENS):
        self.root = Path(root) if root else default_root()
        if inside(self.root, REPO_ROOT):
            raise Int2Error(f"{self.root} is inside the repository ({REPO_ROOT}): variants are never written there")
        self.source = Path(source).resolve()
        if not self.source.is_file():
            raise Int2Error(f"{self.source}: no such file")
        reader = _reader(self.source)
        try:
            experts = read_experts(self.source, reader)
        except ModelError as e:
            raise Int2Error(str(e)) from None
        bad = sorted({t.type_name for t in experts.tensors} - {"F16", "F32", "BF16"})
        if bad:
            raise Int2Error(f"{self.source}: expert tensors are {bad}: variants are made from F16/BF16/F32 experts")
        self.experts = experts
        self.keep = keep_patterns(reader)
        self.sha256 = sha256_file(self.source)
        self.dir = self.root / self.sha256[:16]
        self.threads = threads
        self.train_tokens = train_tokens

    def check_rows(self, names: Sequence[str]) -> None:
        """Int2Error, before anything is made, unless every variant of ``names`` has blocks that divide
        the rows (ne0) of every routed expert tensor it changes: llama-quantize would fall back to
        another type, after the imatrix, and :func:`check_variant` would refuse the result."""

        def misfit(v: Variant) -> ExpertTensor | None:
            return next((t for t in self.experts.tensors if is_expert(t.name) and t.shape[0] % block_size(v)), None)

        for name in dict.fromkeys(names):
            if name not in VARIANTS:
                raise Int2Error(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})")
            v = VARIANTS[name]
            bad = misfit(v)
            if bad is None:
                continue
            qk = block_size(v)
            fit = [n for n, w in VARIANTS.items() if misfit(w) is None]
            raise Int2Error(
                f"{self.source}: {bad.name} has rows of {bad.shape[0]} values, not a multiple of {qk}: "
                f"variant {name} ({v.gguf_type}) stores whole blocks of {qk} per row"
                + (" (QK_K)" if qk == 256 else "")
                + f"; these rows take {', '.join(fit)}"
            )

    def _paths(self, stem: str, suffix: str) -> tuple[Path, Path]:
        return self.dir / f"{stem}{suffix}", self.dir / f"{stem}.json"

    def imatrix(self, force: bool = False) -> Made:
        """The importance matrix of the source on the training text (made once; cached)."""
        text = corpus_text("train", self.train_tokens, self.root)
        check_corpus(self.source, text)
        args = ["-c", str(CTX), "-b", str(BATCH)]
        recipe = {"what": "imatrix", "source_sha256": self.sha256, "text_sha256": text.sha256, "args": args}
        path, mpath = self._paths(f"imatrix-{recipe_key(recipe)}", ".gguf")
        if not force and (m := read_manifest(path, mpath, recipe)) is not None:
            return Made(path, m, True)
        self.dir.mkdir(parents=True, exist_ok=True)
        logger.info("llama-imatrix on %s: %s", self.source.name, text.description)
        with atomic_path(path) as tmp:
            cmd = [tool_binary("llama-imatrix"), "-m", self.source, "-f", text.path, "-o", tmp, *args]
            run = run_tool([*cmd, "-t", str(self.threads)], "llama-imatrix", tmp)
            # experts the text never routed to: llama-quantize weighs their columns uniformly
            partial = {n: float(p) for n, p in re.findall(r"entry '\s*(\S+)' has partial data \(([\d.]+)%\)", run.log)}
            manifest = self.manifest_for(recipe, path, tmp, run, {"text": text.summary(), "partial_pct": partial})
        write_manifest(mpath, manifest)
        return Made(path, manifest, False)

    def variant(self, name: str, force: bool = False) -> Made:
        """The variant ``name`` (VARIANTS): the source itself for f16, else from the cache or made now."""
        if name not in VARIANTS:
            raise Int2Error(f"unknown variant {name!r} (known: {', '.join(VARIANTS)})")
        v = VARIANTS[name]
        self.check_rows([name])  # before the imatrix: a type llama-quantize would fall back from
        if v.expert_type is None:
            info = {"variant": name, "expert_type": "F16", "bytes": self.source.stat().st_size, "sha256": self.sha256}
            return Made(self.source, {**info, **expert_bytes_per_token(self.source)}, True)
        imatrix = self.imatrix() if v.imatrix else None
        patterns = [f"{EXPERT_PATTERN}={v.expert_type}", *self.keep]
        recipe = {
            "what": "variant",
            "variant": name,
            "source_sha256": self.sha256,
            "ftype": v.ftype,
            "tensor_type": patterns,
            "imatrix_sha256": imatrix.manifest["sha256"] if imatrix else None,
        }
        path, mpath = self._paths(f"{name}-{recipe_key(recipe)}", ".gguf")
        if not force and (m := read_manifest(path, mpath, recipe)) is not None:
            return Made(path, m, True)
        self.dir.mkdir(parents=True, exist_ok=True)
        logger.info("llama-quantize %s: experts %s", self.source.name, v.expert_type)
        with atomic_path(path) as tmp:
            cmd: list[Any] = [tool_binary("llama-quantize")]
            cmd += ["--imatrix", imatrix.path] if imatrix else []
            for p in patterns:
                cmd += ["--tensor-type", p]
            run = run_tool([*cmd, self.source, tmp, v.ftype, str(self.threads)], f"llama-quantize {v.ftype}", tmp)
            check_gguf_whole(tmp, ToolFailed, path)
            types = check_variant(self.source, tmp, v, path.name)
            extra = {"variant": name, "expert_type": v.gguf_type, "expert_types": types, **expert_bytes_per_token(tmp)}
            extra["imatrix"] = str(imatrix.path) if imatrix else None
            manifest = self.manifest_for(recipe, path, tmp, run, extra)
        write_manifest(mpath, manifest)
        return Made(path, manifest, False)

    def manifest_for(
        self, recipe: dict[str, Any], path: Path, tmp: Path, run: ToolRun, extra: dict[str, Any]
    ) -> dict[str, Any]:
        """The manifest of an output made at ``tmp`` (to be renamed to ``path``): the command as run, with
        the temporary name replaced by the final one."""
        cmd = [str(path) if c == str(tmp) else c for c in run.cmd]
        return {
            "version": MANIFEST_VERSION,
            "tool": f"onebit-predict {__version__}",
            "source": str(self.source),
            "source_sha256": self.sha256,
            "recipe": recipe,
            "recipe_key": recipe_key(recipe),
            "file": path.name,
            "bytes": tmp.stat().st_size,
            "sha256": sha256_file(tmp),
            "command": shlex.join(cmd),
            "seconds": round(run.seconds, 2),
            "threads": self.threads,
            "log_tail": run.tail().replace(str(tmp), str(path)),
            **extra,
        }
