"""The page model's route-time reads, populate, MADV_RANDOM on the experts, and rows on emulated drives
(costmodel/pages.py, kernel.py, page_settings.py, page_check.py, measured.py; docs/cost-model.md,
"Pages"): the route op's ranges go ahead of the speculative ones, stale speculative ranges are
dropped, a prediction already issued leaves route nothing to read, route reads overlap where a
lone fault waits, and a report's row plays on its drive's profile with its own window and workers.
The tiny routing, layout and model are test_simulate_pages.py's.
"""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from onebit_predict.constants import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    MODE_ROUTER,
    PREFETCH_THREADS_BEFORE_ROUTE,
    PREFETCH_THREADS_DEFAULT,
)
from onebit_predict.costmodel.engine import Engine
from onebit_predict.costmodel.keep import ExpertLRU, keep_capacity
from onebit_predict.costmodel.kernel import Kernel, PageCache, PageDrive
from onebit_predict.costmodel.layout import hits_first, synthetic_layout
from onebit_predict.costmodel.measured import load_measured
from onebit_predict.costmodel.pages import _Sim, run_config
from onebit_predict.costmodel.routing import load_routing
from onebit_predict.costmodel.row_config import RowConfig
from onebit_predict.drive.profiles import NVME
from onebit_predict.trace import Trace, TraceHeader
from onebit_predict.trace_writer import TraceWriter
from tests.test_simulate_pages import (
    P,
    ahead_trace,
    config_report,
    layout_3_pages,
    memory_report,
    run_cli,
    tiny,  # noqa: F401 (the fixture)
    tiny_model,
)


def play(path, model, predictor, consumer, route=False, layout=None, keep=False):
    trace = Trace.open(path)
    lay = layout or layout_3_pages()
    return run_config(load_routing(trace), lay, model, predictor, consumer, "x", trace, route=route, keep=keep)


# --- the workers' two queues ------------------------------------------------------------------


def one_worker_sim(call: str = "advise") -> tuple[_Sim, Kernel, Engine]:
    kernel = Kernel(64, PageCache(None), PageDrive(4096e3, 1.0, 1), window=0)
    engine = Engine()
    return _Sim(kernel, engine, synthetic_layout({0: 3 * P}, 4), call, 1, True, True), kernel, engine


def test_a_route_op_is_served_before_the_speculative_ranges_queued_first():
    sim, kernel, engine = one_worker_sim()
    sim.push(0.0, [(10, 12), (20, 22)], layer=3)  # speculative, for layer 3
    sim.push(0.0, [(30, 32)], layer=1, urgent=True)  # a route-time op of layer 1
    engine.run()
    # one request in service at a time, FIFO: the urgent range's pages flow first
    assert max(kernel.cache.ready(p) for p in (30, 31)) < min(kernel.cache.ready(p) for p in (10, 11, 20, 21))
    assert (sim.ranges, sim.route_ranges) == (2, 1) and sim.idle()


def test_a_route_op_drops_the_speculative_ranges_of_its_layer_and_before():
    sim, _, _ = one_worker_sim()
    sim.workers = []  # nobody serves them: they stay queued
    sim.push(0.0, [(0, 1)], layer=1)
    sim.push(0.0, [(1, 2), (2, 3)], layer=2)
    sim.push(0.0, [(3, 4)], layer=3)
    sim.drop_stale(2)
    assert [r[3] for r in sim.queue] == [3] and sim.stale == 3
    sim.drop_stale(0)
    assert len(sim.queue) == 1 and sim.stale == 3


def test_late_speculative_reads_are_dropped_in_a_run(tiny):  # noqa: F811
    """One worker reading page by page at 1 s a page: layer 1's predicted ranges are still queued when
    layer 1 routes (no compute between), and are dropped there."""
    slow = tiny_model(bandwidth=4096.0, latency_ms=0.0, workers=1)
    run = play(tiny, slow, "router", "read", route=True)
    assert run.route and run.stale_ranges > 0
    no_route = play(tiny, slow, "router", "read")
    assert no_route.stale_ranges == 0 and not no_route.route


# --- what a route op reads ----------------------------------------------------------------------


