"""``onebit-learned identity|check|stamp``: which model a learned-predictor sidecar names (learned.py).

A sidecar names the model it was trained on (``onebit_learned.model.architecture`` and
``onebit_learned.model.router_hash``); llama.cpp refuses one made for another model, or one
that names none (docs/learned.md).

- ``identity MODEL`` prints the model's architecture and router hash;
- ``check SIDECAR MODEL`` reads the sidecar and checks it against the model (exit 1 when it
  does not fit);
- ``stamp SIDECAR MODEL [--out F]`` rewrites a sidecar naming the model, its values unchanged
  (for a sidecar made before sidecars named their model).

Exit codes: 0 ok, 1 the sidecar does not fit the model, 2 usage or input error (commands/common.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from ..constants import EXIT_OK
from ..learned import LearnedError, check_model, model_identity, read_learned, stamp
from .common import EPILOG, CheckFailed, require_file, run_command

logger = logging.getLogger("onebit_predict")
PROG = "onebit-learned"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0], epilog=EPILOG)
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("identity", help="a model's architecture and router hash").add_argument("model", type=Path)
    c = sub.add_parser("check", help="does the sidecar fit the model")
    c.add_argument("sidecar", type=Path)
    c.add_argument("model", type=Path)
    s = sub.add_parser("stamp", help="rewrite the sidecar naming the model, values unchanged")
    s.add_argument("sidecar", type=Path)
    s.add_argument("model", type=Path)
    s.add_argument("--out", type=Path, help="write here (default: the sidecar, in place)")
    return p


def _run(args: argparse.Namespace) -> int:
    require_file(args.model)
    if args.cmd == "identity":
        arch, h = model_identity(args.model)
        print(f"{arch} {h:016x}")
        return EXIT_OK
    require_file(args.sidecar)
    if args.cmd == "stamp":
        pred = stamp(args.sidecar, args.model, args.out)
        print(f"{args.out or args.sidecar}: names {pred.model_arch} {pred.router_hash:016x}")
        return EXIT_OK
    pred = read_learned(args.sidecar)
    model_identity(args.model)  # a model that cannot be read is an input error, not a misfit
    try:
        check_model(pred, args.model)
    except LearnedError as e:
        raise CheckFailed(str(e)) from None
    print(f"{args.sidecar}: fits {args.model}")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-learned``; return the exit code."""
    return run_command(PROG, _parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
