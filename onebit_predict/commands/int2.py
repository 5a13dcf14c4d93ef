"""``onebit-int2 variants|quality|agreement MODEL``: 2-bit routed experts with llama.cpp's own types (int2/).

- ``variants MODEL [--types LIST]``: make (or find in the cache) the variants whose routed expert
  tensors are stored in each type, everything else byte-identical to MODEL (int2/variants.py);
  a table: variant, expert type, file MiB, expert bytes per token, sha256;
- ``quality MODEL [--types LIST] [--compensator VARIANT=FILE ...]``: each variant against the F16
  model on held-out text with llama-perplexity (int2/quality.py): mean and 99th-percentile KL
  divergence (mean, 99th percentile, maximum), top-1 agreement, PPL, expert bytes per token, and for
  a compensated row the share of the variant's KLD it recovers and of its perplexity gap to F16 (the
  seed's unit); ``--text outside`` scores llama-cpp-python's own sources, a held-out text from
  outside the training corpus, instead of the validation split;
- ``agreement MODEL [--types LIST] [--compensator VARIANT=FILE ...] [--text val|outside]``: per
  layer, the share of held-out tokens routed to F16's expert set; and where greedy generation first
  departs from F16's (int2/agreement.py);
- ``blame MODEL [--types LIST] [--compensator VARIANT=FILE ...]``: where each row's KL against F16
  lives (int2/blame.py): per layer, the KL removed by putting F16's MoE output in that layer (through
  the capture), the share of tokens whose routing flipped there and the KL of flipped against kept
  tokens, and the residual energy on held-out against training text;
- ``per-expert MODEL --types VARIANT [--ranks LIST] [--source input|output] [--compensator
  VARIANT=FILE] [--text val|outside]``: a low-rank map per routed expert, gated by its router
  weight, fitted and scored in numpy, end to end through the capture's hook, beside the per-layer
  sidecar (int2/per_expert.py); ``--maps FILE.npz`` scores ``fit-kl``'s maps beside their sidecar;
- ``plot QUALITY.json --out FILE.png``: a ``quality --json`` report's mean KLD over expert bytes per
  token (int2/plot.py; matplotlib, the optional ``plot`` extra), and the plotted rows as a table.

Every table names the model and the text its figures are of; ``--json`` / ``--csv`` write the
same to stdout, logs go to stderr. Exit codes: 0 ok, 1 a tool failed, a variant is not what its
recipe says or blame's control failed, 2 usage or input error (no such model, an unknown type, a
type whose blocks do not divide the experts' rows, refused before any work, no build).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from ..constants import EXIT_OK
from ..int2 import per_expert
from ..int2.agreement import GENERATE, N_PROMPTS, PROMPT_TOKENS, compare
from ..int2.blame import HELDOUT_WINDOWS, TRAIN_WINDOWS, BlameError, blame
from ..int2.compensator import SOURCE_INPUT, SOURCES
from ..int2.per_expert import HELDOUT_WINDOWS as PER_EXPERT_HELDOUT
from ..int2.per_expert import RANKS as PER_EXPERT_RANKS
from ..int2.per_expert import TRAIN_WINDOWS as PER_EXPERT_TRAIN
from ..int2.plot import labels as plot_labels
from ..int2.plot import load_report, plot_quality, table_parts, table_rows
from ..int2.quality import Quality
from ..int2.texts import OUTSIDE, OUTSIDE_DIST, TEXTS, corpus_text
from ..int2.variants import (
    DEFAULT_VARIANTS,
    HELDOUT_TOKENS,
    TRAIN_TOKENS,
    VARIANTS,
    Store,
    ToolFailed,
    VariantMismatch,
)
from . import int2_out as out
from .common import (
    EPILOG,
    CheckFailed,
    UsageError,
    arg_type,
    comma_list,
    model_parent,
    output_parent,
    positive_int,
    require_file,
    run_command,
    table,
)
from .int2_out import emit

logger = logging.getLogger("onebit_predict")
PROG = "onebit-int2"


def _variant(text: str) -> str:
    name = text.strip().lower()
    if name not in VARIANTS:
        raise ValueError(f"'{text}' is not one of {', '.join(VARIANTS)}")
    return name


def _compensator(text: str) -> tuple[str, Path]:
    name, sep, path = text.partition("=")
    if not sep or not path:
        raise ValueError(f"'{text}' is not VARIANT=FILE")
    return _variant(name), Path(path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], epilog=EPILOG)
    common = argparse.ArgumentParser(add_help=False, parents=[model_parent(), output_parent()])
    common.add_argument(
        "--types",
        type=arg_type(comma_list(_variant)),
        default=list(DEFAULT_VARIANTS),
        help=f"variants, of {','.join(VARIANTS)} (default: all; f16 is always the reference)",
    )
    common.add_argument("--threads", type=arg_type(positive_int), default=1, help="the tools' threads (default 1)")
    common.add_argument("--cache-dir", type=Path, help="the cache root instead of $ONEBIT_CACHE/int2")
    common.add_argument(
        "--train-tokens", type=arg_type(positive_int), default=TRAIN_TOKENS, help="the imatrix's training text"
    )
    text = argparse.ArgumentParser(add_help=False)
    text.add_argument(
        "--text",
        choices=TEXTS,
        default="val",
        help=f"the held-out text: the corpus's validation split, or {OUTSIDE_DIST}'s own Python sources "
        f"({OUTSIDE}: outside the training corpus) (default val)",
    )
    texts = argparse.ArgumentParser(add_help=False, parents=[text])
    texts.add_argument(
        "--heldout-tokens", type=arg_type(positive_int), default=HELDOUT_TOKENS, help="the held-out text's tokens"
    )
    comps = argparse.ArgumentParser(add_help=False)
    comps.add_argument(
        "--compensator",
        type=arg_type(_compensator),
        action="append",
        default=[],
        metavar="VARIANT=FILE",
        help="also a row of VARIANT with this compensator (ONEBIT_MOE_COMPENSATOR); repeatable",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("variants", parents=[common], help="make the variants (cached)", epilog=EPILOG)
    v.add_argument("--force", action="store_true", help="make them again even when cached")
    sub.add_parser(
        "quality", parents=[common, texts, comps], help="KL divergence, top-1, PPL against F16", epilog=EPILOG
    )
    a = sub.add_parser(
        "agreement", parents=[common, texts, comps], help="routing agreement, greedy divergence", epilog=EPILOG
    )
    a.add_argument("--prompts", type=arg_type(positive_int), default=N_PROMPTS, help="greedy prompts")
    a.add_argument("--prompt-tokens", type=arg_type(positive_int), default=PROMPT_TOKENS, help="tokens per prompt")
    a.add_argument("--generate", type=arg_type(positive_int), default=GENERATE, help="greedy tokens per prompt")
    b = sub.add_parser("blame", parents=[common, comps], help="where each row's KL lives, per layer", epilog=EPILOG)
    b.add_argument(
        "--windows", type=arg_type(positive_int), default=HELDOUT_WINDOWS, help="held-out windows of 256 tokens"
    )
    b.add_argument(
        "--train-windows",
        type=arg_type(positive_int),
        default=TRAIN_WINDOWS,
        help="training windows for the in-sample residual energy",
    )
    pe = sub.add_parser(
        "per-expert", parents=[common, text, comps], help="a low-rank map per routed expert, in numpy", epilog=EPILOG
    )
    pe.add_argument(
        "--ranks", type=arg_type(comma_list(positive_int)), default=list(PER_EXPERT_RANKS), help="ranks to fit"
    )
    pe.add_argument("--source", choices=SOURCES, default=SOURCE_INPUT, help="each map's source (default input)")
    pe.add_argument(
        "--train-windows", type=arg_type(positive_int), default=PER_EXPERT_TRAIN, help="training windows of 256"
    )
    pe.add_argument(
        "--windows", type=arg_type(positive_int), default=PER_EXPERT_HELDOUT, help="held-out windows of 256"
    )
    pe.add_argument("--maps", type=Path, metavar="FILE.npz",
                    help="score fit-kl --experts-out's maps beside their --compensator, not fit")  # fmt: skip
    pe.add_argument("--baseline", type=Path, metavar="SIDECAR", help="with --maps: a row of this sidecar alone")
    pl = sub.add_parser("plot", parents=[output_parent()], help="plot a quality --json report", epilog=EPILOG)
    pl.add_argument("report", type=Path, metavar="QUALITY.json", help="what onebit-int2 quality --json wrote")
    pl.add_argument("--out", type=Path, required=True, metavar="FILE.png", help="the plot (needs matplotlib)")
    return p


def _variants(args: argparse.Namespace, store: Store) -> int:
    rows = []
    for name in ["f16", *[n for n in args.types if n != "f16"]]:
        made = store.variant(name, force=args.force)
        m = made.manifest
        row = {"variant": name, "expert_type": m["expert_type"], "bits_per_weight": VARIANTS[name].bits}
        row["path"] = str(made.path)
        row |= {k: m[k] for k in ("bytes", "sha256", "expert_bytes_per_token", "n_expert_used")}
        rows.append(row | {"cached": made.cached} | {k: m.get(k) for k in ("seconds", "command", "recipe_key")})
    imatrix = store.imatrix() if any(VARIANTS[n].imatrix for n in args.types) else None
    emit(args, *out.variants_report(store, rows, imatrix))
    return EXIT_OK


def _quality(args: argparse.Namespace, store: Store) -> int:
    q = Quality(store, args.heldout_tokens, args.text)
    emit(args, *out.quality_report(store, q, [r.to_dict() for r in q.rows(args.types, args.compensator)]))
    return EXIT_OK


def _agreement(args: argparse.Namespace, store: Store) -> int:
    text = corpus_text(args.text, args.heldout_tokens, store.root)
    names = [n for n in VARIANTS if n == "f16" or n in args.types]
    pairs = [(n, None) for n in names] + list(args.compensator)
    found, plist = compare(store, text.tokens(), pairs, args.prompts, args.prompt_tokens, args.generate)
    emit(args, *out.agreement_report(store, text, found, plist, args.prompt_tokens, args.generate))
    return EXIT_OK


def _blame(args: argparse.Namespace, store: Store) -> int:
    pairs = [(n, None) for n in args.types if n != "f16"] + list(args.compensator)
    if not pairs:
        raise UsageError("blame needs a row other than f16 (--types or --compensator)")
    found = []
    for name, comp in pairs:
        made = store.variant(name)
        logger.info("blame: %s%s", name, f" + {comp.name}" if comp else "")
        found.append(blame(store.source, made.path, name, comp, heldout_windows=args.windows,
                           train_windows=args.train_windows, threads=store.threads, log=logger.info))  # fmt: skip
    emit(args, *out.blame_report(store, found, args.windows, args.train_windows))
    return EXIT_OK


def _per_expert(args: argparse.Namespace, store: Store) -> int:
    names = [n for n in args.types if n != "f16"]
    if len(names) != 1:
        raise UsageError(f"per-expert takes one variant (--types), not {','.join(names) or 'none'}")
    (name,) = names
    sidecars = [path for v, path in args.compensator if v == name]
    if len(sidecars) > 1 or len(sidecars) != len(args.compensator):
        raise UsageError(f"per-expert takes at most one --compensator, for {name}")
    if args.maps is not None and not sidecars:
        raise UsageError("--maps scores the maps with the sidecar fitted beside them: give --compensator")
    if args.baseline is not None and args.maps is None:
        raise UsageError("--baseline is a row beside --maps' rows: give --maps")
    for path in (p for p in (args.maps, args.baseline) if p is not None):
        require_file(path)
    made = store.variant(name)
    held = None if args.text == "val" else corpus_text(args.text, HELDOUT_TOKENS, store.root)
    if args.maps is None:
        fits = per_expert.fit(store.source, made.path, args.ranks, args.source, train_windows=args.train_windows,
                              threads=store.threads, log=logger.info)  # fmt: skip
    else:  # an archive of another model's shape, or none, is a ValueError: exit 2
        loaded = per_expert.read_maps(args.maps, made.path)
        fits = {loaded.rank: loaded}
    stream = None if held is None else held.tokens()
    found = per_expert.score(store.source, made.path, fits, sidecars[0] if sidecars else None,
                             heldout_windows=args.windows, heldout=stream, threads=store.threads,
                             on_sidecar=args.maps is not None, baseline=args.baseline)  # fmt: skip
    emit(args, *out.per_expert_report(store, made, name, found, args.train_windows, args.windows, held, args.maps))
    return EXIT_OK


def _plot(args: argparse.Namespace) -> int:
    require_file(args.report)  # the input first (no such file, not a report), the machine after
    report = load_report(args.report)
    plot_quality(report, args.out)
    logger.info("wrote %s", args.out)
    head, titles, cells = table_parts(report, args.out)
    emit(args, plot_labels(report, args.out), table_rows(report), [*head, table(titles, cells)])
    return EXIT_OK


COMMANDS = {
    "variants": _variants,
    "quality": _quality,
    "agreement": _agreement,
    "blame": _blame,
    "per-expert": _per_expert,
}


def _run(args: argparse.Namespace) -> int:
    if args.cmd == "plot":
        return _plot(args)
    require_file(args.model)
    for _, path in getattr(args, "compensator", []):
        require_file(path, "--compensator ")
    start = time.monotonic()
    store = Store(args.model, args.cache_dir, args.threads, args.train_tokens)
    # every type asked for, before the first tool runs: rows its blocks do not divide are an input error
    store.check_rows([*args.types, *(name for name, _ in getattr(args, "compensator", []))])
    try:
        code = COMMANDS[args.cmd](args, store)
    except (ToolFailed, VariantMismatch, BlameError) as e:  # a tool failed or made what its recipe does not
        # say, or blame's control (every layer replaced comes back to F16) did not hold
        raise CheckFailed(str(e)) from None
    logger.info("%s took %.1f s", args.cmd, time.monotonic() - start)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-int2``; return the exit code."""
    return run_command(PROG, _parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