def test_route_reads_what_the_routed_experts_lack(tiny):  # noqa: F811
    """Decode: t1 routes experts the prefill read; t2 routes expert 1 (layer 0) and 3 (layer 1), 3 pages
    each, missing; t3 routes what t2 brought in. Layer 1's prediction is right at t1 and t3, wrong at t2."""
    alone = play(tiny, tiny_model(), None, "off", route=True)
    assert (alone.route_missing_pages, alone.route_ranges, alone.consumer) == (6, 6, "off")
    off = play(tiny, tiny_model(), None, "off")
    assert alone.counts.pages_read == off.counts.pages_read  # the same pages, read by the workers
    with_router = play(tiny, tiny_model(), "router", "read", route=True)
    assert with_router.route_missing_pages == 6  # the prediction missed layer 1 at t2: route reads it
    oracle = play(tiny, tiny_model(layer_ms=2.0), "oracle", "advise", route=True)
    assert oracle.route_missing_pages == 3  # layer 0 is never predicted; layer 1 was, rightly


def test_a_perfect_prediction_already_issued_leaves_route_nothing(tmp_path):
    """Layers 0 and 1 always route expert 0 (read by the prefill), layer 2 a new expert each token,
    predicted right a layer ahead: the advised pages are in the page cache (or under I/O, which
    mincore counts as resident) when layer 2 routes, so route issues nothing."""
    path = ahead_trace(tmp_path / "k1.bin", 1)
    lay = synthetic_layout({layer: 3 * P for layer in range(3)}, n_expert=4)
    model = tiny_model(layer_ms=2.0, route_at=0.5)
    for predictor in ("router", "oracle"):
        run = play(path, model, predictor, "advise", route=True, layout=lay)
        assert (run.route_ranges, run.route_missing_pages) == (0, 0), predictor
    alone = play(path, model, None, "off", route=True, layout=lay)
    assert (alone.route_ranges, alone.route_missing_pages) == (9, 9)  # layer 2's 3 slices, 3 tokens


def test_route_overlaps_the_reads_a_lone_fault_serialises(tiny):  # noqa: F811
    """A slow drive (10 ms a request) with 4 requests in service: off faults an expert's 3 slices one
    after another; route's workers read them at once, so it decodes faster (it would not, were the
    route op's reads not modelled)."""
    slow = tiny_model(bandwidth=4096e4, latency_ms=10.0, queue_depth=4)
    off = play(tiny, slow, None, "off")
    route = play(tiny, slow, None, "off", route=True)
    assert route.counts.pages_read == off.counts.pages_read
    assert route.total_ms < 0.6 * off.total_ms
    serial = play(tiny, tiny_model(bandwidth=4096e4, latency_ms=10.0, queue_depth=1), None, "off", route=True)
    assert serial.total_ms > route.total_ms  # one request in service: little to overlap


def test_route_is_not_held_by_the_room_rule(tiny):  # noqa: F811
    held = play(tiny, tiny_model(capacity_pages=5, prefetch_room=1.0), "router", "read", route=True)
    assert held.room_held and held.prefetch_ranges == 0 and held.route_ranges > 0


def test_populate_plays_as_read_and_route_needs_no_predictor(tiny):  # noqa: F811
    read = play(tiny, tiny_model(), "router", "read", route=True)
    populate = play(tiny, tiny_model(), "router", "populate", route=True)
    assert (populate.counts, populate.token_ms) == (read.counts, read.token_ms)
    assert play(tiny, tiny_model(), None, "populate", route=True).route_ranges == 6
    with pytest.raises(ValueError, match="predictor or route"):
        play(tiny, tiny_model(), None, "read")


# --- the kernel: MADV_RANDOM on some pages, requests no larger than max_read -------------------------


def test_random_pages_fault_alone_and_pull_no_window():
    random = [False] * 32 + [True] * 32
    k = Kernel(64, PageCache(None), PageDrive(4096e3, 1.0, 4), window=8, random=random)
    k.access(40, 0.0)
    assert sorted(k.cache.pages()) == [40] and not k.cache.marker
    k.access(10, 0.0)  # a page outside: its read-around window
    assert {p for p in k.cache.pages() if p < 32} == set(range(6, 14))


def test_a_window_is_split_into_requests_of_max_read():
    k = Kernel(64, PageCache(None), PageDrive(4096e3, 1.0, 4, max_pages=2), window=8)
    k.access(20, 0.0)
    assert (k.counts.requests, k.counts.pages_read) == (4, 8)
    assert k.cache.ready(16) < k.cache.ready(18)  # each its own latency, overlapping, then its bytes


