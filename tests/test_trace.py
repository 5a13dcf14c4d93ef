"""The trace reader and writer against docs/trace-format.md: layout, validation, truncation."""

from __future__ import annotations

import dataclasses
import logging
import math
import struct

import numpy as np
import pytest

from onebit_predict.commands.stats_out import header_dict, prefetch_summary
from onebit_predict.constants import (
    MODE_BLOCK,
    PREFETCH_ADVISE,
    PREFETCH_POPULATE,
    PREFETCH_PREAD,
    PREFETCH_READ,
    TRACE_FLAG_DECODE,
    TRACE_FLAG_PREDICTED,
    TRACE_HDR_FLAG_RANDOM,
    TRACE_HDR_FLAG_ROUTE,
    TRACE_HDR_FLAG_SPECULATIVE,
    TRACE_HDR_FLAG_WAIT,
    TRACE_HDR_FLAGS_KNOWN,
)
from onebit_predict.trace import PrefetchTotals, Trace, TraceError, TraceHeader, open_trace, record_dtype


def small_header(**kw) -> TraceHeader:
    args = dict(n_layer=4, n_expert=8, n_expert_used=2, depth=3, arch="qwen3moe", model="Tiny-MoE")
    args.update(kw)
    return TraceHeader.build(**args)


ROWS = [
    dict(step=0, seq_id=0, pos=5, layer=0, actual=[1, 2], weights=[0.75, 0.25]),
    dict(
        step=0,
        seq_id=0,
        pos=5,
        layer=1,
        actual=[3, 4],
        weights=[0.5, 0.5],
        pred=[3, 7, 4],
        logits=[2.0, 1.5, 1.0],
        n_read=3,
    ),
    dict(
        step=1, seq_id=2, pos=6, layer=1, actual=[0, 7], pred=[7, 0, 1], logits=[1.0, 0.0, -1.0], n_read=2, decode=False
    ),
]


# --- layout ----------------------------------------------------------------------------


