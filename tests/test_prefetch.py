"""The prefetch consumer (ONEBIT_MOE_PREFETCH) on the patched build: what it issues, what it
counts into the trace, where it refuses to run, and the page eviction its benchmark uses.

Its bit-identity is checked by onebit-bitident, whose default modes include router+advise
and block+read (tests/test_bitident.py); these tests check that it did its job.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from onebit_predict.checks.bitident import consumer_problem
from onebit_predict.commands.bench import main as bench_main
from onebit_predict.constants import (
    ENV_MODE,
    ENV_OUT,
    ENV_PREFETCH,
    ENV_PREFETCH_DEBUG_KEEP_CAP,
    ENV_PREFETCH_KEEP,
    ENV_PREFETCH_LAYERS,
    ENV_PREFETCH_MAX_BYTES,
    ENV_PREFETCH_ORDER,
    ENV_PREFETCH_RANDOM,
    ENV_PREFETCH_ROOM,
    ENV_PREFETCH_ROUTE,
    ENV_PREFETCH_WAIT,
    ENV_STATS,
    EXIT_OK,
    PREFETCH_ADVISE,
    PREFETCH_OFF,
    PREFETCH_PREAD,
    PREFETCH_READ,
    PREFETCH_THREADS_DEFAULT,
)
from onebit_predict.gguf_experts import read_experts
from onebit_predict.llama.evict import EVICTED_ENOUGH, ExpertPages, expert_spans, random_read_kib
from onebit_predict.llama.runner import Context, ContextSettings, Model, builtin_tokens
from onebit_predict.trace import Trace

N_PROMPT = 16
N_DECODE = 8


def run(model_path: Path, trace: Path, env: dict[str, str | None], use_mmap: bool = True, evict: bool = False) -> Trace:
    """A prefill and N_DECODE single-token steps; with evict, the expert pages leave memory before each step."""
    with Model(model_path, use_mmap=use_mmap) as model:
        pages = ExpertPages(model_path) if evict else None
        method = None
        if pages is not None:
            pages.random_access()  # no readahead: a fault must not bring in the neighbouring experts
            method = pages.detect()[0]
        toks = builtin_tokens(N_PROMPT + N_DECODE, model.n_vocab, 3)
        with Context(model, ContextSettings(n_ubatch=8), {ENV_OUT: str(trace), **env}) as ctx:
            ctx.decode(toks[:N_PROMPT], range(N_PROMPT), [0] * N_PROMPT, [True] * N_PROMPT)
            for i in range(N_DECODE):
                if pages is not None:
                    pages.evict(method)
                ctx.decode([toks[N_PROMPT + i]], [N_PROMPT + i], [0], [True])
        if pages is not None:
            pages.close()
    return Trace.open(trace)


def run_evicted_with_stats(model_path: Path, env: dict[str, str | None]) -> dict[str, int] | None:
    """A prefill and N_DECODE single-token steps, the expert pages evicted (readahead off on them) before
    each step; the context's counters (onebit_moe_get_stats) as the last step ended."""
    from onebit_predict.llama.moe_stats import context_stats
    from onebit_predict.llama.runner import llama

    with Model(model_path) as model:
        pages = ExpertPages(model_path)
        pages.random_access()
        method = pages.detect()[0]
        toks = builtin_tokens(N_PROMPT + N_DECODE, model.n_vocab, 3)
        with Context(model, ContextSettings(n_ubatch=8), env) as ctx:
            ctx.decode(toks[:N_PROMPT], range(N_PROMPT), [0] * N_PROMPT, [True] * N_PROMPT)
            for i in range(N_DECODE):
                pages.evict(method)
                ctx.decode([toks[N_PROMPT + i]], [N_PROMPT + i], [0], [True])
            stats = context_stats(llama(), ctx.ptr)
        pages.close()
    return stats


