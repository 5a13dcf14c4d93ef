"""onebit-stats replay: LRU / LFRU / Belady by hand, prefetch charged vs protected, Belady as
the ceiling (a property), the command's outputs and exit codes, and a real trace.

Rules: onebit_predict/costmodel/replay.py and docs/cost-model.md ("The cache").
"""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from onebit_predict.commands.stats import main as stats_main
from onebit_predict.commands.trace import main as trace_main
from onebit_predict.constants import EXIT_OK, EXIT_USAGE, MODE_ROUTER
from onebit_predict.costmodel.replay import KIND_DEMAND, KIND_PREFETCH, CacheConfig, replay_layer
from onebit_predict.costmodel.routing import load_routing
from onebit_predict.metrics.stats import compute_stats
from onebit_predict.trace import Trace, TraceHeader
from onebit_predict.trace_writer import TraceWriter

REPO = Path(__file__).resolve().parent.parent


def col(ids: list[int]) -> np.ndarray:
    """A top-1 demand (or prediction) sequence as an (n, 1) array; -1 is 'no prediction'."""
    return np.array(ids, dtype=np.int32)[:, None]


def hits(demand, policy, slots, pred=None, prefetch="none", window=32) -> int:
    return replay_layer(demand, pred, CacheConfig(slots, policy, prefetch, window)).counts.hits


# --- the policies by hand -------------------------------------------------------------------


def test_policies_by_hand_scan():
    # 0 1 2 0 1 3 0, 2 slots.
    # lru: every access misses (each expert comes back just after it was evicted): 0 hits.
    # belady: at 2 evict 1 (0 is needed at 3, 1 at 4) -> {0,2}; 0 hit; at 1 evict 2 (never
    #   again) -> {0,1}; at 3 evict 1 (never again) -> {0,3}; 0 hit: 2 hits.
    # lfru: counts tie at 1 until 0 comes back; it evicts 0,1,2,0,3 in turn: 0 hits.
    d = col([0, 1, 2, 0, 1, 3, 0])
    assert hits(d, "lru", 2) == 0
    assert hits(d, "belady", 2) == 2
    assert hits(d, "lfru", 2) == 0


def test_policies_by_hand_frequency():
    # 0 0 0 1 2 0, 2 slots. At 2 the residents are 0 (3 uses, used at t2) and 1 (1 use, at t3).
    # lru evicts 0 (least recent) and misses it at t5: hits t1, t2 = 2.
    # lfru evicts 1 (fewest uses in the window) and hits 0 at t5: 3.
    # belady evicts 1 (never used again): 3. lfru with a window of 1 token is lru: 2.
    d = col([0, 0, 0, 1, 2, 0])
    assert hits(d, "lru", 2) == 2
    assert hits(d, "lfru", 2) == 3
    assert hits(d, "belady", 2) == 3
    assert hits(d, "lfru", 2, window=1) == 2


def test_every_expert_of_a_token_stays_resident():
    # top-2, 2 slots: the cache holds exactly the last token's experts, whatever the policy
    d = np.array([[0, 1], [1, 2], [2, 0], [0, 1]], dtype=np.int32)
    for policy in ("lru", "lfru", "belady"):
        r = replay_layer(d, None, CacheConfig(2, policy))
        assert r.counts.hits == 3  # 1, 2, 0: the expert shared with the previous token
        assert r.hit.tolist() == [[False, False], [True, False], [True, False], [True, False]]


def test_belady_ties_go_to_the_least_recently_used():
    # 3 slots, top-1: 0 1 2 3 ...: at 3, 0, 1 and 2 are never used again; evict 0 (oldest)
    d = col([0, 1, 2, 3, 1])
    r = replay_layer(d, None, CacheConfig(3, "belady"))
    assert r.counts.hits == 1
    # the read schedule: one demand read per miss, in order; the hit at t4 is served by read 1
    assert r.load_expert.tolist() == [0, 1, 2, 3]
    assert r.load_kind.tolist() == [KIND_DEMAND] * 4
    assert r.serve[:, 0].tolist() == [0, 1, 2, 3, 1]


