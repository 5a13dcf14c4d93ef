"""``python -m onebit_predict.commands.vocab IN.gguf OUT.gguf [--strip]``: give a byte-level GGUF
(token id = byte value, id 256 = end of file) the RWKV byte vocabulary, or take it away
(onebit_predict/grow/vocab.py says what it writes).

Exit codes: 0 ok, 2 usage or input error (commands/common.py).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from ..constants import EXIT_OK
from ..grow.vocab import N_VOCAB, add_byte_vocab, strip_vocab
from .common import run_command

PROG = "onebit-vocab"
logger = logging.getLogger("onebit_predict")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path, metavar="IN.gguf")
    p.add_argument("dst", type=Path, metavar="OUT.gguf", help="may be IN.gguf (replaced at the end)")
    p.add_argument("--strip", action="store_true", help='the inverse: write tokenizer model "none"')
    return p


def _run(args: argparse.Namespace) -> int:
    out = strip_vocab(args.src, args.dst) if args.strip else add_byte_vocab(args.src, args.dst)
    what = 'tokenizer model "none"' if args.strip else f"the RWKV byte vocabulary ({N_VOCAB} tokens)"
    logger.info("wrote %s with %s", out, what)
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return the exit code."""
    return run_command(PROG, _parser(), _run, argv)


if __name__ == "__main__":
    sys.exit(main())
