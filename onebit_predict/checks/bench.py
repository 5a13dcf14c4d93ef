"""``onebit-bench MODEL.gguf``: what the predictor costs, measured side by side in one run.

Each configuration (the unpatched pin, the patched build with the predictor off, router,
router writing a trace, block, block without the mixer, block on a subset of layers) runs
in its own process (the unpatched and patched libllama cannot share one), the order
alternating round by round so that drift on the machine spreads over all of them. Decode
tok/s is reported as the median of the rounds with min and max, next to the ratio to
"patched off" and the compute-buffer size llama.cpp reports when it reserves the graph.
No absolute number is meant to be quoted alone: the ratios are the result.

``--cold`` (onebit_predict/bench_cold.py) emulates a model whose experts do not fit in
memory: before every decoded token the worker evicts the expert pages (onebit_predict/evict.py:
MADV_DONTNEED plus POSIX_FADV_DONTNEED, or MADV_PAGEOUT, whichever works here;
``--evict-method``), with readahead off on them, so each token reads its experts from the
drive. Only the decode calls are timed, not the eviction. The configurations are then the prefetch consumer off,
advise and read, for router and block predictions, each writing a trace, and the table adds
the consumer's counters and the prediction's read recall and precision from that trace.

Exit codes: 0 ok, 1 a run failed, 2 usage or input error.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from .constants import (
    ENV_LAYERS, ENV_MODE, ENV_NO_ATTN, ENV_OUT, EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE,
)
from .paths import NotBuiltError, build_info, pristine_lib_dir
from .policy import parse_layers

COMPUTE_BUFFER = re.compile(r"(\S+) compute buffer size = +([0-9.]+) MiB")
EVICT_SETTLE_S = 0.02  # --cold: untimed wait before each eviction, for asynchronous readahead to finish


@dataclass(frozen=True)
class Config:
    name: str
    env: dict[str, str]
    pristine: bool = False  # run on the unpatched pin's libllama
    evict: bool = True  # --cold: evict the expert pages before every token (False: the warm reference)


@dataclass(frozen=True)
class Sample:
    tok_s: float
    compute_mib: float
    n_layer: int
    resident_after_evict: float | None = None  # --cold: the most of the expert pages resident as a token started


@dataclass(frozen=True)
class Row:
    name: str
    median_tok_s: float
    min_tok_s: float
    max_tok_s: float
    ratio_to_off: float
    compute_mib: float
    layers_predicted: int
    extra_mib_per_layer: float | None  # compute buffer above patched off, per predicted layer
    cost_pct_per_layer: float | None  # decode time above patched off, % of its time, per predicted layer


def configs(trace_dir: Path, layers_subset: str) -> list[Config]:
    return [
        Config("unpatched pin", {}, pristine=True),
        Config("patched off", {}),
        Config("router", {ENV_MODE: "router"}),
        Config("router + trace", {ENV_MODE: "router", ENV_OUT: str(trace_dir / "router.bin")}),
        Config("block", {ENV_MODE: "block"}),
        Config("block no-attn", {ENV_MODE: "block", ENV_NO_ATTN: "1"}),
        Config(f"block layers {layers_subset}", {ENV_MODE: "block", ENV_LAYERS: layers_subset}),
    ]


def _worker(args: argparse.Namespace) -> int:
    """One timed run in this process: prefill, then --generate single-token decodes."""
    os.environ["ONEBIT_VERBOSE"] = "1"  # the compute-buffer line is an info log
    import io
    from contextlib import redirect_stderr

    from .runner import Context, ContextSettings, Model, builtin_tokens

    captured = io.StringIO()
    with Model(Path(args.model)) as model:
        pages = None
        if args.cold_method or args.detect:
            from .evict import ExpertPages  # noqa: PLC0415

            pages = ExpertPages(Path(args.model))
            pages.random_access()
            if args.detect:
                method, notes = pages.detect()
                print(json.dumps({"method": method, "notes": notes, "expert_bytes": pages.nbytes}))
                return EXIT_OK
        n_toks = args.prompt + args.generate
        if args.text_file:  # byte-level models: a byte is its own token id
            toks = list(args.text_file.read_bytes()[:n_toks])
        else:
            toks = builtin_tokens(n_toks, model.n_vocab, 0)
        settings = ContextSettings(n_ctx=args.prompt + args.generate + 8, n_batch=args.prompt, n_ubatch=args.prompt,
                                   n_threads=args.threads)
        with redirect_stderr(captured):
            ctx = Context(model, settings, json.loads(args.env))
        with ctx:
            n = args.prompt
            ctx.decode(toks[:n], range(n), [0] * n, [False] * (n - 1) + [True])
            elapsed = 0.0
            left = 0.0 if pages is not None else None
            for i in range(args.generate):
                if pages is not None:
                    # reads still in flight (madvise readahead) land before the eviction, not after it
                    time.sleep(EVICT_SETTLE_S)
                    pages.evict(args.cold_method)
                    left = max(left, pages.resident_fraction())
                t0 = time.perf_counter()
                ctx.decode([toks[n + i]], [n + i], [0], [True])
                elapsed += time.perf_counter() - t0
            if pages is not None:
                pages.close()
    mib = sum(float(m.group(2)) for m in COMPUTE_BUFFER.finditer(captured.getvalue()))
    print(json.dumps({"tok_s": args.generate / elapsed, "compute_mib": mib, "n_layer": model.n_layer,
                      "resident_after_evict": left}))
    return EXIT_OK


def worker_env(lib_dir: Path) -> dict[str, str]:
    """This process's environment without any onebit knob, pointed at lib_dir's libllama."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONEBIT_MOE_PREDICT", "ONEBIT_MOE_PREFETCH"))}
    env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    return env