# --- prefetch: charged (trace) vs free (protect) -------------------------------------------


def test_prefetch_charged_vs_protected():
    # demand 0 1 2 0, 2 slots, lru; the prediction for t2 and t3 is expert 0.
    # none:    t2 evicts 0 (least recent), t3 misses it: 0 hits, 4 reads.
    # protect: at t2, 0 is predicted and resident, so 1 is evicted instead; t3 hits: 1 hit,
    #          3 reads, nothing read for the prediction.
    # trace:   at t2 the predicted 0 is resident: nothing to read, and no protection, so
    #          t2 evicts 0; at t3 the prediction reads 0 back (evicting 1, the least recent)
    #          and the demand hits: 1 hit, 3 demand reads + 1 useful prefetch read.
    d = col([0, 1, 2, 0])
    p = col([-1, -1, 0, 0])
    none = replay_layer(d, p, CacheConfig(2, "lru", "none")).counts
    protect = replay_layer(d, p, CacheConfig(2, "lru", "protect")).counts
    trace = replay_layer(d, p, CacheConfig(2, "lru", "trace")).counts
    assert (none.hits, none.demand_reads, none.prefetch_reads) == (0, 4, 0)
    assert (protect.hits, protect.demand_reads, protect.prefetch_reads) == (1, 3, 0)
    assert (trace.hits, trace.demand_reads, trace.prefetch_reads, trace.prefetch_useful) == (1, 3, 1, 1)


def test_prefetch_charged_occupies_slots_and_wastes_reads():
    # demand 0 1 0 2 0, predictions - 3 0 2 1, 2 slots, lru (docs/cost-model.md walks it):
    # t0: 0 miss {0}.  t1: prefetch 3 (wasted) {0,3}; 1 miss evicts 0 -> {3,1}.
    # t2: prefetch 0 evicts 3 -> {1,0}; 0 hit.  t3: prefetch 2 evicts 1 -> {0,2}; 2 hit.
    # t4: prefetch 1 (wasted) evicts 0 -> {2,1}; 0 miss evicts 2 -> {1,0}.
    d = col([0, 1, 0, 2, 0])
    p = col([-1, 3, 0, 2, 1])
    r = replay_layer(d, p, CacheConfig(2, "lru", "trace"))
    c = r.counts
    assert (c.hits, c.demand_reads, c.prefetch_reads, c.prefetch_useful, c.prefetch_wasted) == (2, 3, 4, 2, 2)
    assert r.load_expert.tolist() == [0, 3, 1, 0, 2, 1, 0]
    assert r.load_kind.tolist() == [
        KIND_DEMAND,
        KIND_PREFETCH,
        KIND_DEMAND,
        KIND_PREFETCH,
        KIND_PREFETCH,
        KIND_PREFETCH,
        KIND_DEMAND,
    ]
    assert r.n_prefetch.tolist() == [0, 1, 1, 1, 1]
    assert r.start.tolist() == [0, 1, 3, 4, 5, 7]
    # the same predictions only protected: never read, and here they change nothing
    free = replay_layer(d, p, CacheConfig(2, "lru", "protect")).counts
    assert (free.hits, free.reads) == (2, 3)


def test_prefetch_is_capped_at_the_slots():
    # depth 3 predictions into 2 slots: only the best 2 are read
    d = col([5, 1])
    p = np.array([[-1, -1, -1], [1, 2, 3]], dtype=np.int32)
    r = replay_layer(d, p, CacheConfig(2, "lru", "trace"))
    assert r.load_expert.tolist() == [5, 1, 2]
    assert r.counts.hits == 1


