"""``onebit-grow MODEL.gguf --expert-mib 2.7,8 --types f32,q8_0,q4_k_m``: grown models (models/).

Widens every routed expert of a trained MoE GGUF with zeros to the width whose experts
weigh ``--expert-mib`` MiB each at ``--at`` (mean over the layers, as llama.cpp stores them;
a multiple of 256), or to ``--width`` directly; writes it in F32 (and F16), quantizes the
F32 one with the patched ``llama-quantize`` (Q8_0, Q4_K_M) and caches every output under
``$ONEBIT_CACHE/grown/<source sha256>/`` (or ``--out-dir``) with a JSON manifest (sha256,
sizes, the fallback types llama-quantize chose). ``--check-determinism`` makes each output
a second time and compares sha256; ``--verify`` runs each against the original on the
held-out text (grow/verify.py): routing row for row and the logits' NMSE.

Exit codes: 0 ok, 1 a check failed (determinism, the predicted sizes, llama-quantize, the
F32/F16 proof), 2 usage or input error (a model that cannot be grown, no build, no
llama-quantize: the path tried is named).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..constants import EXIT_CHECK_FAILED, EXIT_OK
from ..grow.grow import MIB, QUANT_TYPES, TYPES, describe_sizes, width_for
from ..grow.quantize import QuantizeFailed, quantize_binary
from ..grow.store import Store
from ..grow.verify import NMSE_EXACT, Verifier, heldout_tokens, reference
from ..moe_check import require_moe_model
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
PROG = "onebit-grow"


def _mib(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise ValueError(f"'{text}' is not a positive size")
    return value


def _kind(text: str) -> str:
    kind = text.strip().lower()
    if kind not in TYPES:
        raise ValueError(f"'{text}' is not one of {', '.join(TYPES)}")
    return kind


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        epilog=EPILOG,
        parents=[model_parent(), output_parent(csv=False)],
    )
    size = p.add_mutually_exclusive_group(required=True)
    size.add_argument("--expert-mib", type=arg_type(comma_list(_mib)), help="MiB per expert at --at, e.g. 2.7,8")
    size.add_argument("--width", type=arg_type(comma_list(positive_int)), help="the grown FFN width(s) directly")
    p.add_argument("--at", type=arg_type(_kind), default="q4_k_m", help="the type --expert-mib is sized at")
    p.add_argument(
        "--types", type=arg_type(comma_list(_kind)), default=["f32", "q8_0", "q4_k_m"], help=f"of {','.join(TYPES)}"
    )
    p.add_argument("--out-dir", type=Path, help="the cache root instead of $ONEBIT_CACHE/grown")
    p.add_argument("--threads", type=positive_int, default=2, help="llama-quantize's and the proof's threads")
    p.add_argument("--force", action="store_true", help="make the outputs again even when cached")
    p.add_argument("--check-determinism", action="store_true", help="make each output twice; sha256 must agree")
    p.add_argument("--verify", action="store_true", help="prove each output against the original (routing, NMSE)")
    p.add_argument("--verify-bytes", type=positive_int, default=96, help="held-out bytes the proof runs")
    p.add_argument("--prefill", type=positive_int, default=16, help="of them, prefilled in one batch")
    return p


def _widths(args: argparse.Namespace, store: Store) -> list[tuple[float | None, int]]:
    if args.width:
        for w in args.width:
            if w < store.info.n_ff:
                raise UsageError(f"--width {w} is below the model's expert_feed_forward_length {store.info.n_ff}")
        return [(None, w) for w in args.width]
    out = []
    for mib in args.expert_mib:
        width = width_for(store.info, mib * MIB, args.at)
        sizes = describe_sizes(store.info, width)
        logger.info(
            "%g MiB per expert at %s: width %d; MiB per expert (mean of the layers) %s",
            mib,
            args.at,
            width,
            ", ".join(f"{k} {v['mean'] / MIB:.3f}" for k, v in sizes.items()),
        )
        out.append((mib, width))
    return out


def _verify(row: dict[str, Any], verifier: Verifier, store: Store, path: Path) -> bool:
    """Fill row['verify']; False when the F32/F16 proof fails (quantized: reported only)."""
    kind = row["type"]
    extra_bufts = kind not in QUANT_TYPES  # quantized: no AMX (grow/verify.py)
    against = verifier.compare(store.source, path, extra_bufts)
    ref, strict = reference(store, kind)
    same = verifier.compare(ref, path, extra_bufts)
    ok = not strict or (same.routing_equal and same.nmse < NMSE_EXACT)
    row["verify"] = {
        "extra_bufts": extra_bufts,
        "rows": against.rows,
        "routing_equal_rows": against.rows_equal,
        "routing_fraction": against.routing_fraction,
        "nmse": against.nmse,
        "reference": ref.name,
        "reference_rows": same.rows,
        "reference_routing_equal_rows": same.rows_equal,
        "reference_nmse": same.nmse,
        "reference_strict": strict,
        "passed": ok,
    }
    return ok


def _rows(args: argparse.Namespace, store: Store) -> tuple[list[dict[str, Any]], list[str]]:
    failures: list[str] = []
    verifier = None
    if args.verify:
        tokens = heldout_tokens(args.verify_bytes)
        if not 1 <= args.prefill < len(tokens):
            raise UsageError(f"--prefill {args.prefill} must be below --verify-bytes ({len(tokens)} read)")
        verifier = Verifier(tokens, args.prefill, args.threads)
    kinds = [k for k in TYPES if k in args.types]
    rows = []
    for mib, width in _widths(args, store):
        for kind in kinds:
            out = store.get(width, kind, force=args.force)
            m = out.manifest
            row: dict[str, Any] = {
                "model": store.source.name,
                "source_sha256": store.source_sha256,
                "expert_mib": mib,
                "at": args.at if mib is not None else None,
                "width": width,
                "type": kind,
                "path": str(out.path),
                "cached": out.cached,
                "bytes": m["bytes"],
                "sha256": m["sha256"],
                "expert_bytes_mean_mib": m["expert_bytes_mean_mib"],
                "expert_bytes": m["expert_bytes"],
                "expert_types": m["expert_types"],
                "fallbacks": m.get("fallback_summary", []),
            }
            if not m["expert_bytes_predicted_match"]:
                failures.append(f"{out.path.name}: expert bytes differ from the prediction (grow/grow.py)")
            if args.check_determinism:
                same, again = store.check_determinism(width, kind)
                row["deterministic"] = same
                if not same:
                    failures.append(f"{out.path.name}: made again it has sha256 {again}, not {m['sha256']}")
            if verifier is not None and not _verify(row, verifier, store, out.path):
                failures.append(f"{out.path.name}: the proof failed (routing or NMSE against its reference)")
            rows.append(row)
            logger.info("%s: %s", kind, out.path)
    return rows, failures


def _print_table(rows: list[dict[str, Any]]) -> None:
    titles = ["model", "MiB@type", "width", "type", "file MiB", "MiB/expert", "sha256", "det", "routing", "NMSE"]
    titles += ["reference", "ref routing", "ref NMSE"]
    lines = []
    for r in rows:
        v = r.get("verify", {})
        det = r.get("deterministic")
        lines.append(
            [
                r["model"],
                f"{r['expert_mib']:g}@{r['at']}" if r["expert_mib"] is not None else "-",
                str(r["width"]),
                r["type"],
                f"{r['bytes'] / MIB:.1f}",
                f"{r['expert_bytes_mean_mib']:.3f}",
                r["sha256"][:12],
                "-" if det is None else ("yes" if det else "NO"),
                f"{v['routing_equal_rows']}/{v['rows']}" if v else "-",
                fmt(v.get("nmse"), ".3g"),
                v.get("reference", "-"),
                f"{v['reference_routing_equal_rows']}/{v['reference_rows']}" if v else "-",
                fmt(v.get("reference_nmse"), ".3g"),
            ]
        )
    print(table(titles, lines))
    for r in rows:
        for line in r["fallbacks"]:
            print(f"{r['type']} w{r['width']} fallback: {line}")


def _run(args: argparse.Namespace) -> int:
    require_file(args.model)
    if args.prefill >= args.verify_bytes:
        raise UsageError(f"--prefill {args.prefill} must be below --verify-bytes {args.verify_bytes}")
    require_moe_model(args.model)
    if any(k in QUANT_TYPES for k in args.types):
        quantize_binary()  # before minutes of growing: exit 2 naming the path tried
    store = Store(args.model, args.out_dir, args.threads)
    try:
        rows, failures = _rows(args, store)
    except QuantizeFailed as e:  # llama-quantize ran and failed, or its log disagrees with itself
        raise CheckFailed(str(e)) from None
    if args.json:
        print(json.dumps({"rows": rows, "failures": failures}, indent=2))
    else:
        _print_table(rows)
    for failure in failures:
        logger.error("%s", failure)
    return EXIT_CHECK_FAILED if failures else EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-grow``; return the exit code."""
    return run_command(PROG, _parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
