"""onebit-bench --memory-limit: the limits it takes, the cgroup it makes (or why it cannot), and one
real run of every configuration confined to a memory cgroup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onebit_predict.checks.bench_memory import MemoryRow, markdown_memory, memory_configs
from onebit_predict.commands.bench import _limits
from onebit_predict.commands.bench import main as bench_main
from onebit_predict.commands.common import UsageError
from onebit_predict.constants import EXIT_OK, EXIT_USAGE
from onebit_predict.llama import cgroup
from onebit_predict.llama.cgroup import CgroupError, MemoryCgroup

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "qwen3moe-tiny.gguf"


def test_limits_are_shares_of_the_expert_bytes_or_sizes():
    assert _limits(["50%", "25%"], 1 << 30) == [1 << 29, 1 << 28]
    assert _limits(["160MiB"], 1 << 30) == [160 << 20]
    for bad in ("half", "5%"):  # not a limit; 5 % of 256 MiB is under the 16 MiB a process needs
        with pytest.raises(UsageError):
            _limits([bad], 256 << 20)


def test_no_cgroup_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroup, "ROOT", tmp_path)  # neither v1 memory/ nor a v2 memory controller
    monkeypatch.setattr(cgroup.os, "geteuid", lambda: 0)
    with pytest.raises(CgroupError, match="no memory cgroup controller"):
        MemoryCgroup("x", 64 << 20)
    monkeypatch.setattr(cgroup.os, "geteuid", lambda: 1000)
    with pytest.raises(CgroupError, match="needs root"):
        MemoryCgroup("x", 64 << 20)


def test_v2_cgroup_gets_memory_max(tmp_path, monkeypatch):
    (tmp_path / "cgroup.controllers").write_text("cpu io memory pids\n")
    monkeypatch.setattr(cgroup, "ROOT", tmp_path)
    monkeypatch.setattr(cgroup.os, "geteuid", lambda: 0)
    group = MemoryCgroup("run", 64 << 20)
    assert (tmp_path / "run" / "memory.max").read_text() == str(64 << 20)
    (tmp_path / "run" / "memory.max").unlink()  # a real cgroup's files vanish with it
    group.remove()
    assert not (tmp_path / "run").exists()


def test_cold_and_memory_limit_are_two_settings(capsys):
    assert bench_main([str(MODEL), "--cold", "--memory-limit", "50%"]) == EXIT_USAGE
    assert "give one" in capsys.readouterr().err


def test_table_has_a_row_per_configuration_and_limit(tmp_path):
    names = [c.name for c in memory_configs(tmp_path)]
    assert names == ["patched off", "router", "router + advise", "router + read", "block", "block + advise",
                     "block + read"]  # fmt: skip
    row = MemoryRow(64 << 20, "block + advise", 2.0, 1.5, 2.5, 1.25, 3.5, 40.0, 0.2, 0.8, 0.8, 5, 1 << 20, 0, 0, 0)
    text = markdown_memory([row], "header")
    assert (
        "| 64 | block + advise | 2.00 | 1.50 | 2.50 | 1.250 | 3.50 | 40.0 | 20.0% | 80.0% | 5 | 1.0 | 0.0 | 0 |" in text
    )


@pytest.mark.needs_build
def test_every_configuration_runs_in_a_cgroup(capsys):
    try:
        MemoryCgroup("onebit-test-probe", 64 << 20).remove()
    except CgroupError as e:
        pytest.skip(f"no memory cgroup here: {e}")
    argv = [str(MODEL), "--memory-limit", "64MiB", "--rounds", "1", "--generate", "4", "--prompt", "8", "--json"]
    assert bench_main(argv) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["memory_limits"] == [64 << 20] and len(doc["rows"]) == 7
    for row in doc["rows"]:
        assert row["median_tok_s"] > 0 and row["read_mib_per_token"] >= 0
        assert (row["read_recall"] is None) == (row["name"] == "patched off")
