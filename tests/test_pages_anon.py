"""The page model's keep anon (costmodel/anon.py; docs/cost-model.md, "keep anon"): its LRU's shares, its
chunks, reads of exactly the routed slices it lacks, hits first with each slice awaited, guesses into
the LRU's room, and a report's keep anon rows played and checked. The tiny routings, layouts and model
are test_simulate_pages.py's and test_pages_route.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onebit_predict.constants import EXIT_CHECK_FAILED, EXIT_OK, HOLD_CHUNK_BYTES, MODE_ROUTER
from onebit_predict.costmodel.anon import AnonLRU, chunks, run_anon
from onebit_predict.costmodel.layout import ExpertLayout, synthetic_layout
from onebit_predict.costmodel.page_check import playable
from onebit_predict.costmodel.pages import run_config
from onebit_predict.costmodel.routing import load_routing
from onebit_predict.costmodel.row_config import RowConfig
from onebit_predict.trace import Trace, TraceHeader
from onebit_predict.trace_writer import TraceWriter
from tests.test_pages_route import lru_trace
from tests.test_simulate_pages import P, config_report, layout_3_pages, run_cli, tiny_model

ANON = RowConfig(consumer="pread", route=True, keep="anon")
MODELS = Path(__file__).resolve().parent.parent / "models"


def anon(path, model, predictor=None, order=False, layout=None):
    trace = Trace.open(path)
    return run_anon(load_routing(trace), layout or layout_3_pages(), model, predictor, "x", trace, order)


def test_the_capacitys_remainder_goes_to_the_first_layers_and_a_batch_beyond_its_share_is_not_held():
    """Patch 0028's keep_lru: 5 experts over 2 layers hold 3 in layer 0 and 2 in layer 1 (keep lru: 2 and 2);
    a batch routing 2 fresh experts in layer 1 (one more than a token's) shares 5 - 1 = 4, so it holds both,
    and one routing 3 shares 5 - 2 = 3, 2 in layer 0 and 1 in layer 1: the ones beyond not at all."""
    lru = AnonLRU(5, [0, 1], 1)
    assert (lru.share_of(0), lru.share_of(1)) == (3, 2)
    assert lru.route(1, [0, 1]) == [] and lru.unkept == [] and list(lru.held[1]) == [0, 1]
    assert lru.route(1, [2]) == [0] and lru.unkept == []  # a token: share 2, it evicts the oldest to hold it
    assert lru.route(1, [3, 4, 5]) == [1, 2] and lru.unkept == [5, 4]  # share 1: the excess gives back 2
    assert list(lru.held[1]) == [3]
    assert lru.route(0, [0]) == [] and lru.route(0, [1]) == [] and lru.route(0, [2]) == []  # 3 places
    assert lru.route(0, [3]) == [0]


def test_a_routed_slice_is_read_in_two_or_more_chunks_of_at_most_a_mib():
    pages = HOLD_CHUNK_BYTES // P
    for n in (2, 3, pages, pages + 1, 700):
        got = chunks(10, 10 + n, P, routed=True)
        assert len(got) >= 2 and all(b - a <= pages for a, b in got)
        assert got[0][0] == 10 and got[-1][1] == 10 + n and all(x[1] == y[0] for x, y in zip(got, got[1:]))
    assert len(chunks(0, 700, P, routed=True)) == 3  # 2.7 MiB: three chunks
    assert chunks(0, 1, P, routed=True) == [(0, 1)]  # a page: one
    assert chunks(0, 700, P, routed=False) == [(0, 700)]  # a guess: one


def test_anon_reads_exactly_what_its_lru_lacks_and_holds_what_it_decides(tmp_path):
    """Layer 0 alternates experts 0 and 1, layer 1 keeps expert 2 (test_pages_route's lru trace). In 12 pages
    the LRU has 3 experts: keep lru's 1 a layer evicts layer 0's expert every token and reads it again (9
    pages); anon's remainder gives layer 0 a second place, so only expert 1's first use is read (3 pages),
    in preads, with no fault. In 9 pages (2 experts, 1 a layer) anon evicts and reads as keep lru does."""
    path = lru_trace(tmp_path / "lru.bin")
    roomy = anon(path, tiny_model(capacity_pages=12))
    assert (roomy.keep_capacity, roomy.keep_evicted, roomy.route_missing_pages) == (3, 0, 3)
    assert roomy.counts.pages_read == 3 and roomy.counts.major_faults == 0 and roomy.counts.pread_ranges == 3
    lru = run_config(load_routing(Trace.open(path)), layout_3_pages(), tiny_model(capacity_pages=12), None, "pread",
                     "x", Trace.open(path), route=True, keep=True)  # fmt: skip
    assert lru.route_missing_pages == 9
    tight = anon(path, tiny_model(capacity_pages=9))
    assert (tight.keep_capacity, tight.keep_evicted, tight.route_missing_pages) == (2, 3, 9)
    assert tight.counts.pages_read == 9 and tight.evicted_pages == 9
    assert tight.wait and tight.route_wait_ms > 0 and tight.total_ms > roomy.total_ms
    with pytest.raises(ValueError, match="under a memory limit"):
        anon(path, tiny_model())


def test_hits_first_computes_the_held_expert_while_the_missing_one_is_read(tmp_path):
    """Layer 0 routes experts 1 and 2, then 1 and 2, then 0 and 1 (expert 0 missing): with the layer's wait
    the compute thread waits for expert 0's slices before any matmul; with hits first it computes expert 1's
    (held) while they are read, so it waits less and finishes sooner, for the same reads."""
    lay = synthetic_layout({0: 3 * P}, n_expert=4)
    path = tmp_path / "hits.bin"
    h = TraceHeader.build(n_layer=1, n_expert=4, n_expert_used=2, depth=2, mode=MODE_ROUTER, layers=set(), model="h")
    with TraceWriter(path, h) as w:
        for pos, actual in enumerate([[1, 2], [1, 2], [0, 1]]):
            w.add(step=pos, seq_id=0, pos=pos, layer=0, actual=actual, pred=None, decode=pos > 0)
    model = tiny_model(layer_ms=4.0, capacity_pages=64)
    plain, hits = (anon(path, model, order=order, layout=lay) for order in (False, True))
    assert (plain.order, plain.wait, hits.order, hits.wait) == (False, True, True, False)
    assert hits.route_wait_ms < plain.route_wait_ms and hits.total_ms < plain.total_ms
    assert hits.counts.pages_read == plain.counts.pages_read == hits.route_missing_pages == 3


def test_the_dense_pages_faults_count_in_the_stall(tmp_path):
    """Each layer reads one dense page of its own before its router. Without the prefill's replay the first
    decoded token faults both in (1 ms of latency and 1 ms of transfer each, the drive idle then), and the
    compute thread's wait for them is the stall's beyond the slices' wait (before, the stall was the
    slices' wait alone)."""
    lay = layout_3_pages()
    dense = ExpertLayout(lay.file_bytes + 2 * P, lay.layers, 4, "test", dense={0: ((lay.file_bytes, P),),
                         1: ((lay.file_bytes + P, P),)})  # fmt: skip
    path = lru_trace(tmp_path / "lru.bin")
    run = anon(path, tiny_model(capacity_pages=13, prefill=False), layout=dense)
    assert run.counts.major_faults == 2 and run.route_wait_ms > 0
    assert run.stall_ms - run.route_wait_ms == 2 * 2.0
    plain = anon(path, tiny_model(capacity_pages=13, prefill=False))
    assert plain.counts.major_faults == 0 and plain.stall_ms == plain.route_wait_ms  # no dense pages


def guess_trace(path, pred):
    """2 layers of 4 experts, top-1: layer 0 alternates 0 and 1, layer 1 routes 2 and is guessed ``pred``."""
    h = TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=1, depth=2, mode=MODE_ROUTER, layers={1}, model="g")
    with TraceWriter(path, h) as w:
        for pos in range(4):
            w.add(step=pos, seq_id=0, pos=pos, layer=0, actual=[pos % 2], pred=None, decode=pos > 0)
            w.add(step=pos, seq_id=0, pos=pos, layer=1, actual=[2], pred=pred, decode=pos > 0)
    return Trace.open(path)


def test_guesses_go_into_the_lrus_room_and_the_oracles_are_never_read_twice(tmp_path):
    """Wrong guesses (experts 3 and 0) take the one place for guesses and skip the other, and are freed
    unused at layer 1's route, every decoded token, as keep lru's. The oracle's guess of layer 1's expert
    is read while layer 0 computes; it is then held or on its way when routed, never read a second time."""
    wrong = guess_trace(tmp_path / "wrong.bin", [3, 0])
    model = tiny_model(capacity_pages=15, layer_ms=2.0)
    guessed = run_anon(load_routing(wrong), layout_3_pages(), model, "router", "x", wrong)
    assert (guessed.spec_skipped, guessed.spec_unused) == (3, 3)
    alone = run_anon(load_routing(wrong), layout_3_pages(), model, None, "x", wrong)
    assert (alone.spec_skipped, alone.spec_unused) == (0, 0)
    assert guessed.keep_capacity == alone.keep_capacity - 1  # the guesses' place comes out of the LRU
    assert guessed.counts.pages_read == alone.counts.pages_read + 3 * 3  # a guess read a token, unused
    layer1 = tiny_model(capacity_pages=9, layer_ms=2.0)  # 1 expert a layer... and layer 1 moves
    moving = tmp_path / "moving.bin"
    h = TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=1, depth=1, mode=MODE_ROUTER, layers={1}, model="m")
    with TraceWriter(moving, h) as w:
        for pos in range(4):
            w.add(step=pos, seq_id=0, pos=pos, layer=0, actual=[0], pred=None, decode=pos > 0)
            w.add(step=pos, seq_id=0, pos=pos, layer=1, actual=[pos], pred=[pos], decode=pos > 0)
    trace = Trace.open(moving)
    oracle = run_anon(load_routing(trace), layout_3_pages(), layer1, "oracle", "x", trace)
    none = run_anon(load_routing(trace), layout_3_pages(), layer1, None, "x", trace)
    assert none.route_missing_pages == 9 and none.counts.pages_read == 9  # layer 1's new expert, each token
    assert oracle.counts.pages_read == 9  # the same slices, read on the guess instead
    assert oracle.route_wait_ms < none.route_wait_ms


