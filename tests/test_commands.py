"""Every console script goes through one front door (commands/common.py): ``--help`` exits 0,
a bad flag 2, a missing input file 2 with a message and no traceback; one map from exception
to exit code."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onebit_predict.checks.rounds import WorkerError
from onebit_predict.commands import stats
from onebit_predict.commands.common import CheckFailed, UsageError, exit_code, run_command
from onebit_predict.constants import EXIT_CHECK_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE
from onebit_predict.costmodel.expert_bytes import ModelError
from onebit_predict.costmodel.plot import PlotUnavailable
from onebit_predict.drive.emudrive import EmuDriveError, EmuDriveUnavailable
from onebit_predict.llama.drive import DriveError
from onebit_predict.llama.evict import EvictError
from onebit_predict.llama.paths import NotBuiltError
from onebit_predict.llama.runner import RunError
from onebit_predict.llama.tiny import TinyModelError
from onebit_predict.metrics.stats_kernel import StatsKernelError
from onebit_predict.trace import TraceError

REPO = Path(__file__).resolve().parent.parent


def console_scripts() -> dict[str, str]:
    """``[project.scripts]`` of pyproject.toml: name -> module:function."""
    section = re.search(
        r"^\[project\.scripts\].*?\n(.*?)(?:^\[|\Z)", (REPO / "pyproject.toml").read_text(), re.M | re.S
    )
    return dict(re.findall(r'^([\w-]+)\s*=\s*"([\w.:]+)"', section.group(1), re.M))


SCRIPTS = console_scripts()
# a command line of each command (and onebit-stats subcommand) whose input file does not exist
MISSING_INPUT = {
    "onebit-stats": ["{missing}"],
    "onebit-stats replay": ["replay", "{missing}", "--slots", "2"],
    "onebit-stats simulate": [
        "simulate",
        "{missing}",
        "--expert-bytes",
        "1MB",
        "--bandwidth",
        "3GB/s",
        "--layer-ms",
        "1",
    ],  # fmt: skip
    "onebit-trace": ["{missing}", "--mode", "router", "--out", "{tmp}/t.bin"],
    "onebit-bitident": ["{missing}"],
    "onebit-bench": ["{missing}"],
}


def entry(script: str):
    module, _, function = SCRIPTS[script.split()[0]].partition(":")
    return getattr(importlib.import_module(module), function)


def test_every_script_is_a_command_module():
    assert {"onebit-stats", "onebit-trace", "onebit-tiny", "onebit-bitident", "onebit-bench"} <= set(SCRIPTS)
    assert all(target.startswith("onebit_predict.commands.") for target in SCRIPTS.values())


@pytest.mark.parametrize("script", sorted(SCRIPTS) + ["onebit-stats replay", "onebit-stats simulate"])
def test_help_exits_0(script, run_cli):
    sub = script.split()[1:]
    rc, out, err = run_cli(entry(script), *sub, "--help")
    assert rc == EXIT_OK and "usage:" in out and err == ""
    assert "exit codes" in out


@pytest.mark.parametrize("script", sorted(SCRIPTS) + ["onebit-stats replay", "onebit-stats simulate"])
def test_bad_flag_exits_2(script, run_cli):
    rc, out, err = run_cli(entry(script), *script.split()[1:], "--no-such-flag")
    assert rc == EXIT_USAGE and out == ""
    assert "unrecognized arguments: --no-such-flag" in err or "required" in err


@pytest.mark.parametrize("script", sorted(MISSING_INPUT))
def test_missing_input_exits_2_with_a_message(script, run_cli, tmp_path):
    args = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in MISSING_INPUT[script]]
    rc, out, err = run_cli(entry(script), *args)
    assert rc == EXIT_USAGE and out == ""
    assert str(tmp_path / "missing") in err and "no such file" in err.lower()


@pytest.mark.parametrize("script", sorted({*MISSING_INPUT, "onebit-tiny"} & set(SCRIPTS)))
def test_console_script_as_a_process(script, tmp_path):
    """``python -m`` the module of each script: a missing input is exit 2, without a traceback."""
    module = SCRIPTS[script].partition(":")[0]
    args = MISSING_INPUT.get(script, ["--arch", "olmoe", "--out", "{tmp}/x.gguf", "--seed", "-1"])
    args = [a.format(missing=tmp_path / "missing", tmp=tmp_path) for a in args]
    done = subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == EXIT_USAGE and "Traceback" not in done.stderr
    assert done.stderr.startswith(f"{script}: ") or done.stderr.startswith("usage:")


@pytest.mark.parametrize(
    "exc, code",
    [
        (BrokenPipeError(), EXIT_OK),
        (CheckFailed("x"), EXIT_CHECK_FAILED),
        (WorkerError("x"), EXIT_CHECK_FAILED),
        (TinyModelError("x"), EXIT_CHECK_FAILED),
        (DriveError("x"), EXIT_CHECK_FAILED),
        (EvictError("x"), EXIT_CHECK_FAILED),
        (UsageError("x"), EXIT_USAGE),
        (NotBuiltError("x"), EXIT_USAGE),
        (TraceError("x"), EXIT_USAGE),
        (ModelError("x"), EXIT_USAGE),
        (RunError("x"), EXIT_USAGE),
        (StatsKernelError("x"), EXIT_USAGE),
        (PlotUnavailable("x"), EXIT_USAGE),
        (FileNotFoundError(2, "No such file or directory", "x"), EXIT_USAGE),
        (EmuDriveUnavailable("x"), EXIT_USAGE),  # a system package missing, as a missing build
        (EmuDriveError("x"), EXIT_CHECK_FAILED),
        (ValueError("x"), EXIT_USAGE),
        (KeyError("x"), None),  # a bug: no code, the traceback stays
    ],
)
def test_exception_map(exc, code):
    assert exit_code(exc) == code


@pytest.mark.parametrize("exc, code", [(NotBuiltError("run ./build.sh"), EXIT_USAGE), (CheckFailed("x"), 1)])
def test_run_command_maps_and_logs(exc, code, capsys):
    def body(_args: argparse.Namespace) -> int:
        raise exc

    assert run_command("onebit-x", argparse.ArgumentParser(prog="onebit-x"), body, []) == code
    assert capsys.readouterr().err == f"onebit-x: ERROR: {exc}\n"


def test_run_command_interrupted_is_one_line_and_130(capsys):
    """Ctrl-C: the command's finally blocks run, then one line and exit 130, never a traceback."""
    cleaned = []

    def body(_args: argparse.Namespace) -> int:
        try:
            raise KeyboardInterrupt
        finally:
            cleaned.append(True)

    try:
        rc = run_command("onebit-x", argparse.ArgumentParser(prog="onebit-x"), body, [])
    except KeyboardInterrupt:  # not through pytest: it would end the session
        pytest.fail("KeyboardInterrupt escaped run_command (a traceback, not exit 130)")
    assert rc == EXIT_INTERRUPTED == 130
    assert capsys.readouterr().err == "onebit-x: ERROR: interrupted\n" and cleaned == [True]


