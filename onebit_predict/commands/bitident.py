"""``onebit-bitident MODEL.gguf``: prove the predictor leaves the model's output unchanged.

Prints one line per scenario and mode and the verdict; ``--json`` for machines. A mode
passes when every logits row is byte-identical to the run with the predictor off and its
trace shows a prediction for every routed row of every predicted layer.

Exit codes: 0 identical, 1 different (or nothing predicted), 2 usage or input error.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from .bitident import MODES, SCENARIOS, ModeResult, check_model, split_mode
from .constants import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE
from .paths import NotBuiltError
from .runner import Model, RunError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="onebit-bitident", description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated modes to compare with off: router or block, optionally +advise or +read "
                        "(the prefetch consumer)")
    p.add_argument("--scenarios", default="all",
                   help="comma-separated scenario names, or all: " + ", ".join(s.name for s in SCENARIOS))
    p.add_argument("--seed", type=int, default=0, help="seed of the token stream")
    p.add_argument("--keep-traces", type=Path, help="write the traces into this directory instead of a temporary one")
    p.add_argument("--debug-leak", action="store_true",
                   help="negative control: let block mode store its speculative state (the check must then fail)")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    return p


def _line(r: ModeResult) -> str:
    ran = "" if r.ran == r.mode else f" (ran {r.ran})"
    if r.mismatch is not None:
        m = r.mismatch
        verdict = f"DIFFERENT at row {m.row}, vocab {m.vocab}: off {m.off!r} vs {r.mode} {m.other!r}"
    elif r.problem is not None:
        verdict = f"FAILED: {r.problem}"
    else:
        verdict = f"identical, {r.predicted_rows} predicted rows"
    return f"{r.scenario:<28} {r.mode + ran:<20} {verdict}"


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    try:
        if not modes or any(split_mode(m)[0] == "off" for m in modes):
            raise ValueError(args.modes)
    except ValueError:
        print(f"onebit-bitident: --modes must list modes like {', '.join(MODES)} (PREDICTOR[+CONSUMER])",
              file=sys.stderr)
        return EXIT_USAGE
    by_name = {s.name: s for s in SCENARIOS}
    names = list(by_name) if args.scenarios == "all" else [n.strip() for n in args.scenarios.split(",")]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        print(f"onebit-bitident: unknown scenario(s) {', '.join(unknown)}; known: {', '.join(by_name)}",
              file=sys.stderr)
        return EXIT_USAGE
    if not args.model.is_file():
        print(f"onebit-bitident: {args.model}: no such file", file=sys.stderr)
        return EXIT_USAGE
    if args.keep_traces:
        args.keep_traces.mkdir(parents=True, exist_ok=True)
    try:
        with Model(args.model) as model:
            results = check_model(model, [by_name[n] for n in names], modes, args.debug_leak, args.seed,
                                  args.keep_traces)
    except NotBuiltError as exc:
        print(f"onebit-bitident: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except RunError as exc:
        print(f"onebit-bitident: {exc}", file=sys.stderr)
        return EXIT_USAGE
    ok = all(r.ok for r in results)
    if args.json:
        print(json.dumps({"model": str(args.model), "identical": ok,
                          "results": [asdict(r) | {"ok": r.ok} for r in results]}, indent=2))
    else:
        for r in results:
            print(_line(r))
        print(f"verdict: {'IDENTICAL' if ok else 'NOT IDENTICAL'} ({sum(r.ok for r in results)}/{len(results)} passed)")
    return EXIT_OK if ok else EXIT_CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())
