"""The quality of each variant against the F16 model on held-out text, as ``llama-perplexity`` measures it.

Held-out text: the first :data:`~.variants.HELDOUT_TOKENS` tokens of the corpus's validation split
(texts.corpus_text), cut into windows of 256 tokens (``-c 256``: the models were trained on
256-token windows). llama-perplexity scores the second half of each window (tokens 128..254
predicting 129..255: 127 per window). Two runs:

1. once per source and text (cached): ``llama-perplexity -m F16 -f HELDOUT -c 256 -b 2048
   --kl-divergence-base BASE``: F16's log-probabilities of every scored token, and its PPL
   (``Final estimate: PPL = ... +/- ...``);
2. per row: ``llama-perplexity -m VARIANT -f HELDOUT -c 256 -b 2048 --kl-divergence-base BASE
   --kl-divergence``, parsed by :func:`parse_kl` from the statistics llama.cpp's
   tools/perplexity/perplexity.cpp prints at the end: ``Mean PPL(Q)``, ``Mean PPL(base)``, ``Mean
   ln(PPL(Q)/PPL(base))``, ``Mean KLD``, ``99.0% KLD``, ``Maximum KLD``, ``Median KLD`` and ``Same
   top p`` (the fraction of scored tokens whose most probable next token is F16's: top-1
   agreement), each with its ``±`` where printed. Parsing is strict: a figure missing or printed
   twice raises :class:`PerplexityOutputError` (llama.cpp prints no statistics below 100 scored
   tokens), never a number from elsewhere. The F16 model itself is a row too: its KLD is ~0 (the
   base stores log-probabilities rounded to 16 bits, so it can print -0.00000) and its top-1
   agreement 100 % but for near-ties: the base's top token is the first of the rounded maxima, so
   two logits within one rounding step can disagree (2 of 32,512 tokens, 99.994 %, on
   models/qwen3moe-h256.gguf's 64 Ki held-out tokens).

A row is (variant, optional compensator): the compensator is the patched build's knob, given to
llama-perplexity as ``ONEBIT_MOE_COMPENSATOR=FILE`` in an environment with no other ``ONEBIT_*``
(or ``LLAMA_ARG_*``) variable inherited (variants.tool_env). A build whose llama-perplexity does not
list ``--moe-compensator`` in its ``--help`` is refused for compensated rows (the variable would
be ignored and the row would measure the plain variant). "Recovers" is ``(KL_2bit - KL_comp) /
KL_2bit * 100``: how much of the variant's mean KLD the compensator takes back; "PPL recovers", the
seed's unit, ``(PPL_2bit - PPL_comp) / (PPL_2bit - PPL_F16) * 100``: how much of the perplexity gap
to F16 it closes (both on the same scored tokens).

Texts: ``val``, the corpus's validation split; ``outside`` (texts.OUTSIDE), llama-cpp-python's
own Python sources, a second held-out text from outside the training corpus.

Results are cached beside the variants (``kl-<key>.json``), keyed by the model's and the
compensator's sha256, the base's and the arguments.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from ..atomic import atomic_path
from ..constants import ENV_COMPENSATOR
from ..grow.grow import sha256_file
from .texts import OUTSIDE, TEXTS, Text, check_corpus, corpus_text
from .variants import (
    BATCH,
    COMPENSATOR_LOADED,
    CTX,
    HELDOUT_TOKENS,
    VARIANTS,
    Int2Error,
    Made,
    Store,
    ToolFailed,
    ToolRun,
    read_manifest,
    recipe_key,
    run_tool,
    tool_binary,
    tool_env,
    write_manifest,
)

logger = logging.getLogger("onebit_predict")
T = TypeVar("T")

SCORED_PER_WINDOW = CTX - 1 - CTX // 2  # llama-perplexity scores tokens first..n_ctx-1 of each window
_NUM = r"([-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|(?i:nan|inf)))"
_PM = r"\s*(?:±|\+/-)\s*"
_PREFIX = r"^(?:[\d.]+ [IWE] )?"  # llama.cpp's log prefix (time, level) on LOG_INF lines
KL_LINES: dict[str, str] = {  # field -> the line that holds it, as perplexity.cpp's kl_divergence prints it
    "chunks": _PREFIX + r"kl_divergence: computing over (\d+) chunks, n_ctx=(\d+),.*",
    "ppl": _PREFIX + r"Mean PPL\(Q\)\s*:\s*" + _NUM + _PM + _NUM,
    "ppl_base": _PREFIX + r"Mean PPL\(base\)\s*:\s*" + _NUM + _PM + _NUM,
    "ln_ppl_ratio": _PREFIX + r"Mean ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s*" + _NUM + _PM + _NUM,
    "kld_mean": _PREFIX + r"Mean\s+KLD:\s*" + _NUM + _PM + _NUM,
    "kld_max": _PREFIX + r"Maximum KLD:\s*" + _NUM,
    "kld_p99": _PREFIX + r"99\.0%\s+KLD:\s*" + _NUM,
    "kld_median": _PREFIX + r"Median\s+KLD:\s*" + _NUM,
    "top1": _PREFIX + r"Same top p:\s*" + _NUM + _PM + _NUM + r"\s*%",
}
BASE_LINES: dict[str, str] = {  # the base run (perplexity() with --kl-divergence-base)
    "chunks": _PREFIX + r"perplexity: calculating perplexity over (\d+) chunks, n_ctx=(\d+),.*",
    "ppl": _PREFIX + r"Final estimate: PPL = " + _NUM + r" \+/- " + _NUM,
}


TRIES = 3  # runs of llama-perplexity before its output is declared short (see LinesMissing)


class PerplexityOutputError(ToolFailed):
    """llama-perplexity's output lacks a figure (or prints it twice): nothing is guessed."""