def test_a_reports_keep_anon_rows_are_played_and_checked(capsys, tmp_path):
    """simulate plays a row of ``pread + route, keep anon`` (and with hits first) against a report; before,
    it listed it as no configuration of the trace."""
    path = lru_trace(tmp_path / "lru.bin")
    routing = load_routing(Trace.open(path))
    assert playable(ANON, routing) and playable(RowConfig(consumer="pread", route=True, keep="anon", order="hits"),
                                                routing)  # fmt: skip
    rows = [RowConfig(route=True, keep="lru"), ANON, RowConfig(consumer="pread", route=True, keep="anon", order="hits")]
    report = config_report(tmp_path / "anon.json", rows, limit=12 * P)
    args = ["--expert-bytes", "12288", "--layer-ms", "0", "--readahead-kb", "0", "--tolerance", "999", "--json"]
    rc, out, err = run_cli(capsys, path, *args, "--measured", report)
    assert rc in (EXIT_OK, EXIT_CHECK_FAILED), err
    got = {r["configuration"]: r for r in json.loads(out)["rows"]}
    assert set(got) == {c.name for c in rows}
    a = got[ANON.name]
    assert a["checked"] and a["kind"] == "route" and a["major_faults_per_token"] == 0
    assert a["keep_evicted_per_token"] == 0 and got[rows[0].name]["keep_evicted_per_token"] > 0