def test_layers_ahead_skip_the_first_op_of_a_larger_ubatch(tiny_model):
    """ONEBIT_MOE_PREFETCH_LAYERS=2 in a prompt's ubatches of 64 tokens (each routes every expert): the
    first route-time op of a ubatch larger than any before measured the room before the ubatch's
    buffers were touched, so it reads no layer ahead and counts a cut; every later op reads ahead, and
    a second ubatch of the same size has no such op. Before the fix that op read ahead (no cut)."""
    from onebit_predict.llama.moe_stats import context_stats
    from onebit_predict.llama.runner import llama

    path = tiny_model("qwen3moe")
    n_moe = len(read_experts(path).layers)  # route-time ops a ubatch
    env = {ENV_PREFETCH_ROUTE: "1", ENV_PREFETCH_LAYERS: "2", ENV_PREFETCH_ROOM: "0"}  # the model fits
    with Model(path, extra_bufts=False) as model:
        toks = builtin_tokens(128, model.n_vocab, 3)
        with Context(model, ContextSettings(n_batch=64, n_ubatch=64), env) as ctx:
            ctx.decode(toks[:64], range(64), [0] * 64, [True] * 64)
            first = context_stats(llama(), ctx.ptr)
            ctx.decode(toks[64:], range(64, 128), [0] * 64, [True] * 64)
            second = context_stats(llama(), ctx.ptr)
    assert first is not None and second is not None
    assert n_moe > 1 and first["layers"] == 2
    assert (first["layers_cut"], first["layers_ops"]) == (1, n_moe - 1)
    assert (second["layers_cut"], second["layers_ops"]) == (1, 2 * n_moe - 1)