def test_cold_empties_the_cache_before_every_token():
    """The charged-vs-protected example (demand 0 1 2 0, 2 slots, lru, P = - - 0 0), cold:
    none and protect miss every demand (4 reads, 0 hits); trace reads 0 at t2 (wasted: t2
    demands 2) and again at t3 (the cache was emptied), where it is the only hit: 1 hit,
    3 demand reads, 2 prefetch reads, 1 useful."""
    d = col([0, 1, 2, 0])
    p = col([-1, -1, 0, 0])
    for prefetch in ("none", "protect"):
        c = replay_layer(d, p, CacheConfig(2, "lru", prefetch, cold=True)).counts
        assert (c.hits, c.demand_reads, c.prefetch_reads) == (0, 4, 0)
    r = replay_layer(d, p, CacheConfig(2, "lru", "trace", cold=True))
    c = r.counts
    assert (c.hits, c.demand_reads, c.prefetch_reads, c.prefetch_useful) == (1, 3, 2, 1)
    assert r.load_expert.tolist() == [0, 1, 0, 2, 0]
    assert r.hit[:, 0].tolist() == [False, False, False, True]


def test_slots_below_n_used_are_refused():
    with pytest.raises(ValueError, match="at least n_expert_used"):
        replay_layer(np.array([[0, 1]], dtype=np.int32), None, CacheConfig(1))
    with pytest.raises(ValueError, match="at least 1"):
        CacheConfig(0)


# --- Belady is the ceiling ----------------------------------------------------------------


@st.composite
def layer_routing(draw):
    n_expert = draw(st.integers(2, 10))
    n_used = draw(st.integers(1, min(3, n_expert)))
    n = draw(st.integers(1, 60))
    rows = [draw(st.permutations(range(n_expert)))[:n_used] for _ in range(n)]
    preds = [draw(st.permutations(range(n_expert)))[:n_used] for _ in range(n)]
    slots = draw(st.integers(n_used, n_expert + 1))
    window = draw(st.integers(1, 8))
    return np.array(rows, dtype=np.int32), np.array(preds, dtype=np.int32), slots, window


@settings(max_examples=300, deadline=None)
@given(layer_routing())
def test_belady_is_at_least_every_demand_policy(case):
    d, p, slots, window = case
    best = hits(d, "belady", slots)
    for policy in ("lru", "lfru"):
        assert best >= hits(d, policy, slots, window=window)
        # protecting predictions is still demand caching: Belady bounds it too
        assert best >= hits(d, policy, slots, pred=p, prefetch="protect", window=window)
    assert best >= hits(d, "belady", slots, pred=p, prefetch="protect")


@settings(max_examples=100, deadline=None)
@given(layer_routing())
def test_replay_invariants(case):
    d, p, slots, window = case
    for policy in ("lru", "lfru", "belady"):
        for prefetch in ("none", "trace", "protect"):
            r = replay_layer(d, p, CacheConfig(slots, policy, prefetch, window))
            c = r.counts
            assert c.hits + c.demand_reads == c.demand == d.size
            assert c.prefetch_useful <= c.prefetch_reads
            assert c.prefetch_reads == 0 or prefetch == "trace"
            # every demanded expert is served by a read of that expert
            assert (r.load_expert[r.serve] == d).all()
            assert len(r.load_expert) == c.reads


@settings(max_examples=100, deadline=None)
@given(layer_routing())
def test_cold_hits_are_the_same_tokens_prefetches(case):
    """Cold: no demand hits without a charged prefetch; with one, a demanded expert hits
    exactly when it is among the prediction's first ``slots`` ids, whatever the policy."""
    d, p, slots, window = case
    for policy in ("lru", "lfru", "belady"):
        for prefetch in ("none", "protect"):
            c = replay_layer(d, p, CacheConfig(slots, policy, prefetch, window, cold=True)).counts
            assert c.hits == 0 and c.demand_reads == d.size
        r = replay_layer(d, p, CacheConfig(slots, policy, "trace", window, cold=True))
        assert r.hit.tolist() == [[e in row[:slots] for e in dr] for dr, row in zip(d.tolist(), p.tolist())]
        assert r.counts.hits == r.counts.prefetch_useful