def test_exact_plays_madv_random_on_the_expert_pages(tmp_path):
    """``exact`` (the consumer's MADV_RANDOM on the expert tensors): a dense fault's read-around still
    reads its window, but a readahead marker on an expert page pulls nothing more, so the same decode
    reads fewer pages than without it, on the bundled model's real layout (dense tensors between the
    experts). Before, keep anon's model ignored it and read the same pages either way."""
    from dataclasses import replace

    from onebit_predict.costmodel.layout import layout_from_gguf

    lay, n_expert = layout_from_gguf(MODELS / "qwen3moe-tiny.gguf")
    path = tmp_path / "t.bin"
    h = TraceHeader.build(n_layer=8, n_expert=n_expert, n_expert_used=4, depth=4, mode=MODE_ROUTER, layers=set(),
                          model="t")  # fmt: skip
    rng = __import__("random").Random(5)
    with TraceWriter(path, h) as w:
        for pos in range(24):
            for layer in range(8):
                w.add(step=pos, seq_id=0, pos=pos, layer=layer, actual=rng.sample(range(n_expert), 4), pred=None,
                      decode=pos > 0)  # fmt: skip
    trace = Trace.open(path)
    model = tiny_model(capacity_pages=200, window_pages=64, layer_ms=0.1)
    plain = run_anon(load_routing(trace), lay, model, None, "x", trace, True)
    exact = run_anon(load_routing(trace), lay, replace(model, random_experts=True), None, "x", trace, True)
    assert exact.counts.pages_read < plain.counts.pages_read
    assert exact.route_missing_pages == plain.route_missing_pages  # the experts' own reads are the same
