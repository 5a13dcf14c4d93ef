"""What the expert-cache commands (onebit-stats replay and simulate) share: the trace header's
summary in their --json, and their ``--lfru-window`` argument."""

from __future__ import annotations

import argparse

from ..constants import LFRU_WINDOW_DEFAULT
from ..trace import TraceHeader
from .common import arg_type, positive_int


def header_summary(h: TraceHeader) -> dict[str, object]:
    """The trace header fields the cache commands (replay, simulate) put in their --json."""
    return {
        "arch": h.arch,
        "model": h.model,
        "mode": h.mode_name,
        "n_layer": h.n_layer,
        "n_expert": h.n_expert,
        "n_expert_used": h.n_expert_used,
        "depth": h.depth,
    }


def add_lfru_window(p: argparse.ArgumentParser) -> None:
    """``--lfru-window T``, as the cache commands (replay, simulate) take it."""
    p.add_argument(
        "--lfru-window",
        type=arg_type(positive_int),
        default=LFRU_WINDOW_DEFAULT,
        metavar="T",
        help=f"tokens over which lfru counts uses (default {LFRU_WINDOW_DEFAULT})",
    )