# --- the command --------------------------------------------------------------------------

# One sequence: a prefill row at pos 0, then decode pos 1..5; 3 layers, 4 experts, top-1,
# depth 1; layer 1 and 2 predicted.
ACTUAL = {0: [0, 1, 2, 0, 1, 3], 1: [0, 0, 0, 1, 2, 0], 2: [3, 3, 2, 3, 2, 3]}
PRED = {1: [None, 0, 1, 1, 2, 0], 2: [None, 3, 2, 2, 2, 3]}


def make(path: Path) -> Path:
    h = TraceHeader.build(
        n_layer=3, n_expert=4, n_expert_used=1, depth=1, mode=MODE_ROUTER, layers={1, 2}, arch="qwen3moe", model="hand"
    )
    with TraceWriter(path, h) as w:
        for pos in range(6):
            for layer in range(3):
                pred = PRED[layer][pos] if layer in PRED and pos > 0 else None
                w.add(
                    step=pos,
                    seq_id=0,
                    pos=pos,
                    layer=layer,
                    actual=[ACTUAL[layer][pos]],
                    pred=None if pred is None else [pred],
                    decode=pos > 0,
                )
    return path


@pytest.fixture
def hand(tmp_path):
    return make(tmp_path / "hand.trace")


@pytest.fixture
def run(run_cli):
    """``run(*args)``: onebit-stats replay with args (exit code, stdout, stderr)."""
    return lambda *args: run_cli(stats_main, "replay", *args)


def test_routing_skips_prefill_and_finds_the_previous_token(hand):
    routing = load_routing(Trace.open(hand))
    assert routing.n_tokens == 5
    lr = routing.layers[1]
    assert lr.actual[:, 0].tolist() == [0, 0, 1, 2, 0]
    assert lr.prev[:, 0].tolist() == [0, 0, 0, 1, 2]  # pos 1's previous token is the prefill row
    assert lr.trace_pred[:, 0].tolist() == [0, 1, 1, 2, 0]
    assert routing.layers[0].trace_pred.tolist() == [[-1]] * 5


def test_table_json_csv(capsys, hand, run):
    rc, out, _ = run(hand, "--slots", "1,2", "--policy", "lru,belady")
    assert rc == EXIT_OK
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()[3:]}
    # layer 0 (decode rows only): 1 2 0 1 3. lru@1: 0 hits; lru@2: {1,2} -> 0 miss evicts 1,
    # 1 miss evicts 2, 3 miss evicts 0: 0 hits; belady@2: 0 evicts 2 (never again), 1 hit: 1/5
    assert rows["0"][:2] == ["5", "-"]
    assert rows["0"][2:10] == ["0.0", "1.00", "0.0", "1.00", "0.0", "1.00", "20.0", "0.80"]
    rc, out, _ = run(hand, "--slots", "2", "--policy", "belady", "--json")
    report = json.loads(out)
    assert rc == EXIT_OK and report["tokens"] == 5 and report["predicted_layers"] == [1, 2]
    res = report["results"][0]
    assert (res["policy"], res["slots"], res["prefetch"]) == ("belady", 2, "none")
    assert [x["layer"] for x in res["layers"]] == [0, 1, 2]
    assert res["layers"][0]["hits"] == 1 and res["total"]["demand"] == 15
    rc, out, _ = run(hand, "--slots", "1", "--prefetch", "trace", "--csv")
    table = list(csv.DictReader(io.StringIO(out)))
    assert [r["layer"] for r in table] == ["0", "1", "2", "total"]
    # 1 slot, charged prefetch: the cache holds the prediction, a hit is a right prediction
    # layer 1, pos 1..5: actual 0 0 1 2 0, predicted 0 1 1 2 0: right but at pos 2 (4 hits);
    # every prediction is read (5), as the one slot never holds the next prediction already
    assert table[1]["hits"] == "4" and table[1]["prefetch_reads"] == "5"