def doc_header(
    n_layer=4,
    n_expert=8,
    n_used=2,
    depth=3,
    version=1,
    header_size=512,
    record_size=None,
    magic=b"OBMPTRC\0",
    mode=2,
    margin=0.5,
    min_read=1,
    mask_layers=(1, 3, 9),
) -> bytes:
    """A header packed field by field from the table in docs/trace-format.md (not via the reader)."""
    mask = bytearray(64)
    for layer in mask_layers:
        mask[layer // 8] |= 1 << (layer % 8)
    rs = 20 + 8 * n_used + 8 * depth if record_size is None else record_size
    head = struct.pack(
        "<8sIIIIIIIIifII",
        magic,
        version,
        header_size,
        rs,
        n_layer,
        n_expert,
        n_used,
        depth,
        mode,
        5,
        margin,
        min_read,
        0b11,
    )
    out = head + bytes(mask) + b"qwen3moe".ljust(32, b"\0") + b"Some Model".ljust(256, b"\0") + bytes(104)
    assert len(out) == 512
    return out


def doc_record(step, seq, pos, layer, n_read, flags, actual, weights, pred, logits) -> bytes:
    return struct.pack("<IiiHHHH", step, seq, pos, layer, n_read, flags, 0) + struct.pack(
        f"<{len(actual)}i{len(weights)}f{len(pred)}i{len(logits)}f", *actual, *weights, *pred, *logits
    )


def test_reads_the_documented_layout(tmp_path):
    path = tmp_path / "doc.trace"
    path.write_bytes(
        doc_header()
        + doc_record(
            step=3,
            seq=1,
            pos=42,
            layer=1,
            n_read=2,
            flags=TRACE_FLAG_PREDICTED | TRACE_FLAG_DECODE,
            actual=[5, 6],
            weights=[0.625, 0.375],
            pred=[6, 5, 0],
            logits=[1.5, 1.25, -2.0],
        )
        + doc_record(
            step=3,
            seq=1,
            pos=42,
            layer=2,
            n_read=0,
            flags=TRACE_FLAG_DECODE,
            actual=[7, 0],
            weights=[0.5, 0.5],
            pred=[-1, -1, -1],
            logits=[math.nan] * 3,
        )
    )
    t = open_trace(path)
    h = t.header
    assert (h.version, h.header_size, h.record_size) == (1, 512, 20 + 16 + 24)
    assert (h.n_layer, h.n_expert, h.n_expert_used, h.depth) == (4, 8, 2, 3)
    assert (h.mode, h.mode_name, h.depth_requested, h.margin, h.min_read) == (2, "block", 5, 0.5, 1)
    assert h.no_attn and h.stats  # flags 0b11
    assert h.layer_mask == frozenset({1, 3, 9})  # byte l/8, bit l%8
    assert (h.arch, h.model) == ("qwen3moe", "Some Model")
    assert isinstance(t.records, np.memmap) and t.n_records == 2 and t.dropped_bytes == 0
    r = t.records[0]
    assert (r["step"], r["seq_id"], r["pos"], r["layer"], r["n_read"], r["flags"]) == (3, 1, 42, 1, 2, 3)
    ids, w = t.actual()
    assert ids.tolist() == [[5, 6], [7, 0]] and w.tolist() == [[0.625, 0.375], [0.5, 0.5]]
    pids, logits = t.predicted()
    assert pids.tolist() == [[6, 5, 0], [-1, -1, -1]]
    assert logits[0].tolist() == [1.5, 1.25, -2.0] and np.isnan(logits[1]).all()
    assert t.actual(1, 2)[0].tolist() == [[7, 0]]


def test_writer_round_trip(tmp_path, write_trace):
    h = small_header(mode=MODE_BLOCK, margin=0.25, min_read=1, layers={1, 2}, flags=1)
    t = Trace.open(write_trace(tmp_path / "t", h, ROWS))
    assert t.header == h
    assert (tmp_path / "t").stat().st_size == 512 + 3 * h.record_size
    assert h.record_size == 20 + 8 * 2 + 8 * 3 == record_dtype(2, 3).itemsize
    rec = t.records
    assert rec["seq_id"].tolist() == [0, 0, 2] and rec["pos"].tolist() == [5, 5, 6]
    assert rec["layer"].tolist() == [0, 1, 1] and rec["n_read"].tolist() == [0, 3, 2]
    # flags: unpredicted decode row; predicted decode row; predicted prefill row
    assert rec["flags"].tolist() == [TRACE_FLAG_DECODE, TRACE_FLAG_DECODE | TRACE_FLAG_PREDICTED, TRACE_FLAG_PREDICTED]
    assert rec["actual_w"][0].tolist() == [0.75, 0.25]
    assert rec["actual_w"][2].tolist() == [0.5, 0.5]  # the writer's default: 1/n_used each
    assert rec["pred_ids"].tolist() == [[-1, -1, -1], [3, 7, 4], [7, 0, 1]]
    assert np.isnan(rec["pred_logits"][0]).all()


def test_model_name_truncated_to_255_bytes_and_decoded(tmp_path, write_trace):
    long = "Ü" * 200  # 400 bytes of UTF-8: cut at 255, inside a character
    t = Trace.open(write_trace(tmp_path / "t", small_header(model=long)))
    assert t.header.model == "Ü" * 127 + "\ufffd"  # 254 bytes, then half a character: replaced


def test_iter_chunks_covers_records_in_order(tmp_path, write_trace):
    rows = [dict(step=i, seq_id=0, pos=i, layer=1, actual=[i % 8, (i + 1) % 8]) for i in range(10)]
    t = Trace.open(write_trace(tmp_path / "t", small_header(), rows))
    chunks = list(t.iter_chunks(4))
    assert [len(c) for c in chunks] == [4, 4, 2]
    assert np.concatenate(chunks)["pos"].tolist() == list(range(10))
    with pytest.raises(ValueError):
        next(t.iter_chunks(0))


# --- bad input -------------------------------------------------------------------------


def test_empty_trace_is_valid(tmp_path, write_trace):
    t = Trace.open(write_trace(tmp_path / "t", small_header()))
    assert t.n_records == 0 and t.dropped_bytes == 0
    assert t.records.dtype == t.header.dtype
    assert list(t.iter_chunks()) == []


def test_truncated_trace_reads_whole_records_and_warns(tmp_path, caplog, write_trace):
    h = small_header()
    path = write_trace(tmp_path / "t", h, ROWS)
    data = path.read_bytes()
    path.write_bytes(data[: 512 + 2 * h.record_size + 17])  # 2 whole records and 17 bytes of the third
    with caplog.at_level(logging.WARNING, logger="onebit_predict.trace"):
        t = Trace.open(path)
    assert t.n_records == 2 and t.dropped_bytes == 17
    assert t.records["layer"].tolist() == [0, 1]
    assert "dropped 17 bytes" in caplog.text


def test_missing_file_is_an_os_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        Trace.open(tmp_path / "absent")


@pytest.mark.parametrize("size", [0, 100, 511])
def test_file_shorter_than_header(tmp_path, size):
    path = tmp_path / "t"
    path.write_bytes(doc_header()[:size])
    with pytest.raises(TraceError, match=f"file is {size} bytes, shorter than the 512-byte header"):
        Trace.open(path)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(magic=b"GGUF\0\0\0\0"), "bad magic"),
        (dict(version=4), "version 4 is not supported"),
        (dict(version=0), "version 0 is not supported"),
        (dict(header_size=256), "header_size 256 != 512"),
        (dict(record_size=61), "record_size 61 != 60"),
        (dict(n_used=9, record_size=20 + 72 + 24), "n_expert_used 9 is not in 1..n_expert"),
        (dict(n_used=0, record_size=20 + 24), "n_expert_used 0 is not in 1..n_expert"),
        (dict(depth=9, record_size=20 + 16 + 72, min_read=1), "depth 9 is not in 1..n_expert"),
        (dict(n_layer=0), "n_layer 0 is not in 1..512"),
        (dict(n_layer=513), "n_layer 513 is not in 1..512"),
        (dict(n_expert=0, n_used=0, depth=0, min_read=0), "n_expert is 0"),
        (dict(mode=4), "unknown mode 4"),
        (dict(margin=-1.0), "margin -1.0 is not"),
        (dict(margin=math.nan), "margin nan is not"),
        (dict(min_read=4), "min_read 4 exceeds depth 3"),
    ],
)
def test_bad_header_raises_trace_error(tmp_path, kw, message):
    path = tmp_path / "t"
    path.write_bytes(doc_header(**kw))
    with pytest.raises(TraceError, match=message) as err:
        Trace.open(path)
    assert isinstance(err.value, ValueError)


