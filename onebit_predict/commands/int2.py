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
- ``agreement MODEL [--types LIST] [--compensator VARIANT=FILE ...]``: per layer, the share of
  held-out tokens routed to F16's expert set; and where greedy generation first departs from F16's
  (int2/agreement.py);
- ``blame MODEL [--types LIST] [--compensator VARIANT=FILE ...]``: where each row's KL against F16
  lives (int2/blame.py): per layer, the KL removed by putting F16's MoE output in that layer (through
  the capture), the share of tokens whose routing flipped there and the KL of flipped against kept
  tokens, and the residual energy on held-out against training text;
- ``per-expert MODEL --types VARIANT [--ranks LIST] [--source input|output] [--compensator
  VARIANT=FILE]``: a low-rank map per routed expert, gated by its router weight, fitted and
  scored in numpy, end to end through the capture's hook, beside the per-layer sidecar
  (int2/per_expert.py);
- ``plot QUALITY.json --out FILE.png``: a ``quality --json`` report's mean KLD over expert bytes per
  token (int2/plot.py; matplotlib, the optional ``plot`` extra), and the plotted rows as a table.

Every table names the model and the text its figures are of; ``--json`` / ``--csv`` write the
same to stdout, logs go to stderr. Exit codes: 0 ok, 1 a tool failed, a variant is not what its
recipe says or blame's control failed, 2 usage or input error (no such model, an unknown type, a
type whose blocks do not divide the experts' rows, refused before any work, no build).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

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
from ..int2.quality import Quality, recovers
from ..int2.variants import (
    CTX,
    DEFAULT_VARIANTS,
    HELDOUT_TOKENS,
    OUTSIDE,
    OUTSIDE_DIST,
    TEXTS,
    TRAIN_TOKENS,
    VARIANTS,
    Store,
    ToolFailed,
    VariantMismatch,
    corpus_text,
)
from .common import (
    EPILOG,
    CheckFailed,
    UsageError,
    arg_type,
    comma_list,
    fmt,
    model_parent,
    output_parent,
    positive_int,
    require_file,
    run_command,
    table,
)

