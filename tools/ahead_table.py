"""The L+1..L+3 table: every predictor at every lookahead on every trained model.

For each bundled trained model, each predictor (router, block, learned from the model's
committed sidecar ``models/NAME.learned-kK.gguf``) and each lookahead K = 1..3, it records a
trace of the held-out text (models/heldout.txt, byte tokens, 256-byte windows, 16 prefilled
and the rest decoded one by one, teacher-forced) at depth 2 x n_used, and reads off:

- read recall at depth n_used (slot recall@n_used) and at 2 x n_used, over the decode rows
  that follow their previous token, predicted layers (onebit-stats' rule);
- the previous-token baseline on the same rows;
- the predictor's measured cost per predicted layer: decode time per token with the
  predictor on against off, on the same model, each configuration in its own process,
  rounds alternating (onebit-bench's worker), divided by the predicted layers;
- what ``onebit-stats simulate`` makes of the trace with 2.7 MiB experts (a Qwen3-30B-A3B
  expert at Q4_K_M) at 3 and 7 GB/s and an assumed 1 ms of compute per layer: the trace's
  predictor against no prediction (simulate's defaults otherwise; the cost is not charged
  there: a tiny model's compute is not a real model's).

    python tools/ahead_table.py [--models NAME,...] [--rounds 3] [--json OUT.json]

It prints a markdown table (and writes the JSON with every figure). Needs the patched build
(./build.sh).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from onebit_predict.atomic import atomic_write_text  # noqa: E402
from onebit_predict.checks.rounds import BenchOptions, Config, collect  # noqa: E402
from onebit_predict.constants import ENV_AHEAD, ENV_DEPTH, ENV_LEARNED, ENV_MODE  # noqa: E402
from onebit_predict.grow.gguf_keys import arch_value  # noqa: E402
from onebit_predict.llama.paths import build_info  # noqa: E402
from onebit_predict.metrics.stats import compute_stats  # noqa: E402
from onebit_predict.trace import Trace  # noqa: E402

MODELS = ("qwen3moe-tiny", "qwen4exp-tiny", "olmoe-tiny")
PREDICTORS = ("router", "block", "learned")
AHEADS = (1, 2, 3)
HELDOUT = REPO / "models" / "heldout.txt"
EXPERT_BYTES = "2.7MiB"
BANDWIDTHS = ("3GB/s", "7GB/s")
# assumed: a real model's layer compute per token; Qwen3-30B-A3B decoding ~20 tok/s resident on a
# desktop CPU over its 48 layers is ~1 ms a layer (the tiny models' own compute is far less)
LAYER_MS = "1.0"


@dataclass(frozen=True)
class Row:
    model: str
    predictor: str
    ahead: int
    n_used: int
    recall_used: float  # read recall at depth n_used
    recall_2used: float  # ... at 2 x n_used
    baseline: float  # previous token, same rows
    rows: int  # scored (row, layer) pairs
    cost_us_per_layer: float  # measured, per predicted layer and token
    sim_speedup: dict[str, float]  # bandwidth -> tok/s with the predictor over no prediction


def sidecar(model: str, ahead: int) -> Path:
    return REPO / "models" / f"{model}.learned-k{ahead}.gguf"


def env_of(predictor: str, model: str, ahead: int, depth: int) -> dict[str, str]:
    env = {ENV_MODE: predictor, ENV_AHEAD: str(ahead), ENV_DEPTH: str(depth)}
    if predictor == "learned":
        env[ENV_LEARNED] = str(sidecar(model, ahead))
    return env


def record(model: str, predictor: str, ahead: int, depth: int, out: Path) -> None:
    cmd = [sys.executable, "-m", "onebit_predict.commands.trace", str(REPO / "models" / f"{model}.gguf")]
    cmd += ["--mode", predictor, "--ahead", str(ahead), "--depth", str(depth), "--out", str(out)]
    cmd += ["--prompt-file", str(HELDOUT), "--bytes", "--window", "256", "--prefill", "16", "--generate", "0"]
    cmd += ["--ctx", "256"]
    if predictor == "learned":
        cmd += ["--learned", str(sidecar(model, ahead))]
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def costs(model: str, n_used: int, rounds: int) -> dict[tuple[str, int], float]:
    """us per predicted layer and decoded token, each (predictor, K) against off."""
    gguf = REPO / "models" / f"{model}.gguf"
    n_layer = int(arch_value(gguf, "block_count"))
    cfgs = [Config("off", {})]
    for p in PREDICTORS:
        for k in AHEADS:
            cfgs.append(Config(f"{p}@{k}", env_of(p, model, k, 2 * n_used)))
    opts = BenchOptions(rounds=rounds, prompt=16, generate=96, threads=2, text_file=HELDOUT)
    samples = collect(gguf, cfgs, build_info().lib_dir, None, opts)
    ms = {c.name: statistics.median(1000.0 / s.tok_s for s in samples[c.name]) for c in cfgs}
    return {
        (p, k): (ms[f"{p}@{k}"] - ms["off"]) * 1000.0 / (n_layer - k) for p in PREDICTORS for k in AHEADS
    }  # fmt: skip


def simulate(trace: Path) -> dict[str, float]:
    """The trace's predictor over no prediction, in simulated tok/s (no predictor cost charged:
    the tiny models' compute says nothing of a real model's; the cost is its own column)."""
    cmd = [sys.executable, "-m", "onebit_predict.commands.stats", "simulate", str(trace)]
    cmd += ["--expert-bytes", EXPERT_BYTES, "--bandwidth", ",".join(BANDWIDTHS), "--layer-ms", LAYER_MS, "--json"]
    out = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    by: dict[str, dict[str, float]] = {}
    for r in out["runs"]:
        by.setdefault(f"{r['bandwidth'] / 1e9:g} GB/s", {})[r["predictor"]] = r["tok_s"]
    mode = Trace.open(trace).header.mode_name
    return {bw: runs[mode] / runs["none"] for bw, runs in by.items()}


def table(rows: list[Row]) -> str:
    bws = list(rows[0].sim_speedup) if rows else []
    head = "| model | predictor | L+K | recall@n_used | recall@2n_used | previous token | cost us/layer | "
    head += " | ".join(f"simulate x @ {b}" for b in bws) + " |"
    lines = [head, "|" + "---|" * 3 + "---:|" * (4 + len(bws))]
    for r in rows:
        sims = " | ".join(f"{r.sim_speedup[b]:.2f}" for b in bws)
        lines.append(
            f"| {r.model} (n_used {r.n_used}) | {r.predictor} | L+{r.ahead} | {100 * r.recall_used:.1f}% | "
            f"{100 * r.recall_2used:.1f}% | {100 * r.baseline:.1f}% | {r.cost_us_per_layer:.1f} | {sims} |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="onebit-ahead-") as tmp:
        for model in args.models.split(","):
            gguf = REPO / "models" / f"{model}.gguf"
            n_used = int(arch_value(gguf, "expert_used_count"))
            cost = costs(model, n_used, args.rounds)
            for p in PREDICTORS:
                for k in AHEADS:
                    trace = Path(tmp) / f"{model}-{p}-{k}.bin"
                    record(model, p, k, 2 * n_used, trace)
                    m = compute_stats(Trace.open(trace)).total_at(k).metrics()
                    rows.append(
                        Row(
                            model,
                            p,
                            k,
                            n_used,
                            m["slot_recall_used"],
                            m["read_recall"],
                            m["baseline_recall"],
                            int(m["tokens"]),
                            cost[(p, k)],
                            simulate(trace),
                        )  # fmt: skip
                    )
                    print(f"{model} {p} L+{k}: {rows[-1]}", file=sys.stderr)
    print(table(rows))
    if args.json:
        atomic_write_text(args.json, json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