class LinesMissing(PerplexityOutputError):
    """A figure's line is absent. llama.cpp's logger (common/log.cpp) is never flushed at exit, so
    the last lines of a run that succeeded are sometimes lost (3 runs in 40 here): the run is
    repeated, up to :data:`TRIES` times, before this is raised."""


@dataclass(frozen=True)
class Figure:
    """A figure as llama-perplexity printed it, with its ``±`` (None where it prints none)."""

    value: float
    pm: float | None = None


@dataclass(frozen=True)
class KlFigures:
    """What one ``--kl-divergence`` run printed."""

    chunks: int
    ppl: Figure  # the row's PPL on the scored tokens
    ppl_base: Figure  # F16's, on the same tokens
    ln_ppl_ratio: Figure
    kld_mean: Figure
    kld_p99: Figure
    kld_max: Figure
    kld_median: Figure
    top1: Figure  # per cent of scored tokens whose top-1 token is F16's

    @property
    def scored_tokens(self) -> int:
        return self.chunks * SCORED_PER_WINDOW


def _lines(text: str, patterns: dict[str, str], what: str) -> dict[str, tuple[str, ...]]:
    """Each pattern's groups from the one line that matches it; PerplexityOutputError otherwise."""
    out = {}
    for field, pattern in patterns.items():
        found = re.findall(pattern + r"\s*$", text, flags=re.MULTILINE)
        if len(found) != 1:
            error = LinesMissing if not found else PerplexityOutputError
            why = "no" if not found else f"{len(found)}"
            raise error(f"{what}: {why} lines for {field} (/{pattern}/) in llama-perplexity's output")
        out[field] = found[0] if isinstance(found[0], tuple) else (found[0],)
    return out


def _figure(groups: tuple[str, ...]) -> Figure:
    return Figure(float(groups[0]), float(groups[1]) if len(groups) > 1 else None)


def parse_kl(text: str, what: str = "llama-perplexity --kl-divergence") -> KlFigures:
    """The statistics of a ``--kl-divergence`` run's output (stdout and stderr together)."""
    g = _lines(text, KL_LINES, what)
    chunks, n_ctx = (int(x) for x in g.pop("chunks"))
    if n_ctx != CTX:
        raise PerplexityOutputError(f"{what}: ran with n_ctx={n_ctx}, not {CTX}")
    return KlFigures(chunks, **{k: _figure(v) for k, v in g.items()})


def parse_base(text: str, what: str = "llama-perplexity --kl-divergence-base") -> tuple[int, Figure]:
    """(windows, PPL) of the base run's output."""
    g = _lines(text, BASE_LINES, what)
    chunks, n_ctx = (int(x) for x in g["chunks"])
    if n_ctx != CTX:
        raise PerplexityOutputError(f"{what}: ran with n_ctx={n_ctx}, not {CTX}")
    return chunks, _figure(g["ppl"])


def recovers(kld_plain: float, kld_comp: float) -> float | None:
    """Per cent of the plain variant's mean KLD the compensator takes back (None when it is not > 0)."""
    return (kld_plain - kld_comp) / kld_plain * 100 if kld_plain > 0 else None


