"""``onebit-bitident MODEL.gguf``: prove the predictor leaves the model's output unchanged.

Prints one line per scenario and mode and the verdict; ``--json`` for machines. A mode
passes when every logits row is byte-identical to the run with the predictor off and its
trace shows a prediction for every routed row of every predicted layer; a route-time mode,
when the trace header and the context's counters show each of its qualifiers at work
(checks/bitident.py).

Exit codes: 0 identical, 1 different (or nothing predicted, or a trace that could not be
written whole: ``FAILED: writing the trace failed: ...``), 2 usage or input error
(commands/common.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from ..checks.bitident import MODES, SCENARIOS, ModeResult, check_model
from ..checks.modes import parse_mode
from ..constants import ENV_ALL, EXIT_CHECK_FAILED, EXIT_OK
from ..llama.runner import Model
from ..moe_check import require_moe_model
from .common import UsageError, model_parent, output_parent, require_file, run_command

PROG = "onebit-bitident"
logger = logging.getLogger("onebit_predict")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=__doc__.splitlines()[0],
        epilog="exit codes: 0 identical, 1 different, 2 usage or input error",
        parents=[model_parent(extra_bufts=True), output_parent(csv=False)],
    )
    p.add_argument(
        "--modes",
        default=",".join(MODES),
        help="comma-separated modes to compare with off: router, block or learned, optionally @K (predict "
        "K = 1..3 layers ahead), optionally +advise, +read, +populate or +pread (the prefetch consumer's call), "
        "optionally +route (route-time reads); or route alone, or CALL+route (route time, the predictor off); "
        "after +route, in this order, optionally +exact (readahead off), +wait (the route-time op waits for "
        "its reads; not with advise), +lru (an LRU over whole experts, held small so that it evicts), +hits "
        "(the expert matmuls take resident experts first), +layers (a batch reads 2 whole layers ahead)",
    )
    p.add_argument(
        "--scenarios",
        default="all",
        help="comma-separated scenario names, or all: " + ", ".join(s.name for s in SCENARIOS),
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the token stream")
    p.add_argument("--keep-traces", type=Path, help="write the traces into this directory instead of a temporary one")
    p.add_argument(
        "--debug-leak",
        action="store_true",
        help="negative control: let block mode store its speculative state (the check must then fail)",
    )
    return p


def _line(r: ModeResult) -> str:
    ran = "" if r.ran == r.mode else f" (ran {r.ran})"
    if r.mismatch is not None:
        m = r.mismatch
        verdict = f"DIFFERENT at row {m.row}, vocab {m.vocab}: off {m.off!r} vs {r.mode} {m.other!r}"
        if r.problem is not None:
            verdict += f"; and {r.problem}"
    elif r.problem is not None:
        verdict = f"FAILED: {r.problem}"
    else:
        routed = parse_mode(r.mode).predictor == "off"  # route time alone predicts nothing
        verdict = "identical, routed" if routed else f"identical, {r.predicted_rows} predicted rows"
    return f"{r.scenario:<28} {r.mode + ran:<26} {verdict}"


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    grammar = "PREDICTOR[@K][+CALL][+route[+exact][+wait][+lru]], or [CALL+]route[+exact][+wait][+lru]"
    if not modes:
        raise UsageError(f"--modes must list modes like {', '.join(MODES)} ({grammar})")
    for m in modes:
        try:
            spec = parse_mode(m)
        except ValueError as e:
            raise UsageError(f"--modes: {e}; modes look like {', '.join(MODES)} ({grammar})") from None
        if spec.predictor == "off" and not spec.route:
            raise UsageError(f"--modes: {m!r} is the reference every mode is compared with, not a mode ({grammar})")
    return modes


def _scenario_names(text: str) -> list[str]:
    known = [s.name for s in SCENARIOS]
    names = known if text == "all" else [n.strip() for n in text.split(",")]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise UsageError(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def _run(args: argparse.Namespace) -> int:
    modes = _modes(args.modes)
    by_name = {s.name: s for s in SCENARIOS}
    names = _scenario_names(args.scenarios)
    require_file(args.model)
    require_moe_model(args.model)
    if args.keep_traces:
        args.keep_traces.mkdir(parents=True, exist_ok=True)
    inherited = sorted(k for k in ENV_ALL if k in os.environ)
    if inherited:
        logger.info("ignoring %s from the environment: the check sets every knob of every run", ", ".join(inherited))
    with Model(args.model, extra_bufts=not args.no_extra_bufts) as model:
        results = check_model(model, [by_name[n] for n in names], modes, args.debug_leak, args.seed, args.keep_traces)
    ok = all(r.ok for r in results)
    if args.json:
        print(
            json.dumps(
                {"model": str(args.model), "identical": ok, "results": [asdict(r) | {"ok": r.ok} for r in results]},
                indent=2,
            )
        )
    else:
        for r in results:
            print(_line(r))
        print(f"verdict: {'IDENTICAL' if ok else 'NOT IDENTICAL'} ({sum(r.ok for r in results)}/{len(results)} passed)")
    return EXIT_OK if ok else EXIT_CHECK_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-bitident``; return the exit code."""
    return run_command(PROG, _parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
