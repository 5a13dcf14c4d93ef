#!/usr/bin/env python3
"""The hit-rate figures docs/results.md publishes, reproduced by one command.

For a trained model: traces of router and block at ``_DEPTH`` = n_expert_used, 2 x and
4 x n_expert_used (clamped to n_expert, as llama.cpp does), on the held-out text
(models/heldout.txt, never trained on: four 256-byte snippets, each run as its own sequence
inside the models' 256-token training context), fed to the model as bytes: the first 16
bytes of a snippet prefilled, every later byte decoded as its own step so that every scored
row routes real text. Prints a Markdown table from ``onebit-stats --json`` (totals over the
predicted layers, decode rows): read recall, slot recall@n_used and @depth, exact match,
precision, next to the previous-token baseline.

    python tools/published_figures.py models/qwen3moe-tiny.gguf
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

REPO_ROOT = Path(__file__).resolve().parent.parent
HELDOUT = REPO_ROOT / "models" / "heldout.txt"
PREFILL = 16
WINDOW = 256  # the models' training context: each 256-byte snippet of heldout.txt is its own sequence


def n_expert_used(model: Path) -> int:
    reader = gguf.GGUFReader(model)
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    field = reader.fields[f"{arch}.expert_used_count"]
    return int(field.parts[-1][0])


def trace(model: Path, mode: str, depth: int, out: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "onebit_predict.commands.trace",
        str(model),
        "--mode",
        mode,
        "--depth",
        str(depth),
        "--out",
        str(out),
        "--prompt-file",
        str(HELDOUT),
        "--bytes",
        "--window",
        str(WINDOW),
        "--prefill",
        str(PREFILL),
        "--generate",
        "0",
        "--ctx",
        str(WINDOW),
    ]
    subprocess.run(cmd, check=True, stderr=subprocess.DEVNULL)


def totals(path: Path) -> tuple[dict, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "onebit_predict.commands.stats", str(path), "--json"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    report = json.loads(out)["traces"][0]
    return report["header"], report["total"]


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    args = p.parse_args()
    n_used = n_expert_used(args.model)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for depth_factor in (1, 2, 4):
            for mode in ("router", "block"):
                path = Path(tmp) / f"{mode}-{depth_factor}.bin"
                trace(args.model, mode, depth_factor * n_used, path)
                header, t = totals(path)
                rows.append((mode, header["depth"], t))
    print(
        f"model {args.model.name}, held-out text {HELDOUT.name} ({HELDOUT.stat().st_size} bytes), "
        f"{rows[0][2]['tokens']} scored rows (decode rows of the predicted layers)\n"
    )
    print(
        "| mode | depth | read recall | slot recall@n_used | slot recall@depth | exact match | precision "
        "| previous-token baseline |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for mode, depth, t in rows:
        print(
            f"| {mode} | {depth} | {pct(t['read_recall'])} | {pct(t['slot_recall_used'])} | "
            f"{pct(t['slot_recall_depth'])} | {pct(t['exact_match'])} | {pct(t['precision'])} | "
            f"{pct(t['baseline_recall'])} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
