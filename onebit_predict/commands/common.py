"""What every command shares: parent parsers, argument types, one table printer, one exit-code map.

Each console script is ``main(argv) -> int`` and calls :func:`run_command`, which parses
``argv``, logs ``prog: LEVEL: message`` to stderr while the command runs (``prog: message``
at INFO), and turns what the command raises into its exit code through :data:`EXIT_CODES`:

====  =====================================================================================
0     ok; also a closed stdout (``| head``: ``BrokenPipeError``) and ``--help``
1     a check failed: :class:`CheckFailed`, a failed worker, a tool that could not write
      its model, an eviction or drive measurement that does not work on this machine, an
      oracle run that did not route as its recorded trace
2     usage or input error: argparse's usage errors, :class:`UsageError`, a missing or
      unreadable file (``OSError``), a bad trace (``TraceError``) or model (``ModelError``),
      no patched build (``NotBuiltError``), llama.cpp refusing a model (``RunError``), the
      stats kernel that cannot be built (``StatsKernelError``), matplotlib missing for
      ``--plot``, a system package the emulated drive needs missing (``EmuDriveUnavailable``:
      the apt-get command in the message), any other ``ValueError`` raised on the command's input
130   interrupted (SIGINT, Ctrl-C: ``KeyboardInterrupt``): one line, ``prog: ERROR: interrupted``,
      never a traceback, after the command's ``finally`` blocks and context managers have run
====  =====================================================================================

A command returns EXIT_OK or EXIT_CHECK_FAILED itself when it finishes; anything not in
the map is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..checks.bench_memory import OracleMismatch
from ..checks.rounds import WorkerError
from ..constants import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from ..costmodel.plot import PlotUnavailable
from ..drive.emudrive import EmuDriveError, EmuDriveUnavailable
from ..gguf_experts import ModelError
from ..llama.cgroup import CgroupError
from ..llama.drive import DriveError
from ..llama.evict import EvictError
from ..llama.paths import NotBuiltError
from ..llama.runner import RunError
from ..llama.tiny import TinyModelError
from ..metrics.stats_kernel import StatsKernelError
from ..policy import layer_range
from ..trace import TraceError

logger = logging.getLogger("onebit_predict")
NO_EXTRA_BUFTS = "load the weights without llama.cpp's extra buffer types (AMX, repacking): the plain CPU kernels"


class UsageError(ValueError):
    """The command line asks for something the command cannot do (exit 2)."""


class CheckFailed(RuntimeError):
    """The check ran and failed (exit 1)."""


# First match wins: subclasses before their bases (BrokenPipeError is an OSError, TraceError
# and ModelError are ValueErrors).
EXIT_CODES: tuple[tuple[type[BaseException], int], ...] = (
    (BrokenPipeError, EXIT_OK),
    (CheckFailed, EXIT_CHECK_FAILED),
    (WorkerError, EXIT_CHECK_FAILED),
    (OracleMismatch, EXIT_CHECK_FAILED),  # the oracle run did not route as its recorded trace
    (TinyModelError, EXIT_CHECK_FAILED),
    (DriveError, EXIT_CHECK_FAILED),
    (EvictError, EXIT_CHECK_FAILED),
    (EmuDriveUnavailable, EXIT_USAGE),  # a system package missing (libfuse3, fio), as a missing build
    (EmuDriveError, EXIT_CHECK_FAILED),  # the emulated drive would not mount, answer or stop
    (UsageError, EXIT_USAGE),
    (CgroupError, EXIT_USAGE),  # no memory cgroup can be made here: onebit-bench --memory-limit says why
    (NotBuiltError, EXIT_USAGE),
    (TraceError, EXIT_USAGE),
    (ModelError, EXIT_USAGE),
    (RunError, EXIT_USAGE),
    (StatsKernelError, EXIT_USAGE),
    (PlotUnavailable, EXIT_USAGE),
    (OSError, EXIT_USAGE),
    (ValueError, EXIT_USAGE),
)


def exit_code(exc: BaseException) -> int | None:
    """The exit code of an exception (EXIT_CODES), or None when it is not a known failure."""
    return next((code for cls, code in EXIT_CODES if isinstance(exc, cls)), None)


class _Formatter(logging.Formatter):
    """``prog: message`` at INFO, ``prog: LEVEL: message`` above it."""

    def __init__(self, prog: str) -> None:
        super().__init__()
        self.prog = prog

    def format(self, record: logging.LogRecord) -> str:
        level = "" if record.levelno == logging.INFO else f"{record.levelname}: "
        return f"{self.prog}: {level}{record.getMessage()}"


def run_command(
    prog: str,
    parser: argparse.ArgumentParser,
    body: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None,
) -> int:
    """Parse argv, run body(args) with logging to stderr; map what it raises to an exit code."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter(prog))
    # a command run inside another (onebit-trace --stats) logs under its own name, once
    handlers, logger.handlers = logger.handlers, [handler]
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
        except KeyboardInterrupt:  # Ctrl-C: what the command changed is put back (finally blocks ran)
            logger.error("interrupted")
            return EXIT_INTERRUPTED
        except Exception as e:  # noqa: BLE001 - mapped below, re-raised when unknown
            code = exit_code(e)
            if code is None:
                raise
            logger.error("%s", e)
            return code
    finally:
        logger.handlers = handlers
        logger.propagate = propagate
        logger.setLevel(level)