def test_header_to_bytes_does_not_validate(tmp_path, write_trace):
    """Tests build bad headers with the writer; the reader is what refuses them."""
    bad = dataclasses.replace(small_header(), record_size=7)
    path = write_trace(tmp_path / "t", bad)
    with pytest.raises(TraceError, match="record_size 7"):
        Trace.open(path)


# --- version 2: the prefetch consumer's fields -------------------------------------------


def test_prefetch_fields_at_their_documented_offsets(tmp_path):
    """Offsets 408.. as docs/trace-format.md gives them, packed by hand, not by the reader."""
    head = bytearray(doc_header(version=2))
    flags = struct.unpack_from("<I", head, 52)[0] | 8
    struct.pack_into("<I", head, 52, flags)
    struct.pack_into("<IIq", head, 408, 2, 3, 65536)
    struct.pack_into("<9Q", head, 424, 5, 15, 61440, 4, 20480, 2, 8192, 1, 40960)
    struct.pack_into("<4I", head, 496, 22, 2, 0, 0)  # EINVAL twice
    path = tmp_path / "t"
    path.write_bytes(bytes(head))
    h = Trace.open(path).header
    assert (h.version, h.prefetch_name, h.prefetch_threads, h.prefetch_max_bytes) == (2, "read", 3, 65536)
    t = h.prefetch_totals
    assert (t.experts, t.ranges, t.bytes, t.resident_ranges, t.resident_bytes) == (5, 15, 61440, 4, 20480)
    assert (t.failed, t.dropped_bytes, t.queue_full, t.touched_bytes, t.errors) == (2, 8192, 1, 40960, ((22, 2),))


