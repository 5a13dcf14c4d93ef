"""``onebit-compensator fit|show``: the 2-bit experts' compensator sidecar (int2/compensator.py).

- ``fit --model F16.gguf --quantized Q2.gguf --out FILE.gguf`` checks first that ``--out``'s
  directory exists and is writable, then captures the 2-bit model's MoE activations on training
  text through the patched libllama (int2/capture.py), fits both sources
  (``input``: the MoE block's input; ``output``: the MoE output) at each rank of ``--ranks`` by
  least squares against the F16 experts (int2/moe_numpy.py), scores every fit on held-out text,
  writes the chosen one (``--source best`` and no ``--rank``: the most held-out residual energy
  removed over all layers) and prints the per-layer table; then runs the held-out text through
  the 2-bit model with the written sidecar applied by llama.cpp (ONEBIT_MOE_COMPENSATOR) and reports,
  against F16's, the KL divergence, top-1 agreement and next-token loss with and without it;
- ``fit-kl --model F16.gguf --quantized Q2.gguf --start LS.gguf --out FILE.gguf`` refits a ``fit``
  sidecar (output source) to the KL against F16's logits plus ``--router-weight`` times its routers'
  KL, all layers together, by Adam steps through a torch forward pass (int2/kl_fit.py; torch is the
  optional ``fit`` extra, its absence an input error naming it); the best held-out step is written;
  ``--expert-rank R --experts-out F.npz`` fits and writes a rank-R map per expert too (int2/per_expert.py);
- ``show FILE [--model Q2.gguf]`` prints the sidecar's header and per-layer norms and, with
  ``--model``, checks that the sidecar was fitted for that model (exit 1 when it was not); a file
  the reader refuses (a layer whose gain bound ``||up||*||down||`` exceeds 65504, F16's largest value,
  included: int2/compensator.py) is an input error, exit 2.

Tables by default; ``--json`` or ``--csv`` on stdout; progress on stderr. Exit codes: 0 ok, 1 the
sidecar does not fit the model, 2 usage or input error (commands/common.py).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..constants import EXIT_OK
from ..int2 import compensator as comp_mod
from ..int2 import kl_fit, per_expert
from ..int2.compensator import SOURCES, Compensator, CompensatorError, check_model, model_identity
from .common import (
    EPILOG,
    CheckFailed,
    UsageError,
    arg_type,
    comma_list,
    nonneg_float,
    output_parent,
    positive_float,
    positive_int,
    require_file,
    run_command,
    table,
)

logger = logging.getLogger("onebit_predict")
PROG = "onebit-compensator"
TOKENS_DEFAULT = 64 * 1024  # training tokens captured
HELDOUT_DEFAULT = 8 * 1024  # held-out tokens scored
RANKS_DEFAULT = (16, 64, 128)  # and n_embd (full rank)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], epilog=EPILOG)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", parents=[output_parent()], help="fit a compensator and write its sidecar")
    f.add_argument("--model", type=Path, required=True, metavar="F16.gguf", help="the full-precision model")
    f.add_argument("--quantized", type=Path, required=True, metavar="Q2.gguf", help="its 2-bit experts variant")
    f.add_argument("--out", type=Path, required=True, metavar="FILE.gguf", help="the sidecar to write")
    f.add_argument("--rank", type=arg_type(positive_int), help="write this rank (default: the best held-out)")
    f.add_argument("--ranks", type=arg_type(comma_list(positive_int)), help="ranks to fit (default 16,64,128,n_embd)")
    f.add_argument("--source", choices=[*SOURCES, "best"], default="best", help="s of C s (default: best held-out)")
    f.add_argument("--tokens", type=arg_type(positive_int), default=TOKENS_DEFAULT, help="training tokens captured")
    f.add_argument("--heldout-tokens", type=arg_type(positive_int), default=HELDOUT_DEFAULT, help="held-out tokens")
    f.add_argument("--threads", type=arg_type(positive_int), default=1, help="llama.cpp threads (default 1)")
    k = sub.add_parser("fit-kl", parents=[output_parent()], help="refit a sidecar to the KL against F16 (torch)")
    k.add_argument("--model", type=Path, required=True, metavar="F16.gguf", help="the full-precision model")
    k.add_argument("--quantized", type=Path, required=True, metavar="Q2.gguf", help="its 2-bit experts variant")
    k.add_argument("--start", type=Path, required=True, metavar="LS.gguf", help="fit's sidecar (output source)")
    k.add_argument("--out", type=Path, required=True, metavar="FILE.gguf", help="the sidecar to write")
    k.add_argument("--steps", type=arg_type(positive_int), default=kl_fit.STEPS, help="Adam steps")
    k.add_argument("--batch", type=arg_type(positive_int), default=kl_fit.BATCH, help="windows per step")
    k.add_argument("--lr", type=arg_type(positive_float), default=kl_fit.LR, help="Adam's learning rate")
    k.add_argument("--train-windows", type=arg_type(positive_int), default=kl_fit.TRAIN_WINDOWS, help="of 256 tokens")
    k.add_argument("--router-weight", type=arg_type(nonneg_float), default=kl_fit.ROUTER_WEIGHT,
                   help="plus this times the routers' KL to F16's, summed over layers")  # fmt: skip
    k.add_argument("--expert-rank", type=arg_type(positive_int), default=0,
                   help="also fit a map of this rank per (layer, expert); needs --experts-out")  # fmt: skip
    k.add_argument("--expert-lr", type=arg_type(positive_float), default=kl_fit.LR,
                   help="the experts' maps' learning rate (they start at zero)")  # fmt: skip
    k.add_argument("--experts-out", type=Path, metavar="FILE.npz", help="where the per-expert maps go (numpy)")
    k.add_argument("--threads", type=arg_type(positive_int), default=1, help="llama.cpp and torch threads")
    s = sub.add_parser("show", parents=[output_parent()], help="a sidecar's header and layers; --model checks it")
    s.add_argument("sidecar", type=Path, metavar="FILE")
    s.add_argument("--model", type=Path, metavar="Q2.gguf", help="check that the sidecar was fitted for this model")
    return p


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def _emit(args: argparse.Namespace, titles: list[str], rows: list[list], doc: dict, before=(), after=()) -> None:
    if args.json:
        print(json.dumps(doc, indent=2))
    elif args.csv:
        w = csv.writer(sys.stdout, lineterminator="\n")
        w.writerow(titles)
        w.writerows(rows)
    else:
        for line in before:
            print(line)
        print(table(titles, [[str(c) for c in r] for r in rows]))
        for line in after:
            print(line)


def _check_pair(full: comp_mod.ModelIdentity, quant: comp_mod.ModelIdentity, args: argparse.Namespace) -> None:
    from ..learned import model_identity as router_identity

    def shape(i: comp_mod.ModelIdentity) -> tuple:
        return i.arch, i.n_embd, i.n_layer, i.moe_layers

    if shape(full) != shape(quant) or router_identity(args.model) != router_identity(args.quantized):
        raise UsageError(f"{args.quantized} is not a variant of {args.model} (architecture, shape or router differ)")
    if full.experts_hash == quant.experts_hash:
        raise UsageError(f"{args.quantized} has the same experts as {args.model}: nothing to compensate")


def _require_out(out: Path, flag: str = "--out") -> None:
    """UsageError unless ``flag``'s file can be written at ``out``: its directory exists and is writable,
    and ``out`` itself is not a directory."""
    parent = out.parent
    if not parent.is_dir():
        raise UsageError(f"{flag} {out}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {out}: the directory {parent} is not writable")
    if out.is_dir():
        raise UsageError(f"{flag} {out}: is a directory")


def _fit(args: argparse.Namespace) -> int:
    from ..int2.capture import Capturer, capture_fit_data, corpus_streams, heldout_scores, windows

    for path in (args.model, args.quantized):
        require_file(path)
    _require_out(args.out)  # before the capture: a fit takes minutes, a typo in --out must not cost them
    full, quant = model_identity(args.model), model_identity(args.quantized)
    _check_pair(full, quant, args)
    n = quant.n_embd
    ranks = sorted({min(r, n) for r in (args.ranks or [*RANKS_DEFAULT, n])} | ({args.rank} if args.rank else set()))
    if ranks[-1] > n:
        raise UsageError(f"--rank {ranks[-1]} is above n_embd = {n}")
    t0 = time.monotonic()
    train, val = corpus_streams()
    train_wins, val_wins = windows(train, max(1, args.tokens // 256)), windows(val, max(1, args.heldout_tokens // 256))
    data = capture_fit_data(args.model, args.quantized, train_wins, val_wins, threads=args.threads, log=logger.info)
    t_capture = time.monotonic() - t0
    for what, checks in (("F16", data.check_full), ("quantized", data.check_quantized)):
        for c in checks:
            logger.info(
                "numpy %s MoE vs llama.cpp's, layer %d: relative error %.2e (own routing %.2e, same experts %.1f%%)",
                what, c.layer, c.rel_err, c.rel_err_own, 100 * c.routing_agree,
            )  # fmt: skip
    t0 = time.monotonic()
    scores, fitted = comp_mod.sweep(data.fit_part, data.tune_part, data.heldout, ranks)
    source, rank = comp_mod.choose(data.heldout, scores, None if args.source == "best" else args.source, args.rank)
    t_fit = time.monotonic() - t0
    comp = Compensator(
        n_embd=n,
        rank=rank,
        n_layer=quant.n_layer,
        source=source,
        model_arch=quant.arch,
        experts_hash=quant.experts_hash,
        model_name=quant.name,
        fitted_on=f"{data.train_tokens} tokens of training text (the tiny models' corpus), {args.quantized.name} "
        f"against {args.model.name}'s experts; ridge chosen on a fifth of it",
        tokens=data.train_tokens,
        layers={li: fitted[source, li, rank] for li in quant.moe_layers},
    )
    comp_mod.write_compensator(args.out, comp)
    t0 = time.monotonic()
    with Capturer(args.model, args.threads) as cap_f, Capturer(args.quantized, args.threads) as cap_q:
        with Capturer(args.quantized, args.threads, compensator=args.out) as cap_c:  # llama.cpp's own graph
            held = heldout_scores(cap_f, {"quantized": cap_q, "compensated": cap_c}, val_wins)
    t_eval = time.monotonic() - t0
    h_full, h_q, h_c = held["full"], held["quantized"], held["compensated"]
    kl_removed = 1 - h_c.kl / h_q.kl if h_q.kl > 0 else None
    gap = h_q.nll - h_full.nll
    closed = (h_q.nll - h_c.nll) / gap if gap > 0 else None

    titles = ["layer", "source", "rank", "ridge", "train_removed_%", "heldout_removed_%", "residual/output_%"]
    rows = [
        [s.layer, s.source, s.rank, f"{s.ridge:g}", _pct(s.train_removed), _pct(s.heldout_removed), _pct(s.baseline)]
        for s in scores
    ]
    totals = {f"{src}/{r}": comp_mod.total_removed(data.heldout, scores, src, r) for src in SOURCES for r in ranks}
    rows += [["all", *k.split("/"), "", "", _pct(v), ""] for k, v in totals.items() if v is not None]
    lines = [
        f"held-out KL(F16 || .) per token: 2-bit {h_q.kl:.5f}, 2-bit + compensator {h_c.kl:.5f}"
        + ("" if kl_removed is None else f" ({_pct(kl_removed)}% removed)")
        + f"; top-1 agreement with F16 {_pct(h_q.top1)}% -> {_pct(h_c.top1)}%",
        f"held-out next-token loss (nats): F16 {h_full.nll:.4f}, 2-bit {h_q.nll:.4f}, "
        f"2-bit + compensator {h_c.nll:.4f}" + ("" if closed is None else f" ({_pct(closed)}% of the gap closed)"),
        f"wrote {args.out}: source {source}, rank {rank}, experts hash {quant.experts_hash:016x} "
        f"({'/'.join(sorted(set(quant.expert_types)))})",
        f"time: capture {t_capture:.1f} s ({data.train_tokens} + {data.heldout_tokens} tokens), "
        f"fit {t_fit:.1f} s, end-to-end check {t_eval:.1f} s",
    ]
    doc = {
        "out": str(args.out),
        "source": source,
        "rank": rank,
        "experts_hash": f"{quant.experts_hash:016x}",
        "scores": [s.__dict__ for s in scores],
        "heldout_removed_all_layers": totals,
        "heldout": {k: v.__dict__ for k, v in held.items()} | {"kl_removed": kl_removed, "nll_gap_closed": closed},
        "reference_check": {
            "f16": [c.__dict__ for c in data.check_full],
            "quantized": [c.__dict__ for c in data.check_quantized],
        },
        "tokens": {"train": data.train_tokens, "heldout": data.heldout_tokens},
        "seconds": {"capture": t_capture, "fit": t_fit, "eval": t_eval},
    }
    _emit(args, titles, rows, doc, after=lines)
    return EXIT_OK


def _fit_kl(args: argparse.Namespace) -> int:
    for path in (args.model, args.quantized, args.start):
        require_file(path)
    if (args.expert_rank > 0) != (args.experts_out is not None):
        raise UsageError("--expert-rank and --experts-out go together")
    _require_out(args.out)
    if args.experts_out is not None:
        _require_out(args.experts_out, "--experts-out")
    kl_fit.require_torch()  # before the targets: the extra's name, not a traceback
    settings = {k: getattr(args, k) for k in kl_fit.SETTINGS}
    got = kl_fit.fit(args.model, args.quantized, args.start, threads=args.threads, log=logger.info, **settings)
    comp_mod.write_compensator(args.out, got.compensator)
    if args.experts_out is not None:
        per_expert.write_maps(args.experts_out, got.experts)
    logger.info("wrote %s", ", ".join(str(p) for p in (args.out, args.experts_out) if p is not None))
    rows = [[s.step, f"{s.train_kl:.5f}", f"{s.heldout_kl:.5f}", f"{s.heldout_router_kl:.5f}"]
            for s in got.steps if s.heldout_kl is not None]  # fmt: skip
    kept = ("start_heldout_kl", "start_heldout_router_kl", "best_heldout_kl", "best_step")
    doc = {"out": str(args.out), "start": str(args.start), **{k: getattr(got, k) for k in kept}, "settings": settings}
    doc.update(steps=[vars(s) for s in got.steps], seconds=round(got.seconds, 1))
    after = [
        f"held-out KL (the torch forward pass, {kl_fit.HELDOUT_WINDOWS} windows): {got.start_heldout_kl:.5f} at the "
        f"start, {got.best_heldout_kl:.5f} kept (step {got.best_step}); wrote {args.out}"
    ]
    _emit(args, ["step", "batch KL", "held-out KL", "held-out router KL"], rows, doc, after=after)
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    require_file(args.sidecar)
    comp = comp_mod.read_compensator(args.sidecar)
    titles = ["layer", "C_frobenius", "C_spectral", "down_frobenius", "up_frobenius"]
    rows = []
    for li, ly in sorted(comp.layers.items()):
        sv = np.linalg.svd(ly.matrix, compute_uv=False)
        norms = (np.sqrt(np.sum(sv**2)), sv[0], np.linalg.norm(ly.down), np.linalg.norm(ly.up))
        rows.append([li, *(f"{v:.4g}" for v in norms)])
    kept = ("n_embd", "rank", "n_layer", "source", "model_arch", "experts_hash", "model_name", "fitted_on", "tokens")
    header = {k: getattr(comp, k) for k in kept} | {"experts_hash": f"{comp.experts_hash:016x}"}
    lines = [f"{k}: {v}" for k, v in header.items()]
    fit_error = None
    if args.model is not None:
        require_file(args.model)
        ident = model_identity(args.model)  # a model that cannot be read is an input error, not a misfit
        try:
            check_model(comp, args.model)
        except CompensatorError as e:
            fit_error = str(e)
        verdict = "does NOT fit" if fit_error else "fits"
        lines.append(f"model {args.model}: experts hash {ident.experts_hash:016x}: {verdict}")
    doc = {
        "header": header,
        "layers": [dict(zip(titles, r)) for r in rows],
        "fits": None if args.model is None else fit_error is None,
    }
    _emit(args, titles, rows, doc, before=lines)
    if fit_error:
        raise CheckFailed(fit_error)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-compensator``; return the exit code."""
    return run_command(PROG, _parser(), lambda a: {"fit": _fit, "fit-kl": _fit_kl, "show": _show}[a.cmd](a), argv)


if __name__ == "__main__":
    sys.exit(main())