# --- a report's rows on their drives ------------------------------------------------------------------


def drive_report(tmp_path, configs, limit=65536):
    """A route-era report (config objects with ``route``) whose rows ran natively and on an emulated nvme
    (the mount: max_read 8 KiB, read_ahead_kb 4), resident runs included."""
    path = config_report(tmp_path / "drives.json", configs, limit=limit)
    data = json.loads(path.read_text())
    data["drive"]["read_ahead_kb"] = 16
    data["drives"] = {
        "native": {"emulated": False, "path": "tiny.gguf"},
        "nvme": {"emulated": True, "profile": asdict(NVME), "max_read": 8192, "read_ahead_kb": 4},
    }
    for drive, tok_s in (("nvme", 10.0), ("native", 20.0)):
        resident = {"name": f"patched off, {drive}", "median_tok_s": tok_s, "config": {"drive": drive}}
        data["rows"].append({"limit_bytes": 0, **resident})
    data["rows"][0]["route_missing_per_token"] = 3 * P
    path.write_text(json.dumps(data))
    return path


def test_a_report_reads_its_drives_workers_and_resident_run(tmp_path):
    path = drive_report(tmp_path, [RowConfig(route=True, drive="nvme")])
    m = load_measured(path)
    (nvme,) = m.drives
    assert (nvme.name, nvme.latency_us, nvme.channels, nvme.max_read, nvme.read_ahead_kb) == ("nvme", 65.0, 64, 8192, 4)
    assert m.workers_default == PREFETCH_THREADS_DEFAULT and m.warm_tok_s == 20.0  # the native resident run
    assert m.rows[0].drive == "nvme" and m.rows[0].read_ahead_kb == 4 and m.rows[0].route_missing_per_token == 3 * P
    old = load_measured(memory_report(tmp_path / "old.json", {"patched off": 1.0}))
    assert old.workers_default == PREFETCH_THREADS_BEFORE_ROUTE and old.drives == ()


def test_a_row_on_an_emulated_drive_plays_its_profile(capsys, tiny, tmp_path):  # noqa: F811
    configs = [RowConfig(route=True, drive="native"), RowConfig(route=True, drive="nvme")]
    configs += [RowConfig(route=True, drive="nvme", workers=3)]
    path = drive_report(tmp_path, configs)
    args = ["--expert-bytes", "12288", "--layer-ms", "0", "--tolerance", "999", "--json", "--measured", path]
    rc, out, err = run_cli(capsys, tiny, *args)
    assert rc in (EXIT_OK, EXIT_CHECK_FAILED), err  # the made-up tok/s: the nvme rows may miss
    got = json.loads(out)
    assert got["model"]["drive@nvme"]["value"] == {
        "bandwidth": 6e9,
        "latency_us": 65.0,
        "queue_depth": 64,
        "request_bytes": 8192,
        "read_ahead_kb": 4,
    }
    rows = {r["configuration"]: r for r in got["rows"]}
    native, nvme, three = rows["route, native"], rows["route, nvme"], rows["route, workers 3, nvme"]
    assert (native["drive"], nvme["drive"]) == ("native", "nvme")
    assert native["read_around_kib"] == 32 and nvme["read_around_kib"] == 8  # 2 x each row's read_ahead_kb
    assert (native["workers"], nvme["workers"], three["workers"]) == (PREFETCH_THREADS_DEFAULT,) * 2 + (3,)
    assert nvme["tok_s"] != native["tok_s"]  # 6 GB/s at 65 us against the report's 4 MB/s at 1 ms
    assert native["kind"] == "route" and native["checked"]
    assert native["measured_route_missing_mib_per_token"] == pytest.approx(3 * P / 2**20)
    assert native["route_missing_mib_per_token"] is not None
    rc, out, _ = run_cli(capsys, tiny, *args[:-3], "--measured", path)
    assert "drive nvme: 6 GB/s, latency 65 us, queue depth 64, requests up to 8 KiB" in out