def ppl_recovers(ppl_plain: float, ppl_comp: float, ppl_f16: float) -> float | None:
    """The seed's unit: per cent of the plain variant's perplexity gap to F16 the compensator closes,
    ``(PPL_2bit - PPL_comp) / (PPL_2bit - PPL_f16) * 100`` (negative: it made the perplexity worse;
    None where the plain variant has no gap)."""
    gap = ppl_plain - ppl_f16
    return (ppl_plain - ppl_comp) / gap * 100 if gap > 0 else None


def run_parsed(
    cmd: list[Any], what: str, parse: Callable[[str, str], T], out: Path | None = None, env: dict | None = None
) -> tuple[ToolRun, T]:
    """Run llama-perplexity and parse its output; a run whose lines went missing is run again (LinesMissing)."""
    for attempt in range(1, TRIES + 1):
        run = run_tool(cmd, what, out, env)
        try:
            return run, parse(run.log, what)
        except LinesMissing as e:
            if attempt == TRIES:
                raise
            logger.warning("%s: its output lost lines (%s): running it again", what, str(e).split(" (/")[0])
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=4)
def knows_compensator(binary: Path) -> bool:
    """Whether the tool lists ``--moe-compensator`` in its ``--help``."""
    proc = subprocess.run([str(binary), "--help"], capture_output=True, env=tool_env())
    return b"--moe-compensator" in proc.stdout + proc.stderr


@dataclass(frozen=True)
class Row:
    """One row of the quality table: a variant, with a compensator or not."""

    variant: str
    compensator: Path | None
    model: Path
    model_sha256: str
    compensator_sha256: str | None
    expert_type: str
    expert_bytes_per_token: int
    figures: KlFigures
    command: str
    seconds: float
    cached: bool
    recovers_pct: float | None = None  # compensated rows: against the same variant without one
    ppl_recovers_pct: float | None = None  # compensated rows: the seed's unit (ppl_recovers)

    def to_dict(self) -> dict[str, Any]:
        f = self.figures
        out: dict[str, Any] = {
            "variant": self.variant,
            "compensator": str(self.compensator) if self.compensator else None,
            "compensator_sha256": self.compensator_sha256,
            "model": str(self.model),
            "model_sha256": self.model_sha256,
            "expert_type": self.expert_type,
            "expert_bytes_per_token": self.expert_bytes_per_token,
            "chunks": f.chunks,
            "scored_tokens": f.scored_tokens,
        }
        for name in ("kld_mean", "kld_p99", "kld_max", "kld_median", "top1", "ppl", "ppl_base", "ln_ppl_ratio"):
            fig = getattr(f, name)
            key = "top1_pct" if name == "top1" else name
            out[key] = fig.value
            if fig.pm is not None:
                out[f"{key}_pm"] = fig.pm
        out.update(recovers_pct=self.recovers_pct, ppl_recovers_pct=self.ppl_recovers_pct)
        out.update(command=self.command, seconds=self.seconds, cached=self.cached)
        return out