def run_one(model: Path, cfg: Config, lib_dir: Path, args: argparse.Namespace) -> Sample:
    env = worker_env(lib_dir)
    cmd = [sys.executable, "-m", "onebit_predict.bench", "--worker", str(model), "--env", json.dumps(cfg.env),
           "--prompt", str(args.prompt), "--generate", str(args.generate), "--threads", str(args.threads)]
    if args.cold_method and cfg.evict:
        cmd += ["--cold-method", args.cold_method]
    if args.text_file:
        cmd += ["--text-file", str(args.text_file)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{cfg.name}: the worker failed ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return Sample(out["tok_s"], out["compute_mib"], out["n_layer"], out.get("resident_after_evict"))


def collect(model: Path, cfgs: Sequence[Config], lib: Path, lib_pristine: Path | None,
            args: argparse.Namespace) -> dict[str, list[Sample]]:
    """--rounds samples of every configuration, the order alternating round by round."""
    samples: dict[str, list[Sample]] = {c.name: [] for c in cfgs}
    for rnd in range(args.rounds):
        order = list(cfgs) if rnd % 2 == 0 else list(reversed(cfgs))
        for cfg in order:
            lib_dir = lib_pristine if cfg.pristine else lib
            samples[cfg.name].append(run_one(model, cfg, lib_dir, args))
            print(f"onebit-bench: round {rnd + 1}/{args.rounds} {cfg.name}: "
                  f"{samples[cfg.name][-1].tok_s:.1f} tok/s", file=sys.stderr)
    return samples


def measure(model: Path, cfgs: Sequence[Config], lib: Path, lib_pristine: Path | None,
            args: argparse.Namespace) -> list[Row]:
    samples = collect(model, cfgs, lib, lib_pristine, args)
    off = statistics.median(s.tok_s for s in samples["patched off"])
    off_mib = samples["patched off"][0].compute_mib
    rows = []
    for cfg in cfgs:
        toks = [s.tok_s for s in samples[cfg.name]]
        med = statistics.median(toks)
        first = samples[cfg.name][0]
        n_pred = len(parse_layers(cfg.env.get(ENV_LAYERS), first.n_layer)[0]) if ENV_MODE in cfg.env else 0
        extra = (first.compute_mib - off_mib) / n_pred if n_pred else None
        cost = 100 * (off / med - 1) / n_pred if n_pred else None  # time per token grows as 1/tok_s
        rows.append(Row(cfg.name, med, min(toks), max(toks), med / off, first.compute_mib, n_pred, extra, cost))
    return rows


def markdown(rows: Sequence[Row], header: str) -> str:
    lines = [header, "", "| configuration | decode tok/s (median) | min | max | vs patched off | compute buffer MiB "
             "| layers predicted | extra MiB per predicted layer | time cost per predicted layer |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        extra = "-" if r.extra_mib_per_layer is None else f"{r.extra_mib_per_layer:.3f}"
        cost = "-" if r.cost_pct_per_layer is None else f"{r.cost_pct_per_layer:.1f}%"
        lines.append(f"| {r.name} | {r.median_tok_s:.1f} | {r.min_tok_s:.1f} | {r.max_tok_s:.1f} | "
                     f"{r.ratio_to_off:.3f} | {r.compute_mib:.2f} | {r.layers_predicted or '-'} | {extra} | {cost} |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onebit-bench", description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds (odd, for a clean median)")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--generate", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--layers", default="1-2", help="the _LAYERS subset of the last configuration")
    p.add_argument("--text-file", type=Path,
                   help="feed this file's bytes as token ids (byte-level models) instead of the built-in stream")
    p.add_argument("--cold", action="store_true",
                   help="evict the expert pages before every decoded token and compare the prefetch consumer's modes")
    p.add_argument("--evict-method", choices=("auto", "pageout", "dontneed"), default="auto",
                   help="--cold: how to evict (auto: the first that works on this machine)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--detect", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--cold-method", default=None, help=argparse.SUPPRESS)
    p.add_argument("--env", default="{}", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if not args.model.is_file():
        print(f"onebit-bench: {args.model}: no such file", file=sys.stderr)
        return EXIT_USAGE
    if args.worker:
        return _worker(args)
    if args.rounds < 1 or args.prompt < 1 or args.generate < 1 or args.threads < 1:
        print("onebit-bench: --rounds, --prompt, --generate and --threads must be at least 1", file=sys.stderr)
        return EXIT_USAGE
    if args.text_file and (not args.text_file.is_file() or
                           args.text_file.stat().st_size < args.prompt + args.generate):
        print(f"onebit-bench: --text-file {args.text_file} must exist and hold at least --prompt + --generate "
              f"({args.prompt + args.generate}) bytes", file=sys.stderr)
        return EXIT_USAGE
    try:
        info = build_info()
    except NotBuiltError as exc:
        print(f"onebit-bench: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.cold:
        from .bench_cold import main_cold  # noqa: PLC0415

        return main_cold(args, info.lib_dir)
    pristine = pristine_lib_dir()
    with tempfile.TemporaryDirectory(prefix="onebit-bench-") as tmp:
        cfgs = configs(Path(tmp), args.layers)
        if pristine is None:
            print("onebit-bench: no unpatched build (run ./build.sh pristine); its row is left out", file=sys.stderr)
            cfgs = [c for c in cfgs if not c.pristine]
        try:
            rows = measure(args.model, cfgs, info.lib_dir, pristine, args)
        except RuntimeError as exc:
            print(f"onebit-bench: {exc}", file=sys.stderr)
            return EXIT_CHECK_FAILED
    if args.json:
        print(json.dumps({"model": str(args.model), "rounds": args.rounds, "prompt": args.prompt,
                          "generate": args.generate, "threads": args.threads,
                          "rows": [asdict(r) for r in rows]}, indent=2))
    else:
        print(markdown(rows, f"model {args.model.name}, {args.rounds} alternating rounds, prompt {args.prompt}, "
                             f"{args.generate} decoded tokens, {args.threads} threads"))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
