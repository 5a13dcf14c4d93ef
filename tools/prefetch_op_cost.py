#!/usr/bin/env python3
"""What the prefetch consumer's op costs on the compute path, per token, warm and cold.

The op (ranking walk, mincore, one queue push; the workers do the madvise or the page
touching) runs on one compute thread while the others wait at its barrier. This measures,
for block mode with the consumer off, advise and read, each configuration in its own
process, rounds alternating: the decode time per token (teacher-forced on the held-out text)
and the op's own mean time per op, read from the native table (``op_us/op``, printed with
ONEBIT_MOE_PREDICT_STATS=1). ``--cold`` evicts the expert pages before every token as
``onebit-bench --cold`` does (exit 2 where no eviction method works on this machine).

    python tools/prefetch_op_cost.py models/qwen3moe-tiny.gguf [--cold] [--rounds 3] [--tokens 96]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from onebit_predict.constants import (
    ENV_ALL,
    ENV_MODE,
    ENV_PREFETCH,
    ENV_PREFETCH_DEBUG_DRAIN,
    ENV_STATS,
    EXIT_OK,
    EXIT_USAGE,
)

REPO = Path(__file__).resolve().parent.parent
TEXT = REPO / "models" / "heldout.txt"
CONSUMERS = ("off", "advise", "read")
PREFILL = 16
TOTAL_OP = re.compile(r"^onebit: total\s+(?:\d+\s+){7}(\S+)$", re.M)  # the consumer's total line, op_us/op last


def worker(model: Path, consumer: str, tokens: int, cold: bool) -> dict:
    """One configuration in this process: decode time per token and the op's time per op."""
    import io
    from contextlib import redirect_stderr

    from onebit_predict.llama.runner import Context, ContextSettings, Model

    env = dict.fromkeys(ENV_ALL) | {ENV_MODE: "block", ENV_STATS: "1"}
    if consumer != "off":
        env |= {ENV_PREFETCH: consumer, ENV_PREFETCH_DEBUG_DRAIN: "1" if cold else None}
    toks = list(TEXT.read_bytes()[: PREFILL + tokens])
    log = io.StringIO()
    with Model(model) as m:
        pages = None
        if cold:
            from onebit_predict.llama.evict import ExpertPages

            pages = ExpertPages(model)
            pages.random_access()
            method, _ = pages.detect()
        elapsed = 0.0
        with redirect_stderr(log), Context(m, ContextSettings(n_ctx=512, n_threads=2), env) as ctx:
            ctx.decode(toks[:PREFILL], range(PREFILL), [0] * PREFILL, [False] * (PREFILL - 1) + [True])
            for i in range(PREFILL, len(toks)):
                if pages is not None:
                    time.sleep(0.002)  # readahead still in flight lands before the eviction
                    pages.evict(method)
                t0 = time.perf_counter()
                ctx.decode([toks[i]], [i], [0], [True])
                elapsed += time.perf_counter() - t0
        if pages is not None:
            pages.close()
    op = TOTAL_OP.findall(log.getvalue())
    return {"us_per_token": 1e6 * elapsed / (len(toks) - PREFILL), "op_us_per_op": float(op[-1]) if op else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--cold", action="store_true", help="evict the expert pages before every token")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=96, help="decoded tokens per run (held-out text, byte ids)")
    p.add_argument("--worker", choices=CONSUMERS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.model.is_file() or args.rounds < 1 or not 1 <= args.tokens <= 400:
        print("prefetch_op_cost: a model file, --rounds >= 1 and --tokens 1..400 are needed", file=sys.stderr)
        return EXIT_USAGE
    if args.worker:
        try:
            print(json.dumps(worker(args.model, args.worker, args.tokens, args.cold)))
        except RuntimeError as e:  # EvictError: no eviction method works here
            print(f"prefetch_op_cost: {e}", file=sys.stderr)
            return EXIT_USAGE
        return EXIT_OK
    runs: dict[str, list[dict]] = {c: [] for c in CONSUMERS}
    for r in range(args.rounds):
        for c in CONSUMERS if r % 2 == 0 else reversed(CONSUMERS):
            cmd = [sys.executable, __file__, str(args.model), "--worker", c, "--tokens", str(args.tokens)]
            out = subprocess.run(cmd + (["--cold"] if args.cold else []), capture_output=True, text=True)
            if out.returncode != 0:
                sys.stderr.write(out.stderr[-2000:])
                return out.returncode
            runs[c].append(json.loads(out.stdout))
    base = statistics.median(x["us_per_token"] for x in runs["off"])
    print(
        f"model {args.model.name}, block, {'cold (expert pages evicted before every token)' if args.cold else 'warm'}, "
        f"{args.tokens} tokens x {args.rounds} rounds, medians"
    )
    print("| consumer | us/token | ratio to off | op us/op |\n|---|---:|---:|---:|")
    for c in CONSUMERS:
        tok = statistics.median(x["us_per_token"] for x in runs[c])
        ops = [x["op_us_per_op"] for x in runs[c] if x["op_us_per_op"] is not None]
        op = f"{statistics.median(ops):.1f}" if ops else "-"
        print(f"| {c} | {tok:.0f} | {tok / base:.3f} | {op} |")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
