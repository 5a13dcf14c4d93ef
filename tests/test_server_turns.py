"""tools/server_turns.py's parts that need no server: the random-read advice it reads from smaps, the table
of medians and ratios, and its usage errors (exit 2, no traceback). Its timings are measured by the run,
never judged by a test."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from onebit_predict.constants import EXIT_USAGE
from onebit_predict.llama.evict import random_read_kib
from tools.server_turns import summary

REPO = Path(__file__).resolve().parent.parent
TOOL = REPO / "tools" / "server_turns.py"


@pytest.mark.skipif(not hasattr(mmap, "MADV_RANDOM"), reason="mmap.madvise has no MADV_RANDOM here")
def test_random_read_kib_counts_the_advised_mapping_only(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"\0" * (64 << 10))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert random_read_kib(path, os.getpid()) == 0
        m.madvise(mmap.MADV_RANDOM, 0, 32 << 10)  # half of it: the kernel splits the mapping there
        assert random_read_kib(path, os.getpid()) == 32
        assert random_read_kib(tmp_path / "other.gguf", os.getpid()) == 0


def run_of(config: str, prompt: float, after: float, requests: int, read_mib: float, error: str | None = None) -> dict:
    turn = {"decode_tok_s": 50.0, "prompt_tok_s": 0.0, "shmem_mib": 120, "read_requests": 100, "read_mib": 1.0}
    return {
        "config": config,
        "error": error,
        "turns": [
            turn,
            {**turn, "prompt_tok_s": prompt, "decode_tok_s": 0.0, "shmem_mib": 16, "read_requests": requests,
             "read_mib": read_mib},
            {**turn, "decode_tok_s": after},
        ],
    }  # fmt: skip


def table_rows(lines: list[str]) -> dict[str, list[str]]:
    """The table's rows by name, each split into its cells (the first cell keeps its leading bar)."""
    return {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in lines[2:]}


def test_summary_takes_medians_of_complete_runs_and_ratios_to_off():
    rounds = [
        [run_of("off", 50.0, 30.0, 1000, 250.0), run_of("keep anon", 40.0, 36.0, 2000, 250.0)],
        [run_of("keep anon", 45.0, 33.0, 1000, 250.0), run_of("off", 60.0, 20.0, 1000, 250.0)],
        [run_of("off", 55.0, 25.0, 1000, 250.0), run_of("keep anon", 99.0, 99.0, 1, 1.0, error="killed")],
    ]
    rows = table_rows(summary(rounds, ["off", "keep anon"]))
    assert rows["off"][1:6] == ["3", "50.00", "55.00", "25.00", "1.000"]
    # the killed run is left out: medians of two (40, 45 -> 42.5; 36, 33 -> 34.5), 1500 requests of 128 or 256 KiB
    assert rows["keep anon"][1:9] == ["2", "50.00", "42.50", "34.50", "0.773", "1.380", "1500", "192"]
    assert rows["keep anon"][9].rstrip(" |") == "120/16/120"


def test_summary_says_where_no_run_completed():
    lines = summary([[run_of("off", 50.0, 30.0, 1000, 250.0, error="killed")]], ["off"])
    assert lines[2].startswith("| off | 0 |")


def run_tool(*args: object) -> subprocess.CompletedProcess:
    """``python tools/server_turns.py ARGS``, with this checkout's package first on the path."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip


@pytest.mark.parametrize(
    "args, words",
    [(["--configs", "off;route"], "--configs takes"), (["--configs", ";"], "nothing to run")],
)
def test_bad_arguments_exit_2(tmp_path, args, words):
    p = run_tool(tmp_path / "m.gguf", "--limit-mib", "100", *args)
    assert p.returncode == EXIT_USAGE and words in p.stderr and "Traceback" not in p.stderr


def test_a_missing_model_exits_2_with_its_name(tmp_path):
    p = run_tool(tmp_path / "m.gguf", "--limit-mib", "100")
    assert p.returncode == EXIT_USAGE and "m.gguf" in p.stderr and "Traceback" not in p.stderr


def test_a_beside_row_is_compared_with_its_own_builds_off():
    rounds = [[run_of("off", 50.0, 30.0, 1000, 250.0), run_of("off, before", 25.0, 15.0, 1000, 250.0),
               run_of("keep anon, before", 25.0, 15.0, 1000, 250.0)]]  # fmt: skip
    rows = table_rows(summary(rounds, ["off", "off, before", "keep anon, before"]))
    assert rows["keep anon, before"][5:7] == ["1.000", "1.000"]