logger = logging.getLogger("onebit_predict")
PROG = "onebit-int2"
MIB = 1 << 20


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
    texts = argparse.ArgumentParser(add_help=False)
    texts.add_argument(
        "--heldout-tokens", type=arg_type(positive_int), default=HELDOUT_TOKENS, help="the held-out text's tokens"
    )
    texts.add_argument(
        "--text",
        choices=TEXTS,
        default="val",
        help=f"the held-out text: the corpus's validation split, or {OUTSIDE_DIST}'s own Python sources "
        f"({OUTSIDE}: outside the training corpus) (default val)",
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
        "per-expert", parents=[common, comps], help="a low-rank map per routed expert, in numpy", epilog=EPILOG
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
    pl = sub.add_parser("plot", parents=[output_parent()], help="plot a quality --json report", epilog=EPILOG)
    pl.add_argument("report", type=Path, metavar="QUALITY.json", help="what onebit-int2 quality --json wrote")
    pl.add_argument("--out", type=Path, required=True, metavar="FILE.png", help="the plot (needs matplotlib)")
    return p


def _emit(args: argparse.Namespace, labels: dict[str, Any], rows: list[dict[str, Any]], text: list[str]) -> None:
    """``--json``: labels and rows; ``--csv``: the rows (nested values as JSON); else ``text``."""
    if args.json:
        print(json.dumps({**labels, "rows": rows}, indent=2))
    elif args.csv:
        keys = list(dict.fromkeys(k for r in rows for k in r))
        out = csv.DictWriter(sys.stdout, keys, lineterminator="\n")
        out.writeheader()
        for r in rows:
            out.writerow({k: json.dumps(v) if isinstance(v, (dict, list)) else v for k, v in r.items()})
    else:
        print("\n".join(text))


def _model_line(store: Store) -> str:
    return f"model: {store.source} (sha256 {store.sha256[:16]})"


def _variants(args: argparse.Namespace, store: Store) -> int:
    rows = []
    for name in ["f16", *[n for n in args.types if n != "f16"]]:
        made = store.variant(name, force=args.force)
        m = made.manifest
        rows.append(
            {
                "variant": name,
                "expert_type": m["expert_type"],
                "bits_per_weight": VARIANTS[name].bits,
                "path": str(made.path),
                "bytes": m["bytes"],
                "sha256": m["sha256"],
                "expert_bytes_per_token": m["expert_bytes_per_token"],
                "n_expert_used": m["n_expert_used"],
                "cached": made.cached,
                "seconds": m.get("seconds"),
                "command": m.get("command"),
                "recipe_key": m.get("recipe_key"),
            }
        )
    imatrix = store.imatrix() if any(VARIANTS[n].imatrix for n in args.types) else None
    labels: dict[str, Any] = {"model": str(store.source), "model_sha256": store.sha256, "imatrix": None}
    lines = [_model_line(store)]
    if imatrix:
        m = imatrix.manifest
        labels["imatrix"] = {k: m[k] for k in ("sha256", "command", "seconds", "text")} | {"path": str(imatrix.path)}
        lines.append(f"imatrix: {imatrix.path.name} on {m['text']['description']}")
    titles = ["variant", "expert type", "bpw", "file MiB", "expert bytes/token", "sha256", "cached", "s"]
    cells = [
        [r["variant"], r["expert_type"], r["bits_per_weight"], f"{r['bytes'] / MIB:.2f}"]
        + [str(r["expert_bytes_per_token"]), r["sha256"][:12], "yes" if r["cached"] else "no", fmt(r["seconds"], ".1f")]
        for r in rows
    ]
    _emit(args, labels, rows, [*lines, table(titles, cells)])
    return EXIT_OK


def _pm(value: float, pm: float | None, spec: str) -> str:
    return format(value, spec) + ("" if pm is None else f" ± {format(pm, spec)}")


def _quality(args: argparse.Namespace, store: Store) -> int:
    q = Quality(store, args.heldout_tokens, args.text)
    rows = [r.to_dict() for r in q.rows(args.types, args.compensator)]
    labels = q.labels()
    lines = [
        _model_line(store),
        f"text: {q.text.description}",
        f"windows of {labels['ctx']} tokens, {labels['scored_per_window']} scored per window; "
        f"F16 PPL {labels['base']['ppl']['value']:.4f} ± {labels['base']['ppl']['pm']:.4f}",
    ]
    titles = ["row", "expert type", "mean KLD", "p99 KLD", "max KLD", "top-1 %", "PPL", "expert bytes/token"]
    titles += ["recovers %", "PPL recovers %"]
    cells = [
        [r["variant"] + (f"+{Path(r['compensator']).name}" if r["compensator"] else ""), r["expert_type"]]
        + [_pm(r["kld_mean"], r.get("kld_mean_pm"), ".5f"), f"{r['kld_p99']:.5f}", f"{r['kld_max']:.4f}"]
        + [_pm(r["top1_pct"], r.get("top1_pct_pm"), ".2f"), _pm(r["ppl"], r.get("ppl_pm"), ".4f")]
        + [str(r["expert_bytes_per_token"]), fmt(r["recovers_pct"], ".1f"), fmt(r["ppl_recovers_pct"], ".1f")]
        for r in rows
    ]
    _emit(args, labels, rows, [*lines, table(titles, cells)])
    return EXIT_OK


def _agreement(args: argparse.Namespace, store: Store) -> int:
    text = corpus_text("val", args.heldout_tokens, store.root)
    names = [n for n in VARIANTS if n == "f16" or n in args.types]
    pairs = [(n, None) for n in names] + list(args.compensator)
    found, plist = compare(store, text.tokens(), pairs, args.prompts, args.prompt_tokens, args.generate)
    rows = [a.to_dict(plist) for a in found]
    n_windows = len(text.tokens()) // CTX
    labels = {
        "model": str(store.source),
        "model_sha256": store.sha256,
        "text": text.summary(),
        "routing": f"{n_windows} windows of {CTX} tokens, teacher-forced, every row routed",
        "greedy": {"prompts": [{"offset": o, "tokens": p} for o, p in plist], "generate": args.generate},
    }
    layers = [x["layer"] for x in rows[0]["layers"]] if rows else []
    lines = [
        _model_line(store),
        f"text: {text.description}",
        f"routing: {labels['routing']}: % of tokens whose expert set is F16's, per layer (mean overlap in brackets)",
        f"greedy: {len(plist)} prompts of {args.prompt_tokens} tokens at offsets {[o for o, _ in plist]}, "
        f"{args.generate} tokens generated: the first position that differs from F16's ('-' none); "
        f"the mean counts none as {args.generate}",
    ]
    titles = ["row", *[f"L{x}" for x in layers], "mean", *[f"p{i}" for i in range(len(plist))], "mean first"]
    cells = []
    for r in rows:
        name = r["variant"] + (f"+{Path(r['compensator']).name}" if r["compensator"] else "")
        per = [f"{x['set_equal'] * 100:.2f}" for x in r["layers"]]
        mean = f"{r['set_equal_mean'] * 100:.2f} ({r['overlap_mean'] * 100:.2f})"
        firsts = [fmt(g["first_divergence"], "d") for g in r["greedy"]]
        cells.append([name, *per, mean, *firsts, f"{r['greedy_mean_first_divergence']:.1f}"])
    _emit(args, labels, rows, [*lines, table(titles, cells)])
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
    rows = [r.to_dict() for r in found]
    labels = {
        "model": str(store.source),
        "model_sha256": store.sha256,
        "text": f"{args.windows} held-out windows of {CTX} tokens (validation split, evenly spaced), every row "
        f"scored; residual energy also on {args.train_windows} training windows",
    }
    lines = [
        _model_line(store),
        f"text: {labels['text']}",
        "KL removed: the row's mean KL less its KL with that layer's MoE output replaced by F16's (its own input "
        "and routing); flip: tokens whose expert set is not F16's; energy: ||moe_f16(x) - y||^2 / ||moe_f16(x)||^2",
    ]
    titles = ["row", "layer", "KL removed", "share %", "flip %", "KL flipped", "KL kept", "energy held-out %"]
    titles.append("energy train %")
    cells = []
    for r in found:
        name = r.variant + (f"+{Path(r.compensator).name}" if r.compensator else "")
        lines.append(
            f"{name}: mean KL {r.kl_mean:.5f}, p99 {r.kl_p99:.5f}, max {r.kl_max:.4f}, top-1 {r.top1 * 100:.2f} %, "
            f"{r.tokens} tokens; every layer replaced: {r.kl_all_replaced:.2g} (the control); routing flipped "
            f"somewhere on {r.any_flip * 100:.1f} % of tokens, which carry {r.kl_any_flip_share * 100:.1f} % of the KL"
        )
        for x in r.layers:
            cells.append(
                [name, str(x.layer), f"{x.kl_removed:.5f}", f"{x.share * 100:.1f}", f"{x.flip * 100:.2f}"]
                + [fmt(x.kl_flipped, ".5f"), f"{x.kl_kept:.5f}", f"{x.energy_heldout * 100:.2f}"]
                + [f"{x.energy_train * 100:.2f}"]
            )
    _emit(args, labels, rows, [*lines, table(titles, cells)])
    return EXIT_OK


def _per_expert(args: argparse.Namespace, store: Store) -> int:
    names = [n for n in args.types if n != "f16"]
    if len(names) != 1:
        raise UsageError(f"per-expert takes one variant (--types), not {','.join(names) or 'none'}")
    (name,) = names
    sidecars = [path for v, path in args.compensator if v == name]
    if len(sidecars) > 1 or len(sidecars) != len(args.compensator):
        raise UsageError(f"per-expert takes at most one --compensator, for {name}")
    made = store.variant(name)
    fits = per_expert.fit(store.source, made.path, args.ranks, args.source, train_windows=args.train_windows,
                          threads=store.threads, log=logger.info)  # fmt: skip
    found = per_expert.score(store.source, made.path, fits, sidecars[0] if sidecars else None,
                             heldout_windows=args.windows, threads=store.threads)  # fmt: skip
    plain = found[0].kl_mean
    rows = [asdict(r) | {"recovers_pct": recovers(plain, r.kl_mean) if r.values else None} for r in found]
    labels = {
        "model": str(store.source),
        "model_sha256": store.sha256,
        "variant": name,
        "quantized": str(made.path),
        "text": f"fitted on {args.train_windows} training windows of {CTX} tokens; scored on {args.windows} "
        f"held-out windows (validation split, evenly spaced), every row",
    }
    lines = [
        _model_line(store) + f", variant {name} ({made.path.name})",
        f"text: {labels['text']}",
        "KL against F16 with the correction in llama.cpp's graph (per-expert: written in by the capture's hook); "
        "energy: the share of ||moe_f16(x) - y||^2 each removes, per layer",
    ]
    layers = sorted({li for r in found for li in r.energy_removed})
    titles = ["row", "rank", "mean KLD", "p99 KLD", "max KLD", "top-1 %", "recovers %"]
    titles += [f"L{li} energy %" for li in layers] + ["MiB held"]
    cells = [
        [r["name"], fmt(r["rank"], "d"), f"{r['kl_mean']:.5f}", f"{r['kl_p99']:.5f}", f"{r['kl_max']:.4f}"]
        + [f"{r['top1'] * 100:.2f}", fmt(r["recovers_pct"], ".1f")]
        + [fmt(r["energy_removed"][li] * 100 if li in r["energy_removed"] else None, ".1f") for li in layers]
        + [f"{r['values'] * 4 / MIB:.2f}"]
        for r in rows
    ]
    _emit(args, labels, rows, [*lines, table(titles, cells)])
    return EXIT_OK


def _plot(args: argparse.Namespace) -> int:
    require_file(args.report)  # the input first (no such file, not a report), the machine after
    report = load_report(args.report)
    plot_quality(report, args.out)
    logger.info("wrote %s", args.out)
    head, titles, cells = table_parts(report, args.out)
    _emit(args, plot_labels(report, args.out), table_rows(report), [*head, table(titles, cells)])
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