def test_cold_option(capsys, hand, run):
    # 2 slots, no prefetch, cold: every demand misses (15 reads for 5 tokens x 3 layers)
    rc, out, err = run(hand, "--slots", "2", "--cold", "--json")
    res = json.loads(out)["results"][0]
    assert rc == EXIT_OK and res["cold"] is True and res["total"]["hits"] == 0 and res["total"]["reads"] == 15
    rc, out, _ = run(hand, "--slots", "2", "--json")
    assert json.loads(out)["results"][0]["cold"] is False
    # 1 slot, charged prefetch: the one slot held only the prediction anyway: as warm (4 hits)
    rc, out, _ = run(hand, "--slots", "1", "--prefetch", "trace", "--cold", "--csv")
    table = list(csv.DictReader(io.StringIO(out)))
    assert table[1]["hits"] == "4" and {r["cold"] for r in table} == {"1"}
    rc, out, err = run(hand, "--slots", "2", "--prefetch", "protect", "--cold")
    assert rc == EXIT_OK and "cold (emptied before every token)" in out and "same hits as --prefetch none" in err


def test_layers_option(capsys, hand, run):
    rc, out, _ = run(hand, "--slots", "1", "--layers", "1", "--json")
    assert rc == EXIT_OK and [x["layer"] for x in json.loads(out)["results"][0]["layers"]] == [1]


@pytest.mark.parametrize(
    "args, message",
    [
        (["{missing}", "--slots", "2"], "No such file or directory"),
        (["{garbage}", "--slots", "2"], "bad magic"),
        (["{hand}", "--slots", "0"], "'0' is not a positive integer"),
        (["{hand}", "--slots", "2,x"], "'x' is not a positive integer"),
        (["{hand}", "--slots", "2", "--policy", "fifo"], "unknown policy 'fifo'"),
        (["{hand}", "--slots", "2", "--prefetch", "maybe"], "invalid choice"),
        (["{hand}", "--slots", "2", "--layers", "7"], "--layers [7]"),
        (["{hand}", "--slots", "2", "--json", "--csv"], "not allowed with"),
        (["{hand}"], "the following arguments are required: --slots"),
    ],
)
def test_usage_and_input_errors_exit_2(capsys, hand, tmp_path, args, message, run):
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x00" * 600)
    paths = dict(missing=tmp_path / "missing", garbage=garbage, hand=hand)
    rc, out, err = run(*(a.format(**paths) for a in args))
    assert rc == EXIT_USAGE and out == ""
    assert message in err


def test_slots_below_n_used_exit_2(capsys, tmp_path, run):
    path = tmp_path / "top2.trace"
    with TraceWriter(path, TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=2)) as w:
        w.add(step=0, seq_id=0, pos=0, layer=0, actual=[0, 1])
    rc, out, err = run(path, "--slots", "1,2")
    assert rc == EXIT_USAGE and "n_expert_used (2)" in err


