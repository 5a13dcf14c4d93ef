"""``onebit-tiny --arch ARCH --out F.gguf``: write a tiny random MoE model for checks (llama/tiny.py).

The weights are random: these models are for bit-identity and plumbing checks, never for
hit-rate figures.

The model is written under a temporary name and renamed onto ``--out`` only once it reads
back whole: on a full disk nothing is left under ``--out``.

Exit codes: 0 ok, 1 the build's tool failed or the model could not be written whole (the
reason is named), 2 usage or input error (no patched build included; commands/common.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from ..constants import EXIT_OK
from ..llama.tiny import TINY_ARCHS, write_tiny_model
from .common import EPILOG, run_command

logger = logging.getLogger("onebit_predict")
PROG = "onebit-tiny"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Tiny random MoE models for checks.", epilog=EPILOG)
    p.add_argument("--arch", required=True, choices=TINY_ARCHS)
    p.add_argument("--out", required=True, type=Path, help="the GGUF to write")
    p.add_argument("--seed", type=int, default=1234)
    return p


def _run(args: argparse.Namespace) -> int:
    write_tiny_model(args.arch, args.out, args.seed)
    logger.info("wrote %s (%s, seed %d, random weights)", args.out, args.arch, args.seed)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``onebit-tiny``; return the exit code."""
    return run_command(PROG, _parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