# a command run as from a terminal (SIGINT's default handler, whatever the test runner's disposition was)
AS_FROM_A_TERMINAL = (
    "import importlib, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "module, _, function = sys.argv[1].partition(':'); "
    "sys.exit(getattr(importlib.import_module(module), function)(sys.argv[2:]))"
)


def _blocked_in_open(pid: int, timeout_s: float = 10.0) -> None:
    """Until the process waits in the open of a FIFO (no writer yet): mid-run, where nothing would end it."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/wchan").read_text().strip() in ("fifo_open", "pipe_wait", "wait_for_partner"):
                return
        except OSError:
            pass
        time.sleep(0.05)
    time.sleep(1.0)  # /proc/PID/wchan unreadable here: give it time to get there


@pytest.mark.parametrize(
    "prog, argv", [("onebit-stats", ["{fifo}"]), ("onebit-stats replay", ["replay", "{fifo}", "--slots", "2"])]
)
def test_sigint_mid_run_is_one_line_and_130(prog, argv, tmp_path):
    """A real command (onebit-stats reading a trace that never comes: a FIFO without a writer), SIGINT
    mid-run: exit 130, one line, no traceback."""
    fifo = tmp_path / "t.bin"
    os.mkfifo(fifo)
    args = [a.format(fifo=fifo) for a in argv]
    proc = subprocess.Popen([sys.executable, "-c", AS_FROM_A_TERMINAL, SCRIPTS["onebit-stats"], *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    _blocked_in_open(proc.pid)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_INTERRUPTED and out == "", err
    assert err == f"{prog}: ERROR: interrupted\n"


def test_run_command_keeps_the_traceback_of_a_bug():
    def body(_args: argparse.Namespace) -> int:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        run_command("onebit-x", argparse.ArgumentParser(prog="onebit-x"), body, [])


@pytest.mark.parametrize(
    "argv, first",
    [
        (["T.bin"], "rates"),
        (["T.bin", "U.bin"], "rates"),  # the README's onebit-stats router.bin block.bin
        (["--json", "T.bin"], "rates"),
        (["rates", "T.bin"], "rates"),
        (["replay", "T.bin", "--slots", "2"], "replay"),
        (["simulate", "T.bin", "--bandwidth", "3GB/s"], "simulate"),
        (["plot-memory", "R.json"], "plot-memory"),
        (["replay"], "replay"),  # a subcommand's name is the subcommand, with or without its options
        (["replay", "--json"], "replay"),
        (["replay", "replay", "--slots", "2"], "replay"),
        (["simulate", "--json"], "simulate"),
        (["./replay"], "rates"),  # a trace named like a subcommand: given with a path
        (["./simulate", "--json"], "rates"),
        (["T.bin", "replay"], "rates"),  # only the first argument can name a subcommand
        (["--help"], "--help"),
        (["-h"], "-h"),
        ([], "rates"),
    ],
)
@pytest.mark.parametrize("files", [False, True])
def test_the_subcommand_rule(argv, first, files, tmp_path, monkeypatch):
    """The command line alone picks the subcommand: files named like one in the working directory
    change nothing."""
    monkeypatch.chdir(tmp_path)
    if files:
        for name in stats.SUBCOMMANDS:
            (tmp_path / name).write_bytes(b"")
    picked = stats.with_subcommand(argv)
    assert picked[0] == first if argv or first != "rates" else picked == ["rates"]
    assert picked[len(picked) - len(argv) :] == argv


def test_the_subcommands_are_the_parsers():
    sub = next(a for a in stats.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert tuple(sub.choices) == stats.SUBCOMMANDS
