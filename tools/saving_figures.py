#!/usr/bin/env python3
"""The "what the predictor would save" figures of docs/results.md, reproduced by one command.

For a trained model: router and block traces at ``_DEPTH`` = n_expert_used on the
held-out text, the token stream of tools/published_figures.py (the same traces as its
first two rows); then

- ``onebit-stats replay`` at 1/4, 1/2 and 3/4 of the experts cached per layer: LRU, LFRU
  and Belady without prediction, LRU with each predictor's experts prefetched (charged) and
  with block's only protected (free), Belady with block's prefetched;
- ``onebit-stats simulate`` at 3 and 7 GB/s with experts sized as Qwen3-30B-A3B's at
  Q4_K_M (``qwen3_30b_a3b_q4_k_m_expert_bytes``), 0.7 ms of compute per layer
  (``LAYER_MS``), the drive's defaults (100 us, queue depth 4), with n_expert_used and
  n_expert/2 slots per layer; the predictors' costs from ``onebit-bench --json`` on the
  same model (``--bench-json``, or run here), or given (``--cost-pct``).

    python tools/saving_figures.py models/qwen3moe-tiny.gguf [--bench-json bench.json | --cost-pct router=4,block=55]

Prints Markdown. The tok/s are those of the traced model's layer count (8 layers), not of a
48-layer model: the ratios are the result.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

# Qwen3-30B-A3B (config.json): hidden_size 2048, moe_intermediate_size 768, 128 experts,
# 8 used, 48 layers. Q4_K_M as llama.cpp's llama-quant.cpp assigns it to the expert tensors:
# gate and up Q4_K; down Q6_K on the "use_more_bits" layers, Q4_K on the others.
HIDDEN, MOE_FFN, N_LAYER_30B = 2048, 768, 48
Q4_K_BYTES_PER_256, Q6_K_BYTES_PER_256 = 144, 210  # ggml block sizes (256 weights a block)
LAYER_MS = 0.7  # see docs/results.md: ~35 MB of weights a layer touches per token at ~50 GB/s of RAM
BANDWIDTHS = "3GB/s,7GB/s"


def qwen3_30b_a3b_q4_k_m_expert_bytes() -> tuple[float, int, int]:
    """(mean bytes of one expert over the 48 layers, bytes with a Q4_K down, with a Q6_K down)."""
    blocks = HIDDEN * MOE_FFN // 256  # per matrix: gate, up and down have the same size
    q4k, q6k = blocks * Q4_K_BYTES_PER_256, blocks * Q6_K_BYTES_PER_256
    n = N_LAYER_30B

    def more_bits(i: int) -> bool:  # llama-quant.cpp's use_more_bits
        return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2

    per_layer = [2 * q4k + (q6k if more_bits(i) else q4k) for i in range(n)]
    return sum(per_layer) / n, 3 * q4k, 2 * q4k + q6k


def _published_figures():
    spec = importlib.util.spec_from_file_location("published_figures", REPO_ROOT / "tools" / "published_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def stats(*args: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "onebit_predict.commands.stats", *args, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
    )
    if done.returncode != 0:  # 1: inconsistent traces or routing that differs; 2: bad input
        sys.exit(f"onebit-stats {' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return json.loads(done.stdout)


def bench(model: Path, out: Path) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "onebit_predict.commands.bench",
        str(model),
        "--rounds",
        "5",
        "--prompt",
        "64",
        "--generate",
        "128",
        "--threads",
        "1",
        "--layers",
        "1-3",
        "--json",
    ]
    out.write_text(subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=REPO_ROOT).stdout)
    return out


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    cost = p.add_mutually_exclusive_group()
    cost.add_argument("--bench-json", type=Path, help="onebit-bench --json of MODEL (default: run it, 5 rounds)")
    cost.add_argument(
        "--cost-pct",
        metavar="router=P,block=P",
        help="the predictors' costs in %% of a token's compute, e.g. from docs/results.md's onebit-bench "
        "table: (1 / 'vs patched off' - 1) * 100",
    )
    args = p.parse_args()
    pf = _published_figures()
    n_used = pf.n_expert_used(args.model)
    expert_bytes, q4_down, q6_down = qwen3_30b_a3b_q4_k_m_expert_bytes()
    with tempfile.TemporaryDirectory() as tmp:
        traces = {}
        for mode in ("router", "block"):
            traces[mode] = Path(tmp) / f"{mode}.bin"
            pf.trace(args.model, mode, n_used, traces[mode])
        if args.cost_pct:
            costs = {k: float(v) for k, v in (item.split("=") for item in args.cost_pct.split(","))}
        else:
            bench_json = args.bench_json or bench(args.model, Path(tmp) / "bench.json")
            costs = {r["name"]: 100 * (1 / r["ratio_to_off"] - 1) for r in json.loads(bench_json.read_text())["rows"]}
        both = stats(str(traces["router"]), str(traces["block"]))  # none, previous-token, oracle: from router's
        if both["routing_differences"]:
            sys.exit(f"router and block traces route differently: {both['routing_differences'][:3]}")
        n_expert = both["traces"][0]["header"]["n_expert"]
        slots = [n_expert // 4, n_expert // 2, 3 * n_expert // 4]
        slot_list = ",".join(map(str, slots))

        print(
            f"model {args.model.name}: {n_expert} experts, top-{n_used}; decode tokens of the held-out text; "
            f"totals over every layer\n"
        )
        print("| cache | prediction | " + " | ".join(f"{s} slots" for s in slots) + " |")
        print("|---|---|" + "---:|" * len(slots))
        rows = [
            ("LRU", "none", "router", "lru", "none"),
            ("LFRU", "none", "router", "lfru", "none"),
            ("Belady", "none", "router", "belady", "none"),
            ("LRU", "router, prefetched (charged)", "router", "lru", "trace"),
            ("LRU", "block, prefetched (charged)", "block", "lru", "trace"),
            ("LRU", "block, protected (free)", "block", "lru", "protect"),
            ("Belady", "block, prefetched (charged)", "block", "belady", "trace"),
        ]
        for cache, what, mode, policy, prefetch in rows:
            res = stats("replay", str(traces[mode]), "--slots", slot_list, "--policy", policy, "--prefetch", prefetch)
            cells = [f"{pct(r['total']['hit_rate'])} ({r['total']['reads_per_token']:.2f})" for r in res["results"]]
            print(f"| {cache} | {what} | " + " | ".join(cells) + " |")
        print("\ncells: hit rate % (expert reads per token)\n")

        print(
            f"simulate: {BANDWIDTHS}, expert {expert_bytes:.0f} bytes (Qwen3-30B-A3B Q4_K_M mean: "
            f"{q4_down} with a Q4_K down, {q6_down} with a Q6_K down), {LAYER_MS} ms a layer, "
            f"predictor costs ({'given' if args.cost_pct else 'onebit-bench'}): "
            f"router {costs.get('router', 0):.1f} %, "
            f"block {costs.get('block', 0):.1f} % of a token's compute\n"
        )
        runs = {}
        slot_counts = (n_used, n_expert // 2)
        for s in slot_counts:
            for mode in ("router", "block"):
                res = stats(
                    "simulate",
                    str(traces[mode]),
                    "--expert-bytes",
                    f"{expert_bytes:.0f}",
                    "--bandwidth",
                    BANDWIDTHS,
                    "--layer-ms",
                    str(LAYER_MS),
                    "--slots",
                    str(s),
                    "--predictor-cost-pct",
                    f"{costs.get(mode, 0):.2f}",
                )
                for r in res["runs"]:
                    if r["predictor"] == mode or mode == "router":
                        runs[(r["bandwidth"], s, r["predictor"])] = r
        columns = [(bw, s) for bw in sorted({k[0] for k in runs}) for s in slot_counts]
        print("| | " + " | ".join(f"{bw / 1e9:g} GB/s, {s} slots" for bw, s in columns) + " |")
        print("|---|" + "---:|" * len(columns))

        def line(title: str, cell) -> None:
            print(f"| {title} | " + " | ".join(cell(bw, s) for bw, s in columns) + " |")

        line("none: tok/s", lambda bw, s: f"{runs[(bw, s, 'none')]['tok_s']:.1f}")
        for name in ("previous-token", "router", "block", "oracle"):
            line(
                f"{name}: tok/s (speedup)",
                lambda bw, s, n=name: f"{runs[(bw, s, n)]['tok_s']:.1f} ({runs[(bw, s, n)]['speedup']:.2f}x)",
            )
        for name in ("router", "block"):
            line(
                f"{name}: spent / saved %",
                lambda bw, s, n=name: f"{runs[(bw, s, n)]['spent_pct']:.1f} / {runs[(bw, s, n)]['saved_pct']:.1f}",
            )
        for name in ("none", "router", "block", "oracle"):
            line(
                f"{name}: MB read (wasted) per token",
                lambda bw, s, n=name: (
                    f"{runs[(bw, s, n)]['bytes_read_per_token'] / 1e6:.1f} "
                    f"({runs[(bw, s, n)]['bytes_wasted_per_token'] / 1e6:.1f})"
                ),
            )
        for name in ("none", "router", "block", "oracle"):
            line(f"{name}: stall ms per token", lambda bw, s, n=name: f"{runs[(bw, s, n)]['stall_ms_per_token']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
