"""How ``onebit-int2`` prints its measurements (commands/int2.py): each report's labels (the model
and the text its figures are of), its rows, and the text table; ``--json`` writes the labels and
rows, ``--csv`` the rows."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..int2.agreement import Agreement
from ..int2.blame import RowBlame
from ..int2.per_expert import RowScore
from ..int2.quality import Quality, recovers
from ..int2.texts import Text
from ..int2.variants import CTX, Made, Store
from .common import fmt, table

MIB = 1 << 20
Report = tuple[dict[str, Any], list[dict[str, Any]], list[str]]  # labels, rows, the text table's lines


def emit(args: argparse.Namespace, labels: dict[str, Any], rows: list[dict[str, Any]], text: list[str]) -> None:
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


def model_line(store: Store) -> str:
    return f"model: {store.source} (sha256 {store.sha256[:16]})"


def _row_name(variant: str, compensator: str | Path | None) -> str:
    return variant + (f"+{Path(compensator).name}" if compensator else "")


def _pm(value: float, pm: float | None, spec: str) -> str:
    return format(value, spec) + ("" if pm is None else f" ± {format(pm, spec)}")


def variants_report(store: Store, rows: list[dict[str, Any]], imatrix: Made | None) -> Report:
    labels: dict[str, Any] = {"model": str(store.source), "model_sha256": store.sha256, "imatrix": None}
    lines = [model_line(store)]
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
    return labels, rows, [*lines, table(titles, cells)]


def quality_report(store: Store, q: Quality, rows: list[dict[str, Any]]) -> Report:
    labels = q.labels()
    lines = [
        model_line(store),
        f"text: {q.text.description}",
        f"windows of {labels['ctx']} tokens, {labels['scored_per_window']} scored per window; "
        f"F16 PPL {labels['base']['ppl']['value']:.4f} ± {labels['base']['ppl']['pm']:.4f}",
    ]
    titles = ["row", "expert type", "mean KLD", "p99 KLD", "max KLD", "top-1 %", "PPL", "expert bytes/token"]
    titles += ["recovers %", "PPL recovers %"]
    cells = [
        [_row_name(r["variant"], r["compensator"]), r["expert_type"]]
        + [_pm(r["kld_mean"], r.get("kld_mean_pm"), ".5f"), f"{r['kld_p99']:.5f}", f"{r['kld_max']:.4f}"]
        + [_pm(r["top1_pct"], r.get("top1_pct_pm"), ".2f"), _pm(r["ppl"], r.get("ppl_pm"), ".4f")]
        + [str(r["expert_bytes_per_token"]), fmt(r["recovers_pct"], ".1f"), fmt(r["ppl_recovers_pct"], ".1f")]
        for r in rows
    ]
    return labels, rows, [*lines, table(titles, cells)]


def agreement_report(
    store: Store, text: Text, found: list[Agreement], plist: list[tuple[int, list[int]]], prompt_tokens: int,
    generate: int,
) -> Report:  # fmt: skip
    rows = [a.to_dict(plist) for a in found]
    n_windows = len(text.tokens()) // CTX
    labels = {
        "model": str(store.source),
        "model_sha256": store.sha256,
        "text": text.summary(),
        "routing": f"{n_windows} windows of {CTX} tokens, teacher-forced, every row routed",
        "greedy": {"prompts": [{"offset": o, "tokens": p} for o, p in plist], "generate": generate},
    }
    layers = [x["layer"] for x in rows[0]["layers"]] if rows else []
    lines = [
        model_line(store),
        f"text: {text.description}",
        f"routing: {labels['routing']}: % of tokens whose expert set is F16's, per layer (mean overlap in brackets)",
        f"greedy: {len(plist)} prompts of {prompt_tokens} tokens at offsets {[o for o, _ in plist]}, "
        f"{generate} tokens generated: the first position that differs from F16's ('-' none); "
        f"the mean counts none as {generate}",
    ]
    titles = ["row", *[f"L{x}" for x in layers], "mean", *[f"p{i}" for i in range(len(plist))], "mean first"]
    cells = []
    for r in rows:
        per = [f"{x['set_equal'] * 100:.2f}" for x in r["layers"]]
        mean = f"{r['set_equal_mean'] * 100:.2f} ({r['overlap_mean'] * 100:.2f})"
        firsts = [fmt(g["first_divergence"], "d") for g in r["greedy"]]
        cells.append([_row_name(r["variant"], r["compensator"]), *per, mean, *firsts])
        cells[-1].append(f"{r['greedy_mean_first_divergence']:.1f}")
    return labels, rows, [*lines, table(titles, cells)]


def blame_report(store: Store, found: list[RowBlame], windows: int, train_windows: int) -> Report:
    labels = {
        "model": str(store.source),
        "model_sha256": store.sha256,
        "text": f"{windows} held-out windows of {CTX} tokens (validation split, evenly spaced), every row "
        f"scored; residual energy also on {train_windows} training windows",
    }
    lines = [
        model_line(store),
        f"text: {labels['text']}",
        "KL removed: the row's mean KL less its KL with that layer's MoE output replaced by F16's (its own input "
        "and routing); flip: tokens whose expert set is not F16's; energy: ||moe_f16(x) - y||^2 / ||moe_f16(x)||^2",
    ]
    titles = ["row", "layer", "KL removed", "share %", "flip %", "KL flipped", "KL kept", "energy held-out %"]
    titles.append("energy train %")
    cells = []
    for r in found:
        name = _row_name(r.variant, r.compensator)
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
    return labels, [r.to_dict() for r in found], [*lines, table(titles, cells)]


def per_expert_report(
    store: Store,
    made: Made,
    name: str,
    found: list[RowScore],
    train_windows: int,
    windows: int,
    held: Text | None,
    maps: Path | None = None,
) -> Report:
    """``held``: the held-out text scored (None: the corpus's validation split, whole); ``maps``: the
    per-expert archive scored (None: maps fitted here on ``train_windows``)."""
    plain = found[0].kl_mean
    rows = [asdict(r) | {"recovers_pct": recovers(plain, r.kl_mean) if r.values else None} for r in found]
    where = "validation split" if held is None else held.description
    fitted = f"fitted on {train_windows} training windows of {CTX} tokens"
    if maps is not None:
        fitted = f"maps {maps} with the sidecar fitted beside them"
    labels = {
        "model": str(store.source),
        "model_sha256": store.sha256,
        "variant": name,
        "quantized": str(made.path),
        "text": f"{fitted}; scored on {windows} held-out windows ({where}, evenly spaced), every row",
        "heldout": "val" if held is None else held.summary(),
    }
    lines = [
        model_line(store) + f", variant {name} ({made.path.name})",
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
    return labels, rows, [*lines, table(titles, cells)]