@pytest.mark.parametrize("room, marked", [("1000", False), ("0", True)])
def test_hits_first_only_while_route_reads(tiny_model, room, marked):
    """--moe-prefetch-order hits marks the expert matmuls to compute the resident experts first, which asks
    mincore of every routed expert's slice on the compute thread. Without route's reads in flight every order
    waits as long, so the mark is lifted while the room rule holds route off (R 1000: far more than this
    machine has; the model fits, route idles) and the matmuls run unmarked (order_marked counts the runs
    that were marked). With the rule off (R 0) route reads the evicted experts and every run is marked.
    Before, the mark stayed on whatever the rule said."""
    path = tiny_model("qwen3moe")
    n_moe = len(read_experts(path).layers)
    stats = run_evicted_with_stats(path, {ENV_PREFETCH_ROUTE: "1", ENV_PREFETCH_ORDER: "hits", ENV_PREFETCH_ROOM: room})
    assert stats is not None and stats["order"] == 1
    # up (or gate_up), gate and down of each MoE layer, each ubatch: the prompt's two and each decoded token
    runs = (N_PROMPT // 8 + N_DECODE) * n_moe
    assert stats["order_marked"] in ((2 * runs, 3 * runs) if marked else (0,)), stats


@pytest.mark.parametrize("consumer, mode", [("advise", PREFETCH_ADVISE), ("read", PREFETCH_READ)])
def test_consumer_issues_the_predicted_experts_and_counts_them(tiny_model, tmp_path, consumer, mode):
    path = tiny_model("qwen3moe")
    trace = run(path, tmp_path / "t.bin", {ENV_MODE: "router", ENV_PREFETCH: consumer}, evict=True)
    h = trace.header
    assert (h.prefetch_mode, h.prefetch_max_bytes, h.prefetch_threads) == (mode, 0, PREFETCH_THREADS_DEFAULT)
    assert (h.speculative, h.route, h.random) == (True, False, False)  # flag bits 14, 12, 13
    t = h.prefetch_totals
    assert t is not None and consumer_problem(trace, consumer) is None
    # every predicted candidate row reads at least one expert: three tensor slices each (gate, up, down)
    assert t.experts > 0 and t.ranges == 3 * t.experts
    assert t.failed == 0 and t.errors == () and t.dropped_bytes == 0
    # the pages were evicted before each decode step, so some ranges were not resident when issued
    assert t.resident_ranges < t.ranges and t.resident_bytes < t.bytes
    assert t.touched_bytes <= t.bytes
    if consumer == "advise":
        assert t.touched_bytes == 0 and t.queue_full == 0


def test_route_time_reads_the_routed_experts_alone(tiny_model, tmp_path, capfd):
    """ONEBIT_MOE_PREFETCH_ROUTE=1 with the predictor off: the consumer reads each layer's routed experts
    with the default call (read), speculates nothing; with _RANDOM=1 the header says so; evicted pages
    are found missing when routed (route_bytes), and the log names both."""
    path = tiny_model("qwen3moe")
    # the room rule off: here the model fits, and route would idle (the room rule's "fits")
    env = {
        ENV_OUT: str(tmp_path / "t.bin"),
        "ONEBIT_MOE_PREFETCH_ROUTE": "1",
        "ONEBIT_MOE_PREFETCH_RANDOM": "1",
        "ONEBIT_MOE_PREFETCH_ROOM": "0",
    }
    stats = run_evicted_with_stats(path, env)
    h = Trace.open(tmp_path / "t.bin").header
    assert (h.prefetch_mode, h.speculative, h.route, h.random) == (PREFETCH_READ, False, True, True)
    assert stats is not None and (stats["route"], stats["speculative"], stats["prefetch"]) == (1, 0, PREFETCH_READ)
    assert stats["route_experts"] > 0 and stats["route_bytes"] > 0 and stats["prefetch_failed"] == 0
    err = capfd.readouterr().err
    assert "reads at route time" in err and "readahead off on the experts (MADV_RANDOM)" in err


@pytest.mark.parametrize("room, reads", [("1000", False), ("0", True)], ids=["held-off", "reads"])
def test_readahead_back_while_route_holds_off(tiny_model, capfd, room, reads):
    """ONEBIT_MOE_PREFETCH_RANDOM=1 puts readahead off on the expert tensors for the consumer's exact reads.
    Where the room rule holds the reads off (R 1000: far more than this machine has; the model fits and route
    idles) the compute thread faults the routed experts in itself, a page at a time with readahead off
    (0.074x of off at 25 % of the grown 2.7 MiB model), so the layers get the kernel's readahead back: no
    mapping of the model carries the random advice, and the room line says so. With the rule off (R 0) route
    reads and the advice stays. Before, it stayed whatever the rule said."""
    path = tiny_model("qwen3moe")
    env = {ENV_PREFETCH: "pread", ENV_PREFETCH_ROUTE: "1", ENV_PREFETCH_RANDOM: "1", ENV_PREFETCH_ROOM: room}
    before = random_read_kib(path)
    with Model(path, extra_bufts=False) as model:
        toks = builtin_tokens(N_PROMPT + N_DECODE, model.n_vocab, 3)
        with Context(model, ContextSettings(n_ubatch=8), env) as ctx:
            ctx.decode(toks[:N_PROMPT], range(N_PROMPT), [0] * N_PROMPT, [True] * N_PROMPT)
            for i in range(N_DECODE):
                ctx.decode([toks[N_PROMPT + i]], [N_PROMPT + i], [0], [True])
            advised = random_read_kib(path) - before
    err = capfd.readouterr().err
    assert "readahead off on the experts (MADV_RANDOM)" in err  # the knob held
    assert (advised > 0) == reads, advised
    assert ("route time idles" in err) != reads, err  # R 0: the rule off, route reads (and says nothing)
    assert ("the experts' readahead back meanwhile" in err) != reads


def test_cap_drops_what_it_cannot_afford(tiny_model, tmp_path):
    path = tiny_model("qwen3moe")
    trace = run(path, tmp_path / "t.bin", {ENV_MODE: "block", ENV_PREFETCH: "advise", ENV_PREFETCH_MAX_BYTES: "1"})
    t = trace.header.prefetch_totals
    assert trace.header.prefetch_max_bytes == 1
    assert t.experts == 0 and t.bytes == 0 and t.dropped_bytes > 0
    # a consumer that issued nothing proves nothing: the bit-identity check refuses it
    assert consumer_problem(trace, "advise") == "the prefetch consumer issued nothing"


def test_no_mmap_turns_the_consumer_off_with_a_notice(tiny_model, tmp_path, capfd):
    trace = run(tiny_model("qwen3moe"), tmp_path / "t.bin", {ENV_MODE: "router", ENV_PREFETCH: "read"}, use_mmap=False)
    err = capfd.readouterr().err
    assert "not mmapped from the model file" in err and "prefetch off" in err
    assert (trace.header.prefetch_mode, trace.header.prefetch_totals) == (PREFETCH_OFF, None)
    assert "records off" in consumer_problem(trace, "read")


def test_route_alone_without_mmap_names_the_route_knob(tiny_model, tmp_path, capfd):
    """Route alone sets neither ONEBIT_MOE_PREDICT nor ONEBIT_MOE_PREFETCH (its call, read, is a default):
    the notice names the knob that was set."""
    run(tiny_model("qwen3moe"), tmp_path / "t.bin", {ENV_PREFETCH_ROUTE: "1"}, use_mmap=False)
    err = capfd.readouterr().err
    assert "onebit: ONEBIT_MOE_PREFETCH_ROUTE=1: no layer can be prefetched; prefetch off" in err, err
    assert "ONEBIT_MOE_PREFETCH=" not in err and "ONEBIT_MOE_PREDICT " not in err, err


def test_consumer_needs_a_predictor(tiny_model, tmp_path, capfd):
    trace = run(tiny_model("qwen3moe"), tmp_path / "t.bin", {ENV_MODE: "off", ENV_PREFETCH: "advise"})
    err = capfd.readouterr().err
    assert (
        "ONEBIT_MOE_PREFETCH=advise needs ONEBIT_MOE_PREDICT=router, block or learned, "
        "or ONEBIT_MOE_PREFETCH_ROUTE=1; using off" in err
    )
    assert trace.header.prefetch_mode == PREFETCH_OFF


def test_stats_print_the_consumer_table(tiny_model, tmp_path, capfd):
    run(tiny_model("olmoe"), tmp_path / "t.bin", {ENV_MODE: "block", ENV_PREFETCH: "advise", ENV_STATS: "1"})
    err = capfd.readouterr().err
    # the consumer's create line: the call, what it reads, the default 8 workers
    assert re.search(
        r"onebit: moe-prefetch advise, reads predicted, \d+ layer\(s\), cap none, 8 worker\(s\), guard none\n", err
    )
    assert "onebit: moe-prefetch stats, advise" in err
    assert any(line.startswith("onebit: total") for line in err.splitlines())


# --- the eviction the cold benchmark relies on -------------------------------------------


def test_eviction_empties_the_expert_pages(tiny_model):
    path = tiny_model("qwen3moe")
    with Model(path):
        pages = ExpertPages(path)
        try:
            assert pages.nbytes == sum(s.size for s in expert_spans(path)) > 0
            method, notes = pages.detect()
            assert pages.resident_fraction() <= EVICTED_ENOUGH, notes
            pages.evict(method)
            assert pages.resident_fraction() <= EVICTED_ENOUGH
        finally:
            pages.close()


def test_cold_bench_compares_the_consumer_modes(tiny_model, capsys):
    rc = bench_main(
        [str(tiny_model("qwen3moe")), "--cold", "--rounds", "1", "--prompt", "8", "--generate", "3", "--json"]
    )
    assert rc == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    assert report["evict_method"] in ("pageout", "dontneed")
    rows = {r["name"]: r for r in report["rows"]}
    assert list(rows) == [
        "patched off, warm",
        "patched off",
        "router",
        "router + advise",
        "router + read",
        "block",
        "block + advise",
        "block + read",
    ]
    assert report["drive"]["bandwidth_mb_s"] > 0 and report["drive"]["page_read_us"] > 0
    assert rows["patched off, warm"]["resident_after_evict"] is None
    for name, r in rows.items():
        if name != "patched off, warm":
            assert r["resident_after_evict"] <= EVICTED_ENOUGH, name
        assert (r["prefetched_experts"] > 0) == ("+" in name), name
        assert (r["read_recall"] is None) == name.startswith("patched off"), name


def test_drive_measurement_needs_a_writable_directory(tmp_path):
    from onebit_predict.llama.drive import DriveError, measure_drive

    with pytest.raises(DriveError, match="cannot measure the drive under"):
        measure_drive(tmp_path / "missing")
    figures = measure_drive(tmp_path, size=4 << 20)
    assert figures.bandwidth_mb_s > 0 and figures.page_read_us > 0
    assert figures.random_mb_s is not None and figures.random_mb_s > 0  # 1 MiB random reads, 8 at a time
    assert "MB/s in random 1 MiB reads x8" in figures.words()
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone


def test_route_preads_waits_and_the_lru_pages_out(tiny_model, tmp_path, capfd):
    """ONEBIT_MOE_PREFETCH=pread with route, readahead off, the wait and the LRU held small: on evicted
    pages the workers read through the file (the header's call and its bytes), every op that queued a read
    waited for it, and the LRU evicted; the log names each."""

    path = tiny_model("qwen3moe")
    env = {
        ENV_OUT: str(tmp_path / "t.bin"),
        ENV_PREFETCH: "pread",
        ENV_PREFETCH_ROUTE: "1",
        ENV_PREFETCH_RANDOM: "1",
        ENV_PREFETCH_WAIT: "1",
        ENV_PREFETCH_KEEP: "lru",
        ENV_PREFETCH_DEBUG_KEEP_CAP: "8",  # 2 experts a layer (n_expert_used): it must evict
        ENV_PREFETCH_ROOM: "0",  # the model fits: route would idle
    }
    stats = run_evicted_with_stats(path, env)
    trace = Trace.open(tmp_path / "t.bin")
    h = trace.header
    assert (h.prefetch_mode, h.route, h.random, h.wait) == (PREFETCH_PREAD, True, True, True)
    assert stats is not None and (stats["prefetch"], stats["wait"], stats["keep"]) == (PREFETCH_PREAD, 1, 1)
    assert stats["route_bytes"] > 0 and stats["prefetch_failed"] == 0
    assert stats["route_waits"] > 0 and stats["keep_evicted"] > 0 and stats["keep_capacity"] == 8
    t = h.prefetch_totals
    assert t is not None and t.touched_bytes > 0 and t.failed == 0  # pread read them, through the file
    err = capfd.readouterr().err
    assert "(the layer waits for them)" in err and "ONEBIT_MOE_PREFETCH_DEBUG_KEEP_CAP=8" in err


def test_guesses_read_only_into_their_own_room(tiny_model, tmp_path, capfd):
    """A predictor with route and the LRU: a guess takes one of n_expert_used places until its layer is
    routed, so with the router's 4 candidates for 2 routed some are skipped for want of room; the
    guesses the routing did not take are paged out at their layer's route; the log names both counts.
    Without a predictor there are no guesses and no such line."""

    path = tiny_model("qwen3moe")
    env = {
        ENV_OUT: str(tmp_path / "t.bin"),
        ENV_MODE: "router",
        ENV_PREFETCH: "read",
        ENV_PREFETCH_ROUTE: "1",
        ENV_PREFETCH_KEEP: "lru",
        ENV_PREFETCH_DEBUG_KEEP_CAP: "8",
        ENV_PREFETCH_ROOM: "0",  # the model fits: route would idle
        ENV_STATS: "1",
    }
    stats = run_evicted_with_stats(path, env)
    assert stats is not None and (stats["speculative"], stats["route"], stats["keep"]) == (1, 1, 1)
    assert stats["prefetch_experts"] > 0 and stats["spec_skipped"] > 0 and stats["spec_unused"] > 0
    assert stats["keep_evicted"] > 0 and stats["prefetch_failed"] == 0
    err = capfd.readouterr().err
    room = r"guesses read into a room of (\d+) experts; skipped for want of room (\d+), paged out unrouted (\d+)"
    m = re.search(room, err)
    assert m is not None, err
    assert int(m[1]) == 2 and int(m[2]) > 0 and int(m[3]) > 0

    stats = run_evicted_with_stats(path, {**env, ENV_MODE: "off", ENV_PREFETCH: None})
    assert stats is not None and stats["speculative"] == 0
    assert (stats["spec_skipped"], stats["spec_unused"]) == (0, 0) and stats["keep_evicted"] > 0
    assert "guesses read into" not in capfd.readouterr().err


def test_pread_without_mmap_turns_the_consumer_off_with_a_notice(tiny_model, tmp_path, capfd):
    """pread reads through the file behind the mapping: without mmap there is none, as for every call."""
    trace = run(
        tiny_model("qwen3moe"),
        tmp_path / "t.bin",
        {ENV_PREFETCH: "pread", ENV_PREFETCH_ROUTE: "1"},
        use_mmap=False,
    )
    assert trace.header.prefetch_mode == PREFETCH_OFF
    assert "not mmapped from the model file" in capfd.readouterr().err
