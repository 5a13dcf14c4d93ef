"""What the onebit-stats subcommands share: logging to stderr, exit codes, a plain table.

``run_command(prog, parser, body, argv)`` parses ``argv`` (argparse usage errors and
``ValueError`` from ``type=`` callbacks become exit 2), logs ``prog: LEVEL: message`` to
stderr while ``body(args)`` runs, and turns a closed stdout (``| head``) into exit 0.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence

from .constants import EXIT_OK, EXIT_USAGE

logger = logging.getLogger("onebit_predict")


def run_command(prog: str, parser: argparse.ArgumentParser, body: Callable[[argparse.Namespace], int],
                argv: Sequence[str] | None) -> int:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{prog}: %(levelname)s: %(message)s"))
    logger.addHandler(handler)
    propagate, level = logger.propagate, logger.level
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # argparse: --help (0) or a usage error (2)
            return EXIT_OK if e.code in (0, None) else EXIT_USAGE
        try:
            return body(args)
        except BrokenPipeError:  # the reader (head, less) left: not an error of ours
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_OK
    finally:
        logger.removeHandler(handler)
        logger.propagate = propagate
        logger.setLevel(level)


def arg_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """An argparse ``type=`` that reports a parser's ValueError text as the usage error."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def comma_list(parse: Callable[[str], object]) -> Callable[[str], list]:
    """``4,8,16`` -> [parse('4'), parse('8'), parse('16')] (duplicates dropped, order kept)."""

    def convert(text: str) -> list:
        items = [s.strip() for s in text.split(",")]
        if not all(items):
            raise ValueError(f"'{text}' has an empty item")
        return list(dict.fromkeys(parse(s) for s in items))

    return convert


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"'{text}' is not a positive integer")
    return int(text)


def table(titles: list[str], rows: list[list[str]]) -> str:
    """Right-aligned columns, two spaces apart."""
    widths = [max(len(r[i]) for r in [titles, *rows]) for i in range(len(titles))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [titles, *rows])


def fmt(value: float | int | None, spec: str) -> str:
    """``-`` for None, else ``format(value, spec)``."""
    return "-" if value is None else format(value, spec)