def test_a_route_row_with_the_guard_is_shown_not_checked(capsys, tiny, tmp_path):  # noqa: F811
    path = config_report(tmp_path / "g.json", [RowConfig(route=True), RowConfig(route=True, guard=4)], limit=65536)
    args = ["--expert-bytes", "12288", "--layer-ms", "0", "--readahead-kb", "0", "--tolerance", "999", "--json"]
    rc, out, err = run_cli(capsys, tiny, *args, "--measured", path)
    assert rc in (EXIT_OK, EXIT_CHECK_FAILED), err
    checked = {r["configuration"]: r["checked"] for r in json.loads(out)["rows"]}
    assert checked == {"route": True, "route, guard 4": False}


# --- route time's expert LRU (ONEBIT_MOE_PREFETCH_KEEP=lru) -------------------------------------


def test_the_lru_capacity_is_the_consumers():
    """keep_capacity is measure_room's keep_cap: the room less a token's other weights, less one
    layer's routed experts, less the guesses' room with a predictor, in experts; at least n_expert_used."""
    mib = 1 << 20
    # 8 MoE layers, 4 of 16 used, 2.75 MiB experts: a token reads 88 MiB of experts and 4 MiB else
    need = 8 * 4 * 11 * mib // 4 + 4 * mib
    assert keep_capacity(145 * mib, need, 11 * mib // 4, 8, 4) == 141 * 4 // 11 - 4 == 47
    assert keep_capacity(145 * mib, need, 11 * mib // 4, 8, 4, guesses=True) == 43
    assert keep_capacity(1 * mib, need, 11 * mib // 4, 8, 4) == 4  # never below n_expert_used
    with pytest.raises(ValueError):
        keep_capacity(mib, need, 0, 8, 4)


def test_the_lru_evicts_the_least_recent_never_what_is_routed_now():
    lru = ExpertLRU(4, 2, 1)  # a share of 2 a layer
    assert lru.share == 2
    assert lru.route(0, [3]) == [] and lru.route(0, [1]) == []
    assert lru.route(0, [2]) == [3]  # the oldest goes
    assert lru.route(0, [1]) == [] and lru.route(0, [0]) == [2]  # 1 was used again: 2 is the oldest
    assert list(lru.held[0]) == [1, 0] and lru.route(1, [0, 1, 2]) == []  # all routed now: over its share
    assert lru.route(1, [3]) == [0, 1] and lru.evicted == 4


def lru_trace(path):
    """2 layers of 4 experts, top-1: layer 0 alternates experts 0 and 1, layer 1 keeps expert 2."""
    h = TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=1, depth=1, mode=MODE_ROUTER, layers={1}, model="lru")
    with TraceWriter(path, h) as w:
        for pos in range(4):
            for layer in range(2):
                actual = [pos % 2 if layer == 0 else 2]
                w.add(step=pos, seq_id=0, pos=pos, layer=layer, actual=actual, pred=None, decode=pos > 0)
    return path


def test_route_with_the_lru_pages_out_what_it_evicts(tmp_path):
    """A room of 12 pages (4 experts of 3 pages) gives the LRU 3 experts, 1 a layer: layer 0's
    alternating experts evict each other at every decoded token and are read again (9 pages missing
    when routed), where the page cache alone keeps both (3 pages: expert 1's first use). Without a
    limit the LRU has no size and evicts nothing."""
    path = lru_trace(tmp_path / "lru.bin")
    tight = tiny_model(capacity_pages=12)
    kept = play(path, tight, None, "off", route=True, keep=True)
    assert (kept.keep, kept.keep_capacity, kept.keep_evicted) == (True, 3, 3)
    assert kept.route_missing_pages == 9
    kernel = play(path, tight, None, "off", route=True)
    assert (kernel.keep, kernel.keep_evicted, kernel.route_missing_pages) == (False, 0, 3)
    free = play(path, tiny_model(), None, "off", route=True, keep=True)
    assert (free.keep_capacity, free.keep_evicted) == (None, 0)
    with pytest.raises(ValueError, match="the expert LRU is played with route time"):
        play(path, tight, None, "off", route=False, keep=True)


def test_the_lrus_room_for_guesses(tmp_path):
    """With a predictor the LRU gives its guesses n_expert_used places (1 here) over all layers: layer 1's two
    wrong guesses (experts 3 and 0, it routes 2) take the one place and skip the other, and at layer 1's route
    the guess read is paged out unused, every decoded token; the guesses shrink the LRU by their places."""
    path = tmp_path / "guess.bin"
    h = TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=1, depth=2, mode=MODE_ROUTER, layers={1}, model="g")
    with TraceWriter(path, h) as w:
        for pos in range(4):
            w.add(step=pos, seq_id=0, pos=pos, layer=0, actual=[pos % 2], pred=None, decode=pos > 0)
            w.add(step=pos, seq_id=0, pos=pos, layer=1, actual=[2], pred=[3, 0], decode=pos > 0)
    tight = tiny_model(capacity_pages=15)
    guessed = play(path, tight, "router", "read", route=True, keep=True)
    alone = play(path, tight, None, "off", route=True, keep=True)
    assert (guessed.spec_skipped, guessed.spec_unused) == (3, 3)  # 3 decoded tokens, one of each
    assert (alone.spec_skipped, alone.spec_unused) == (0, 0)
    assert guessed.keep_capacity == alone.keep_capacity - 1  # the guesses' place comes out of the LRU


def test_the_wait_holds_the_matmuls_until_the_layers_reads_are_in(tmp_path):
    """Route time's wait (ONEBIT_MOE_PREFETCH_WAIT=1): the op waits for its layer's ranges, so the compute
    thread faults on none of them (its stall falls to what the reads' spill and the dense pages leave) and
    spends the time in the op instead; the same pages are read. Without route, or with advise, there is
    nothing to wait for: refused."""
    path = lru_trace(tmp_path / "lru.bin")
    tight = tiny_model(capacity_pages=12)
    free = play(path, tight, None, "off", route=True)
    trace = Trace.open(path)
    waited = run_config(load_routing(trace), layout_3_pages(), tight, None, "off", "x", trace, route=True, wait=True)
    assert (free.wait, free.route_wait_ms) == (False, 0.0)
    assert waited.wait and waited.route_wait_ms > 0
    assert waited.stall_ms < free.stall_ms
    assert waited.counts.pages_read == free.counts.pages_read
    assert waited.route_missing_pages == free.route_missing_pages
    for kwargs in ({"route": False}, {"route": True, "consumer": "advise", "predictor": "router"}):
        args = {"predictor": None, "consumer": "off"} | kwargs
        with pytest.raises(ValueError, match="the wait is played with route time"):
            run_config(load_routing(trace), layout_3_pages(), tight, args.pop("predictor"), args.pop("consumer"),
                       "x", trace, wait=True, **args)  # fmt: skip


def test_a_pread_worker_reads_a_range_whole_and_waits_for_all_of_it():
    """``pread``: the missing pages of a range in one request (no window: the file opened FADV_RANDOM), every
    page ready when the request is (a bio completes whole), the worker free only then; a page already under
    I/O is waited for, not read again; page-touching (``read``) pages arrive one after another."""
    sim, kernel, engine = one_worker_sim("pread")
    kernel.read(13, 1, 0.0)  # page 13 already under I/O
    sim.push(0.0, [(10, 16)], layer=1, urgent=True)
    engine.run()
    ready = [kernel.cache.ready(p) for p in range(10, 16)]
    assert kernel.counts.pread_ranges == 1 and kernel.counts.major_faults == 0
    assert kernel.counts.requests == 3  # page 13's, then 10-12 and 14-15: the missing runs
    # one request in service, 1 ms latency, 1 ms a page: 13 done at 2; 10-12 in service 2-6, 14-15 6-9
    assert ready[:3] == [6.0] * 3 and ready[3] == 2.0 and ready[4:] == [9.0] * 2
    assert sim.workers[0].t == 9.0 and sim.outstanding[1] == 0
    touched, k2, e2 = one_worker_sim("read")
    touched.push(0.0, [(10, 13)], layer=1, urgent=True)
    e2.run()
    assert len({k2.cache.ready(p) for p in range(10, 13)}) == 3  # one after another


def test_hits_first_computes_the_resident_expert_while_the_missing_one_is_read(tmp_path):
    """ONEBIT_MOE_PREFETCH_ORDER=hits with route time: the route-time op queues a layer's missing slices
    tensor by tensor, and each expert matmul takes the expert wholly in the page cache first. Layer 0
    routes experts 1 and 2 at the first decoded token, then 0 and 1: in index order the compute thread
    waits on expert 0's slices first; with hits first it computes expert 1's while they are read, so it
    stalls less, reads the same pages and finds the same ones missing. Without route: refused."""
    lay = synthetic_layout({0: 3 * P}, n_expert=4)
    # layer 0: down at pages 0-3, gate 4-7, up 8-11: the matmuls' order is up, gate, down
    assert lay.tensor_ranges(0, [2, 0]) == [[(0, 8, 9), (2, 10, 11)], [(0, 4, 5), (2, 6, 7)], [(0, 0, 1), (2, 2, 3)]]
    # wholly resident first (1), then the most read (2: half), ties and the rest by index
    assert hits_first([(0, 0, 2), (1, 2, 4), (2, 4, 6), (3, 6, 8)], {2, 3, 4}) == [
        (1, 2, 4),
        (2, 4, 6),
        (0, 0, 2),
        (3, 6, 8),
    ]
    path = tmp_path / "hits.bin"
    h = TraceHeader.build(n_layer=1, n_expert=4, n_expert_used=2, depth=2, mode=MODE_ROUTER, layers=set(), model="h")
    with TraceWriter(path, h) as w:
        for pos, actual in enumerate([[1, 2], [1, 2], [0, 1]]):
            w.add(step=pos, seq_id=0, pos=pos, layer=0, actual=actual, pred=None, decode=pos > 0)
    trace = Trace.open(path)
    model = tiny_model(layer_ms=4.0)
    plain, hits = (
        run_config(load_routing(trace), lay, model, None, "off", "x", trace, route=True, order=order)
        for order in (False, True)
    )
    assert (plain.order, hits.order) == (False, True)
    assert hits.stall_ms < plain.stall_ms
    assert hits.total_ms < plain.total_ms
    assert hits.counts.pages_read == plain.counts.pages_read
    assert hits.route_missing_pages == plain.route_missing_pages > 0
    with pytest.raises(ValueError, match="hits first is played with route time"):
        run_config(load_routing(trace), lay, model, None, "off", "x", trace, order=True)


def test_compute_from_rows_plays_each_row_at_its_own_compute(capsys, tiny, tmp_path):  # noqa: F811
    """--compute-from-rows: a row with a decode split (the decoding thread's compute, --threads 1) plays at
    that compute over the trace's MoE layers (2 here), one without at --layer-ms, and one whose compute is
    the process's (several threads: not the decoding thread's alone) at --layer-ms too; without the flag
    every row plays at --layer-ms. A slower compute gives a slower row."""
    configs = [RowConfig(route=True), RowConfig(route=True, keep="lru"), RowConfig(route=True, wait=1)]
    path = config_report(tmp_path / "c.json", configs, limit=65536)
    data = json.loads(path.read_text())
    data["rows"][0]["decode"] = {"compute_ms": 30.0, "wait_ms": 1.0, "compute_basis": "thread"}
    data["rows"][2]["decode"] = {"compute_ms": 30.0, "wait_ms": None, "compute_basis": "process"}
    path.write_text(json.dumps(data))
    args = ["--expert-bytes", "12288", "--layer-ms", "1", "--readahead-kb", "0", "--tolerance", "999", "--json"]
    rows = {}
    for flag in ([], ["--compute-from-rows"]):
        rc, out, err = run_cli(capsys, tiny, *args, *flag, "--measured", path)
        assert rc in (EXIT_OK, EXIT_CHECK_FAILED), err
        rows[bool(flag)] = {r["configuration"]: r for r in json.loads(out)["rows"]}
    own, plain = rows[True], rows[False]
    assert {r["layer_ms"] for r in plain.values()} == {1.0}
    assert own["route"]["layer_ms"] == 15.0 and own["route"]["tok_s"] < plain["route"]["tok_s"]
    assert own["route, keep lru"]["layer_ms"] == own["route, wait 1"]["layer_ms"] == 1.0
    rc, _, err = run_cli(
        capsys,
        tiny,
        *args,
        "--bandwidth",
        "4096000",
        "--memory-limit",
        "64KiB",
        "--process-bytes",
        "0",
        "--compute-from-rows",
    )
    assert rc == EXIT_USAGE and "--compute-from-rows plays a report's rows at their own compute: give --measured" in err