def test_prefetch_totals_absent_without_the_flag(tmp_path):
    """A context that was never freed (a crash) leaves the totals unwritten: None, not zeros."""
    head = bytearray(doc_header(version=2))
    struct.pack_into("<IIq", head, 408, 1, 2, 0)
    path = tmp_path / "t"
    path.write_bytes(bytes(head))
    h = Trace.open(path).header
    assert h.prefetch_name == "advise" and h.prefetch_totals is None


def test_version_1_has_no_prefetch(tmp_path):
    path = tmp_path / "t"
    path.write_bytes(doc_header(version=1))
    h = Trace.open(path).header
    assert (h.version, h.prefetch_mode, h.prefetch_totals) == (1, 0, None)


def test_unknown_prefetch_mode_is_rejected(tmp_path):
    head = bytearray(doc_header(version=2))
    struct.pack_into("<I", head, 408, 7)
    path = tmp_path / "t"
    path.write_bytes(bytes(head))
    with pytest.raises(TraceError, match="unknown prefetch mode 7"):
        Trace.open(path)


# --- the consumer's bits 12..15: route time, readahead off, speculative, the wait -------------


def test_consumer_bits_at_their_documented_offset(tmp_path):
    """Bits 12, 13, 14 and 15 of the u32 at offset 52, and the populate call (3), packed by hand."""
    head = bytearray(doc_header(version=3))
    flags = struct.unpack_from("<I", head, 52)[0] | 1 << 8 | 1 << 12 | 1 << 13 | 1 << 14 | 1 << 15 | 4 << 16
    struct.pack_into("<I", head, 52, flags)
    struct.pack_into("<IIq", head, 408, 3, 8, 0)
    path = tmp_path / "t"
    path.write_bytes(bytes(head))
    h = Trace.open(path).header
    assert (h.prefetch_name, h.prefetch_threads) == ("populate", 8)
    assert (h.route, h.random, h.speculative, h.wait) == (True, True, True, True)
    assert (h.ahead, h.prefetch_guard, h.no_attn, h.stats) == (1, 4, True, True)  # the neighbours are untouched


@pytest.mark.parametrize(
    ("bit", "name"),
    [
        (TRACE_HDR_FLAG_ROUTE, "route"),
        (TRACE_HDR_FLAG_RANDOM, "random"),
        (TRACE_HDR_FLAG_SPECULATIVE, "speculative"),
        (TRACE_HDR_FLAG_WAIT, "wait"),
    ],
)
def test_each_consumer_bit_round_trips_alone(bit, name):
    assert bit & TRACE_HDR_FLAGS_KNOWN == bit
    names = ("route", "random", "speculative", "wait")
    built = dataclasses.replace(small_header(flags=bit), prefetch_mode=PREFETCH_POPULATE, prefetch_threads=8)
    h = TraceHeader.from_bytes(built.to_bytes())  # validated: the bit is not refused
    assert {n: getattr(h, n) for n in names} == {n: n == name for n in names}
    assert not getattr(TraceHeader.from_bytes(small_header().to_bytes()), name)