class Quality:
    """The quality runs of one source's variants on one held-out text."""

    def __init__(self, store: Store, heldout_tokens: int = HELDOUT_TOKENS, text: str = "val") -> None:
        if heldout_tokens < 2 * CTX:
            raise Int2Error(f"the held-out text needs at least {2 * CTX} tokens (two windows), not {heldout_tokens}")
        if text not in TEXTS:
            raise Int2Error(f"text {text!r} is not one of {', '.join(TEXTS)}")
        self.store = store
        self.text: Text = corpus_text(text, heldout_tokens, store.root)
        if text != OUTSIDE:
            check_corpus(store.source, self.text)
        self.args = ["-c", str(CTX), "-b", str(BATCH)]

    def base(self, force: bool = False) -> Made:
        """F16's log-probabilities on the held-out text (``--kl-divergence-base``), made once."""
        s = self.store
        recipe = {"what": "kl-base", "source_sha256": s.sha256, "text_sha256": self.text.sha256, "args": self.args}
        path, mpath = s.dir / f"kl-base-{recipe_key(recipe)}.bin", s.dir / f"kl-base-{recipe_key(recipe)}.json"
        if not force and (m := read_manifest(path, mpath, recipe)) is not None:
            return Made(path, m, True)
        s.dir.mkdir(parents=True, exist_ok=True)
        logger.info("llama-perplexity --kl-divergence-base on %s: %s", s.source.name, self.text.description)
        with atomic_path(path) as tmp:
            cmd = [tool_binary("llama-perplexity"), "-m", s.source, "-f", self.text.path, *self.args]
            cmd += ["--kl-divergence-base", tmp, "-t", str(s.threads)]
            run, (chunks, ppl) = run_parsed(cmd, "llama-perplexity (base)", parse_base, tmp)
            extra = {"text": self.text.summary(), "chunks": chunks, "ppl": asdict(ppl)}
            manifest = s.manifest_for(recipe, path, tmp, run, extra)
        write_manifest(mpath, manifest)
        return Made(path, manifest, False)

    def row(self, variant: str, compensator: Path | None = None, force: bool = False) -> Row:
        """The KL run of ``variant`` (with ``compensator``) against the base; cached."""
        s = self.store
        made = s.variant(variant)
        binary = tool_binary("llama-perplexity")
        env: dict[str, str] = {}
        comp_sha = None
        if compensator is not None:
            if not compensator.is_file():
                raise Int2Error(f"{compensator}: no such file")
            if not knows_compensator(binary):
                raise Int2Error(f"{binary} has no --moe-compensator: this build cannot run a compensated row")
            env[ENV_COMPENSATOR] = str(compensator.resolve())
            comp_sha = sha256_file(compensator)
        base = self.base()
        recipe = {
            "what": "kl",
            "model_sha256": made.manifest["sha256"],
            "compensator_sha256": comp_sha,
            "base_sha256": base.manifest["sha256"],
            "args": self.args,
        }
        path = s.dir / f"kl-{recipe_key(recipe)}.json"
        cached = None if force else _cached_result(path, recipe)
        if cached is None:
            cmd = [binary, "-m", made.path, "-f", self.text.path, *self.args, "--kl-divergence-base", base.path]
            what = f"llama-perplexity --kl-divergence {variant}" + (f" + {compensator.name}" if compensator else "")
            logger.info("%s", what)
            run, figures = run_parsed([*cmd, "--kl-divergence", "-t", str(s.threads)], what, parse_kl, env=env)
            if compensator is not None and COMPENSATOR_LOADED + env[ENV_COMPENSATOR] not in run.log:
                raise ToolFailed(f"{what}: ran without logging {COMPENSATOR_LOADED}{env[ENV_COMPENSATOR]}': not loaded")
            env_text = " ".join(f"{k}={v}" for k, v in env.items())
            result = {
                "recipe": recipe,
                "figures": asdict(figures),
                "command": f"{env_text} {run.command}".strip(),
                "seconds": round(run.seconds, 2),
                "log_tail": run.tail(),
            }
            write_manifest(path, result)
        else:
            result = cached
        return Row(
            variant,
            compensator,
            made.path,
            made.manifest["sha256"],
            comp_sha,
            made.manifest["expert_type"],
            made.manifest["expert_bytes_per_token"],
            _figures(result["figures"]),
            result["command"],
            result["seconds"],
            cached is not None,
        )

    def rows(self, variants: list[str], compensators: list[tuple[str, Path]]) -> list[Row]:
        """F16 first, the variants in VARIANTS order, then each (variant, compensator) with its "recovers"
        in both units (of the KL, and of the perplexity gap to F16: the seed's)."""
        names = [n for n in VARIANTS if n == "f16" or n in variants or n in {v for v, _ in compensators}]
        plain = {n: self.row(n) for n in names}
        out = list(plain.values())
        ppl_f16 = plain["f16"].figures.ppl.value
        for name, comp in compensators:
            row = self.row(name, comp)
            p, c = plain[name].figures, row.figures
            gain = recovers(p.kld_mean.value, c.kld_mean.value)
            ppl_gain = ppl_recovers(p.ppl.value, c.ppl.value, ppl_f16)
            out.append(replace(row, recovers_pct=gain, ppl_recovers_pct=ppl_gain))
        return out

    def labels(self) -> dict[str, Any]:
        """What every figure is of: the model and the text."""
        base = self.base()
        return {
            "model": str(self.store.source),
            "model_sha256": self.store.sha256,
            "text": self.text.summary(),
            "ctx": CTX,
            "scored_per_window": SCORED_PER_WINDOW,
            "base": {"path": str(base.path), "command": base.manifest["command"], "ppl": base.manifest["ppl"]},
        }


def _cached_result(path: Path, recipe: dict[str, Any]) -> dict[str, Any] | None:
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return result if result.get("recipe") == json.loads(json.dumps(recipe)) else None


def _figures(d: dict[str, Any]) -> KlFigures:
    return KlFigures(d["chunks"], **{k: Figure(**v) for k, v in d.items() if k != "chunks"})
