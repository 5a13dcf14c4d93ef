"""The room rule holds route-time reads off too (patch "route-time reads and the populate call").

Measured before the rule (docs/results.md, "Never a loss"): on the h256 model at read_ahead_kb 128
under a 16 MiB cgroup, route alone ran at 0.47x off, its workers' reads evicting what the compute
was about to touch. The test runs route under a tight limit (24 MiB, where the page cache holds
about 12 MiB of the 14 MB model; at 16 and 20 MiB a worker was OOM-killed in full suite runs,
a suite-order effect not reproduced alone) with the rule at its largest ratio (it must hold the route op off:
no routed expert looked at, nothing read) and without the rule (the same op looks at every routed
expert, reading what is missing): the rule is what decides."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from onebit_predict.commands.bench import main as bench_main
from onebit_predict.constants import EXIT_OK, PREFETCH_ROOM_MAX
from tests.test_bench_memory import _require_cgroup

pytestmark = pytest.mark.needs_build

H256 = Path(__file__).resolve().parent.parent / "models" / "qwen3moe-h256.gguf"


def test_the_room_rule_holds_route_off_under_a_tight_limit(tmp_path, capsys):
    _require_cgroup()
    model = tmp_path / H256.name  # a copy no other process maps
    shutil.copyfile(H256, model)
    held, free = f"route, room {PREFETCH_ROOM_MAX:g}", "route, room 0"
    argv = [str(model), "--memory-limit", "24MiB", "--rounds", "1", "--generate", "4", "--prompt", "8"]
    assert bench_main([*argv, "--threads", "1", "--rows", f"{held}; {free}", "--json"]) == EXIT_OK
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert (
        rows[held]["env"]["ONEBIT_MOE_PREFETCH_ROUTE"] == "1" and rows[free]["env"]["ONEBIT_MOE_PREFETCH_ROUTE"] == "1"
    )
    # held off: the op returned before looking at a routed expert (no byte counted, missing or
    # resident: no expert hit rate); without the rule it looked at every routed expert. Whether it
    # also found some missing depends on what the page cache kept under the limit: in a full suite
    # run it once kept them all (0 missing), so that is not what this test claims
    assert rows[held]["route_missing_per_token"] == 0 and rows[held]["decode"]["expert_hit"] is None
    assert rows[free]["decode"]["expert_hit"] is not None


def test_speculative_reads_held_off_give_the_experts_their_readahead_back(tmp_path, capsys):
    """With ONEBIT_MOE_PREFETCH_RANDOM=1 the expert tensors are advised random (readahead off) for the
    consumer's exact reads. Where the room rule holds speculative reads off (no route: the rule at its
    largest ratio in a 24 MiB cgroup), the compute thread faults the experts in itself, and with readahead
    off a page at a time: a build that left the advice on made 60.9 major faults a token there (patched off
    4.3 to 6.3), this one 8.5; at 25 % of the grown 2.7 MiB model that was 0.074x of off (docs/results.md,
    "readahead back where route holds off"). The route-time case is tests/test_prefetch.py's."""
    _require_cgroup()
    model = tmp_path / H256.name  # a copy no other process maps
    shutil.copyfile(H256, model)
    held = f"router + read, exact, room {PREFETCH_ROOM_MAX:g}"
    argv = [str(model), "--memory-limit", "24MiB", "--rounds", "1", "--generate", "8", "--prompt", "8"]
    assert bench_main([*argv, "--threads", "1", "--rows", held, "--json"]) == EXIT_OK
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert rows[held]["env"]["ONEBIT_MOE_PREFETCH_RANDOM"] == "1" and rows[held]["prefetched_experts"] == 0
    off = max(rows["patched off"]["major_faults_per_token"], 1.0)
    assert rows[held]["major_faults_per_token"] < 4 * off, (rows[held]["major_faults_per_token"], off)
