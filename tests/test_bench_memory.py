"""onebit-bench --memory-limit: the limits it takes, the cgroup it makes (or why it cannot), and one
real run of every configuration confined to a memory cgroup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onebit_predict.checks.bench_memory import (
    ORACLE,
    RESIDENT,
    MemoryRow,
    OracleMismatch,
    check_oracle,
    consumer_off_of,
    markdown_memory,
    memory_configs,
)
from onebit_predict.commands.bench import _limits
from onebit_predict.commands.bench import main as bench_main
from onebit_predict.commands.common import UsageError
from onebit_predict.constants import EXIT_OK, EXIT_USAGE
from onebit_predict.llama import cgroup
from onebit_predict.llama.cgroup import CgroupError, MemoryCgroup
from onebit_predict.trace import TraceHeader
from onebit_predict.trace_writer import TraceWriter

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "qwen3moe-tiny.gguf"


def test_limits_are_shares_of_the_expert_bytes_or_sizes():
    assert _limits(["50%", "25%"], 1 << 30) == [1 << 29, 1 << 28]
    assert _limits(["resident", "50%"], 1 << 30) == [RESIDENT, 1 << 29]
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
    names = [c.name for c in memory_configs(tmp_path, 16)]
    assert names == ["patched off", "router", "router + advise", "router + read", "block", "block + advise",
                     "block + read", "block + advise, guard 4", "block + advise, room 0", "block + advise, depth 16",
                     "block + advise, depth 16, room 0", "oracle + advise"]  # fmt: skip
    # never a loss compares each consumer with the same predictor, consumer off
    assert [consumer_off_of(n) for n in names] == ["patched off", "router", "router", "router", "block", "block",
                                                  "block", "block", "block", "block", "block", "router"]  # fmt: skip
    # the qualifiers are what the configurations run with
    env = {c.name: c.env for c in memory_configs(tmp_path, 16)}
    assert env["block + advise, guard 4"]["ONEBIT_MOE_PREFETCH_GUARD"] == "4"
    assert env["block + advise, room 0"]["ONEBIT_MOE_PREFETCH_ROOM"] == "0"
    assert env["block + advise, depth 16, room 0"]["ONEBIT_MOE_PREDICT_DEPTH"] == "16"
    assert "ONEBIT_MOE_PREFETCH_ROOM" not in env["block + advise"]  # the default: the rule on
    row = MemoryRow(64 << 20, "block + advise", 2.0, 1.5, 2.5, 1.25, 1.1, 3.5, 40.0, 0.2, 0.8, 0.8, 5, 1 << 20, 0, 0, 0)
    resident = MemoryRow(RESIDENT, "block + advise", 9.0, 9.0, 9.0, 1.0, 0.995, 0, 0, 0, 0.8, 0.8, 5, 1 << 20, 0, 0, 0)
    text = markdown_memory([row, resident], "header")
    assert (
        "| 64 | block + advise | 2.00 | 1.50 | 2.50 | 1.250 | 1.100 | 3.50 | 40.0 | 20.0% | 80.0% | 5 | 1.0 | 0.0 | 0 |"
        in text
    )
    assert "| resident | block + advise | 9.00 |" in text


def test_oracle_configuration_reads_the_recorded_trace(tmp_path):
    oracle = next(c for c in memory_configs(tmp_path, 16) if c.name == ORACLE)
    assert oracle.env["ONEBIT_MOE_PREFETCH_DEBUG_ORACLE"] == str(tmp_path / "oracle-source.bin")
    assert oracle.env["ONEBIT_MOE_PREFETCH_GUARD"] == "0" and oracle.env["ONEBIT_MOE_PREFETCH"] == "advise"
    assert oracle.env["ONEBIT_MOE_PREFETCH_ROOM"] == "0"  # the upper bound: issued whatever the room


def _trace(path, routes):
    header = TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=2, depth=2)
    with TraceWriter(path, header) as w:
        for pos, (a, b) in enumerate(routes):
            w.add(step=pos, seq_id=0, pos=pos, layer=0, actual=a)
            w.add(step=pos, seq_id=0, pos=pos, layer=1, actual=b)
    return path


def test_oracle_run_must_route_as_its_source(tmp_path):
    source = _trace(tmp_path / "s.bin", [([0, 1], [2, 3]), ([1, 2], [0, 3])])
    check_oracle(source, _trace(tmp_path / "same.bin", [([0, 1], [2, 3]), ([1, 2], [0, 3])]))
    with pytest.raises(OracleMismatch, match="1 routed differently"):
        check_oracle(source, _trace(tmp_path / "other.bin", [([0, 1], [2, 3]), ([1, 2], [0, 1])]))
    with pytest.raises(OracleMismatch, match="2 row"):
        check_oracle(source, _trace(tmp_path / "longer.bin", [([0, 1], [2, 3]), ([1, 2], [0, 3]), ([0, 1], [2, 3])]))


@pytest.mark.needs_build
def test_every_configuration_runs_in_a_cgroup(capsys):
    try:
        MemoryCgroup("onebit-test-probe", 64 << 20).remove()
    except CgroupError as e:
        pytest.skip(f"no memory cgroup here: {e}")
    argv = [str(MODEL), "--memory-limit", "64MiB", "--rounds", "1", "--generate", "4", "--prompt", "8", "--json"]
    assert bench_main(argv) == EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["memory_limits"] == [64 << 20] and len(doc["rows"]) == 12
    for row in doc["rows"]:
        assert row["median_tok_s"] > 0 and row["read_mib_per_token"] >= 0
        assert (row["read_recall"] is None) == (row["name"] == "patched off")
        # each row carries the knobs it ran with, for the cost model (simulate --measured)
        assert "ONEBIT_MOE_PREDICT_OUT" not in row["env"]
        assert (row["env"].get("ONEBIT_MOE_PREFETCH_ROOM") == "0") == (
            row["name"].endswith("room 0") or row["name"] == "oracle + advise"
        )