# --- argument types ---------------------------------------------------------------------


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


def unique_list(parse: Callable[[str], object]) -> Callable[[str], list]:
    """``native,nvme`` -> [parse('native'), parse('nvme')]; ValueError on an item given twice (after
    parsing: ``128,0128`` is one value twice), for the lists whose every item is a run of its own."""

    def convert(text: str) -> list:
        items = [s.strip() for s in text.split(",")]
        if not all(items):
            raise ValueError(f"'{text}' has an empty item")
        values = [parse(s) for s in items]
        for i, v in enumerate(values):
            if v in values[:i]:
                raise ValueError(f"'{text}' gives {v} twice (each value is a run of its own)")
        return values

    return convert


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise ValueError(f"'{text}' is not a positive integer")
    return int(text)


def nonneg_float(text: str) -> float:
    """A finite number >= 0 (ValueError with the reason otherwise)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"'{text}' is not a number") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"'{text}' is not a finite number >= 0")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0 (ValueError with the reason otherwise)."""
    if nonneg_float(text) == 0:
        raise ValueError(f"'{text}' is not a finite number > 0")
    return float(text)


def layer_list(text: str) -> frozenset[int]:
    """``1,3-5`` -> {1, 3, 4, 5}: the one layer-list parser of the commands' ``--layers``.

    Each item is read by ``policy.layer_range`` (the grammar of ONEBIT_MOE_PREDICT_LAYERS);
    where the policy warns and ignores an item, a command refuses it (ArgumentTypeError).
    """
    layers: set[int] = set()
    for raw in text.split(","):
        item = raw.strip()
        bounds = layer_range(item)
        if bounds is None:
            raise argparse.ArgumentTypeError(f"'{item}' is not N or A-B")
        first, last = bounds
        if first > last:
            raise argparse.ArgumentTypeError(f"'{item}' is a reversed range")
        layers.update(range(first, last + 1))
    return frozenset(layers)


def check_layers(layers: frozenset[int] | None, n_layer: int, path: object) -> None:
    """UsageError when ``--layers`` names a layer the trace at ``path`` does not have."""
    beyond = sorted(x for x in layers or () if x >= n_layer)
    if beyond:
        raise UsageError(f"--layers {beyond}: {path} has layers 0..{n_layer - 1}")


# --- parent parsers: the arguments several commands have ------------------------------------


def output_parent(*, csv: bool = True) -> argparse.ArgumentParser:
    """``--json`` (and ``--csv``, exclusive with it): the machine-readable forms on stdout."""
    p = argparse.ArgumentParser(add_help=False)
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="write JSON to stdout")
    if csv:
        out.add_argument("--csv", action="store_true", help="write CSV to stdout")
    return p


def trace_parent(*, many: bool = False) -> argparse.ArgumentParser:
    """The TRACE positional (``many``: one or more, as ``traces``)."""
    p = argparse.ArgumentParser(add_help=False)
    if many:
        p.add_argument("traces", nargs="+", metavar="TRACE", help="trace files written with ONEBIT_MOE_PREDICT_OUT")
    else:
        p.add_argument("trace", metavar="TRACE", help="a trace file written with ONEBIT_MOE_PREDICT_OUT")
    return p


def layers_parent() -> argparse.ArgumentParser:
    """``--layers LIST``: only these layers of the trace (layer_list)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--layers", type=layer_list, metavar="LIST", help="only these layers, e.g. 1,3-5")
    return p


def model_parent(*, optional: bool = False, extra_bufts: bool = False) -> argparse.ArgumentParser:
    """The MODEL.gguf positional of the commands that run llama.cpp (``optional``: None where not given,
    for a command with an option that needs none; ``extra_bufts``: and ``--no-extra-bufts``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("model", type=Path, metavar="MODEL.gguf", nargs="?" if optional else None, help="the GGUF to run")
    if extra_bufts:  # use_extra_bufts = false: quantized weights in the AMX buffer fault on some VMs
        p.add_argument("--no-extra-bufts", action="store_true", help=NO_EXTRA_BUFTS)
    return p


def require_file(path: Path, what: str = "") -> None:
    """UsageError ``PATH: no such file`` unless path is a file."""
    if not path.is_file():
        raise UsageError(f"{what}{path}: no such file")


EPILOG = "exit codes: 0 ok, 1 check failed, 2 usage or input error"


# --- output --------------------------------------------------------------------------------


def table(titles: list[str], rows: list[list[str]]) -> str:
    """Right-aligned columns, two spaces apart: the one table printer of the commands."""
    widths = [max(len(r[i]) for r in [titles, *rows]) for i in range(len(titles))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in [titles, *rows])


def fmt(value: float | int | None, spec: str) -> str:
    """``-`` for None, else ``format(value, spec)``."""
    return "-" if value is None else format(value, spec)