def test_consumer_bits_are_distinct_and_bit_24_is_still_refused(tmp_path):
    bits = (TRACE_HDR_FLAG_ROUTE, TRACE_HDR_FLAG_RANDOM, TRACE_HDR_FLAG_SPECULATIVE, TRACE_HDR_FLAG_WAIT)
    assert bits == (0x1000, 0x2000, 0x4000, 0x8000)
    assert TRACE_HDR_FLAGS_KNOWN >> 24 == 0  # bits 16..23 are the guard's window; nothing above it
    head = bytearray(small_header().to_bytes())
    struct.pack_into("<I", head, 52, struct.unpack_from("<I", head, 52)[0] | 1 << 24)
    with pytest.raises(TraceError, match="unknown bits 0x1000000"):
        TraceHeader.from_bytes(bytes(head))


def test_stats_summary_names_what_the_consumer_read():
    route_only = small_header(flags=TRACE_HDR_FLAG_ROUTE | TRACE_HDR_FLAG_RANDOM)
    route_only = dataclasses.replace(route_only, prefetch_mode=PREFETCH_POPULATE, prefetch_threads=8)
    line = prefetch_summary(route_only)
    assert line.startswith("\nprefetch populate (reads at route time, readahead off) | cap none | 8 workers | totals")
    both = dataclasses.replace(route_only, flags=route_only.flags ^ TRACE_HDR_FLAG_RANDOM | TRACE_HDR_FLAG_SPECULATIVE)
    assert prefetch_summary(both).startswith("\nprefetch populate (reads predicted + at route time) | cap none")
    d = header_dict(both)
    assert (d["prefetch_mode"], d["prefetch_speculative"], d["prefetch_route"], d["prefetch_random"]) == (
        "populate",
        True,
        True,
        False,
    )
    # a trace from before the bits: the predicted experts were the consumer's only reads, said as before
    old = dataclasses.replace(small_header(), prefetch_mode=PREFETCH_ADVISE, prefetch_threads=2)
    assert prefetch_summary(old).startswith("\nprefetch advise | cap none | totals unknown")


def test_stats_summary_says_the_route_time_op_waited():
    """Bit 15 (WAIT) on the consumer's line, after what it read and before readahead off, and in --json."""
    flags = TRACE_HDR_FLAG_ROUTE | TRACE_HDR_FLAG_WAIT
    waited = dataclasses.replace(small_header(flags=flags), prefetch_mode=PREFETCH_READ, prefetch_threads=8)
    line = prefetch_summary(waited)
    assert line.startswith("\nprefetch read (reads at route time, each layer waiting for its reads) | cap none | 8 w")
    exact = dataclasses.replace(waited, flags=flags | TRACE_HDR_FLAG_RANDOM | TRACE_HDR_FLAG_SPECULATIVE)
    assert prefetch_summary(exact).startswith(
        "\nprefetch read (reads predicted + at route time, each layer waiting for its reads, readahead off) | cap none"
    )
    assert (header_dict(waited)["prefetch_wait"], header_dict(exact)["prefetch_wait"]) == (True, True)
    # without the bit: not a word of it, and False in --json
    unwaited = dataclasses.replace(waited, flags=TRACE_HDR_FLAG_ROUTE)
    assert "waiting" not in prefetch_summary(unwaited) and header_dict(unwaited)["prefetch_wait"] is False


def test_stats_summary_of_a_pread_consumer():
    """pread (prefetch_mode 4): its workers and the bytes they read, as for read and populate."""
    totals = PrefetchTotals(3, 6, 3 << 20, 1, 4096, 0, 0, 2, 3 << 20, errors=())
    h = dataclasses.replace(
        small_header(flags=TRACE_HDR_FLAG_ROUTE | TRACE_HDR_FLAG_WAIT),
        prefetch_mode=PREFETCH_PREAD,
        prefetch_threads=4,
        prefetch_totals=totals,
    )
    assert h.prefetch_name == "pread"
    line = prefetch_summary(h)
    waits = "(reads at route time, each layer waiting for its reads)"
    assert line.startswith(f"\nprefetch pread {waits} | cap none | 4 workers | 3 experts, 6 ranges")
    assert f" | {3 << 20} bytes touched | 2 ranges not queued | no failures" in line