def test_a_trace_named_replay_is_given_with_a_path(hand, tmp_path):
    (tmp_path / "replay").write_bytes(hand.read_bytes())

    def stats(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "onebit_predict.commands.stats", *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    done = stats("./replay", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["traces"][0]["total"]["tokens"] == 10  # the hit-rate form, not the subcommand
    done = stats("replay", "--json")  # the subcommand, whatever the directory holds: it lacks its trace
    assert done.returncode == 2 and done.stderr.startswith("usage: onebit-stats replay") and done.stdout == ""
    for name in ("./replay", "replay"):
        done = stats("replay", name, "--slots", "2")
        assert done.returncode == 0 and "lru@2 hit%" in done.stdout, done.stderr


def test_help(capsys, run):
    rc, out, _ = run("--help")
    assert rc == EXIT_OK and "--prefetch" in out and "exit codes" in out


# --- a real trace from the patched build --------------------------------------------------


def test_real_trace(tiny_model, tmp_path, capsys, run):
    """On a trace llama.cpp wrote: with n_expert_used slots and a charged prefetch of depth
    n_expert_used, the cache holds exactly the prediction, so each predicted layer's hit rate
    is its read recall as onebit-stats computes it; Belady bounds LRU and LFRU."""
    out = tmp_path / "router.bin"
    rc = trace_main(
        [
            str(tiny_model("qwen3moe")),
            "--mode",
            "router",
            "--out",
            str(out),
            "--tokens",
            "24",
            "--generate",
            "24",
            "--ubatch",
            "8",
        ]
    )
    assert rc == EXIT_OK
    capsys.readouterr()
    trace = Trace.open(out)
    n_used = trace.header.n_expert_used
    rc, text, _ = run(out, "--slots", str(n_used), "--prefetch", "trace", "--json")
    assert rc == EXIT_OK
    layers = {x["layer"]: x for x in json.loads(text)["results"][0]["layers"]}
    stats = compute_stats(trace)
    for layer in sorted(trace.header.layer_mask):
        assert layers[layer]["hit_rate"] == pytest.approx(stats.layers[layer].metrics()["read_recall"], abs=1e-12)
    rc, text, _ = run(out, "--slots", f"{n_used},{2 * n_used}", "--policy", "lru,lfru,belady", "--json")
    totals = {(r["policy"], r["slots"]): r["total"]["hits"] for r in json.loads(text)["results"]}
    for slots in (n_used, 2 * n_used):
        assert totals[("belady", slots)] >= max(totals[("lru", slots)], totals[("lfru", slots)])


# --- protect spares all of P; LFRU with a window of 1 (issue: checks as strict as their claims) --


def test_protect_spares_every_predicted_expert_beyond_the_slots():
    # 2 slots, top-1: t0 0, t1 1, t2 demands 2 with the prediction 5, 6, 0 (three candidates,
    # more than the slots). Protection spares all of P, 0 included: t2 evicts 1, and t3 hits 0.
    # (Cutting P to its first 2 ids, as a charged prefetch is cut, left 0 unprotected.)
    d = col([0, 1, 2, 0])
    p = np.array([[-1, -1, -1], [-1, -1, -1], [5, 6, 0], [-1, -1, -1]], dtype=np.int32)
    assert hits(d, "lru", 2, pred=p, prefetch="protect") == 1
    assert hits(d, "lru", 2, pred=p, prefetch="none") == 0


@settings(max_examples=200, deadline=None)
@given(layer_routing())
def test_lfru_with_a_window_of_one_is_lru_without_charged_prefetch(case):
    d, p, slots, _ = case
    for prefetch in ("none", "protect"):
        lru = replay_layer(d, p, CacheConfig(slots, "lru", prefetch))
        lfru = replay_layer(d, p, CacheConfig(slots, "lfru", prefetch, 1))
        assert lru.hit.tolist() == lfru.hit.tolist() and lru.load_expert.tolist() == lfru.load_expert.tolist()


def test_lfru_with_a_window_of_one_is_not_lru_under_charged_prefetch():
    # 2 slots, top-1: t0 demands 0; t1 predicts 2 (wasted) and demands 1; t2 demands 0.
    # lru at t1: the prefetched 2 is the newest, so 1's miss evicts 0: t2 misses.
    # lfru (window 1 = t0's demand): 0 has a use, 2 has none, so 1's miss evicts 2: t2 hits.
    d = col([0, 1, 0])
    p = col([-1, 2, -1])
    assert hits(d, "lru", 2, pred=p, prefetch="trace") == 0
    assert hits(d, "lfru", 2, pred=p, prefetch="trace", window=1) == 1
