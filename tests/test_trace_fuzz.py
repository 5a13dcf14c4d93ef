"""A trace with a damaged header: onebit-stats exits 0, 1 or 2 with a one-line message, never a traceback.

The fuzz test mutates 1..8 bytes of a valid trace's 512-byte header and runs the onebit-stats
command in-process; the explicit cases set one field out of its bounds (docs/trace-format.md,
"Bounds a reader enforces") and expect exit 2 with a message naming the field. Before the
header was bounded, n_expert = 2^31 passed the reader and ended in an OverflowError traceback
in the compiled stats kernel (its int32 arguments).
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import struct
import tempfile
import traceback
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from onebit_predict.constants import (
    EXIT_USAGE,
    MAX_LAYERS,
    MODE_ROUTER,
    PREFETCH_READ,
    TRACE_HEADER_SIZE,
    TRACE_MAX_DEPTH,
    TRACE_MAX_EXPERTS,
)
from onebit_predict.trace import PrefetchTotals, TraceHeader
from onebit_predict.trace_writer import TraceWriter

REPO = Path(__file__).resolve().parent.parent
PROG = "onebit-stats"


def _stats_main():
    """onebit-stats' ``main``, from where pyproject.toml's entry point says it is."""
    # a regex, not tomllib: that needs Python 3.11, the project takes 3.10
    entry = re.search(rf'^{PROG}\s*=\s*"([^"]+)"', (REPO / "pyproject.toml").read_text(), re.MULTILINE)
    assert entry, f"pyproject.toml has no {PROG} entry point"
    # the entry point first; the command modules' old and new homes while they move
    specs = dict.fromkeys([entry[1], "onebit_predict.commands.stats:main", "onebit_predict.cli_stats:main"])
    for spec in specs:
        module, _, attr = spec.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ModuleNotFoundError as e:
            if e.name != module:  # the module exists but is broken: that is a failure
                raise
    raise AssertionError(f"no importable {PROG} main among {list(specs)}")


main = _stats_main()


def _valid_trace(version: int = 2) -> bytes:
    """A small valid trace: 4 layers, 8 experts, top-2, depth 3, prefetch totals, 2 tokens (version 3:
    its predictions one layer ahead)."""
    h = TraceHeader.build(
        version=version,
        n_layer=4,
        n_expert=8,
        n_expert_used=2,
        depth=3,
        mode=MODE_ROUTER,
        layers={1, 2, 3},
        arch="qwen3moe",
        model="Tiny-MoE",
    )
    h = dataclasses.replace(
        h,
        prefetch_mode=PREFETCH_READ,
        prefetch_threads=2,
        prefetch_max_bytes=1 << 20,
        prefetch_totals=PrefetchTotals(6, 18, 73728, 3, 12288, 1, 0, 2, 61440, errors=((22, 1),)),
    )
    rows = []
    for pos in range(2):
        for layer in range(4):
            actual = [(layer + pos) % 8, (layer + pos + 3) % 8]
            pred = None if layer == 0 else [actual[0], (actual[0] + 1) % 8, actual[1]]
            rows.append(dict(step=pos, seq_id=0, pos=pos, layer=layer, actual=actual, pred=pred))
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t"
        with TraceWriter(path, h) as w:
            for row in rows:
                w.add(**row)
        data = bytearray(path.read_bytes())
    if version >= 3:  # offset 18 of each record: the distance, 1 where PREDICTED (every layer but 0)
        for i, row in enumerate(rows):
            struct.pack_into("<H", data, TRACE_HEADER_SIZE + i * h.record_size + 18, int(row["pred"] is not None))
    return bytes(data)


VALID = _valid_trace()
VALID_V3 = _valid_trace(3)
RECORD_SIZE = 20 + 8 * 2 + 8 * 3


def run_stats(capsys, path: Path) -> tuple[int, str]:
    """``main([path])`` in-process: its exit code and stderr, failing on any exception that escapes."""
    capsys.readouterr()  # drop what an earlier example left
    try:
        rc = main([str(path)])
    except (Exception, SystemExit):
        pytest.fail(f"an exception escaped {PROG}'s main:\n{traceback.format_exc()}")
    _, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return rc, err


def check_clean_exit(rc: int, err: str) -> None:
    """0, 1 or 2, every stderr line a ``onebit-stats: LEVEL: ...`` log line; exit 2 says why."""
    assert rc in (0, 1, 2), (rc, err)
    lines = err.splitlines()
    assert all(line.startswith(f"{PROG}: ") for line in lines), err
    if rc == EXIT_USAGE:
        assert any(line.startswith(f"{PROG}: ERROR: ") for line in lines), err


@pytest.mark.parametrize("data", [VALID, VALID_V3], ids=["v2", "v3"])
def test_the_valid_trace_passes(capsys, tmp_path, data):
    path = tmp_path / "t"
    path.write_bytes(data)
    rc, err = run_stats(capsys, path)
    assert (rc, err) == (0, "")


# positions: half in the numeric fields and the mask (0..119), half anywhere in the header;
# values: often the edges of a byte, which make fields 0, huge or negative
POSITIONS = st.one_of(st.integers(0, 119), st.integers(0, TRACE_HEADER_SIZE - 1))
VALUES = st.one_of(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF]), st.integers(0, 255))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(st.tuples(POSITIONS, VALUES), min_size=1, max_size=8))
def test_mutated_header_never_ends_in_a_traceback(capsys, tmp_path, mutations):
    data = bytearray(VALID)
    for pos, value in mutations:
        data[pos] = value
    path = tmp_path / "t"
    path.write_bytes(bytes(data))
    check_clean_exit(*run_stats(capsys, path))


# a version-3 record's layer, n_read, flags and distance (offsets 12..19), the fields a bad
# distance is judged by: a mutation there exits 0, 1 (the control) or 2 (a bad distance), cleanly
RECORD_BYTES = st.tuples(st.integers(0, 7), st.integers(12, 19)).map(
    lambda t: TRACE_HEADER_SIZE + t[0] * RECORD_SIZE + t[1]
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=st.lists(st.tuples(RECORD_BYTES, VALUES), min_size=1, max_size=4))
def test_mutated_version_3_records_never_end_in_a_traceback(capsys, tmp_path, mutations):
    data = bytearray(VALID_V3)
    for pos, value in mutations:
        data[pos] = value
    path = tmp_path / "t"
    path.write_bytes(bytes(data))
    rc, err = run_stats(capsys, path)
    check_clean_exit(rc, err)
    if rc == EXIT_USAGE:
        assert f"{PROG}: ERROR: {path}: bad trace record " in err and "distance" in err, err


def test_version_2_trace_relabelled_3_exits_2(capsys, tmp_path):
    """Version 2's PREDICTED records have distance 0: as version 3 they are malformed."""
    path = tmp_path / "t"
    flags = struct.unpack_from("<I", VALID, 52)[0]
    path.write_bytes(_fields((8, "<I", 3), (52, "<I", flags | 1 << 8)))  # ahead 1 in the flags
    rc, err = run_stats(capsys, path)
    assert rc == EXIT_USAGE and "bad trace record 1 " in err and "distance 0 is not in 1..3" in err, err
    # relabelled alone, its header has no ahead (flags bits 8..11): refused before any record
    path.write_bytes(_field(8, "<I", 3))
    rc, err = run_stats(capsys, path)
    assert rc == EXIT_USAGE and "ahead 0 (flags bits 8..11) is not in 1..3" in err, err


def _fields(*fields: tuple[int, str, object]) -> bytes:
    """VALID with each (offset, struct format, value) packed into its header."""
    data = bytearray(VALID)
    for offset, fmt, value in fields:
        struct.pack_into(fmt, data, offset, value)
    return bytes(data)


def _field(offset: int, fmt: str, value) -> bytes:
    return _fields((offset, fmt, value))


def _terminator_removed(offset: int, size: int) -> bytes:
    data = bytearray(VALID)
    data[offset : offset + size] = b"x" * size
    return bytes(data)


OUT_OF_BOUNDS = [
    # finding 8: n_expert at or above 2^31 reached the stats kernel's int32 and ended in a traceback
    (_field(24, "<I", 2**31), f"n_expert is {2**31}, not in 1..{TRACE_MAX_EXPERTS}"),
    (_field(24, "<I", 2**32 - 1), f"n_expert is {2**32 - 1}, not in 1..{TRACE_MAX_EXPERTS}"),
    (_field(24, "<I", 0), "n_expert is 0, not in"),
    (_field(20, "<I", 0), f"n_layer 0 is not in 1..{MAX_LAYERS}"),
    (_field(20, "<I", MAX_LAYERS + 1), f"n_layer {MAX_LAYERS + 1} is not in 1..{MAX_LAYERS}"),
    (_field(20, "<I", 2**32 - 1), f"n_layer {2**32 - 1} is not in 1..{MAX_LAYERS}"),
    (_field(28, "<I", 9), "n_expert_used 9 is not in 1..n_expert (8)"),
    (_field(28, "<I", 2**31), f"n_expert_used {2**31} is not in 1..n_expert (8)"),
    (
        _fields((24, "<I", 1 << 20), (32, "<I", TRACE_MAX_DEPTH + 1)),
        f"depth {TRACE_MAX_DEPTH + 1} is not in 1..{TRACE_MAX_DEPTH}",
    ),
    (
        _fields((24, "<I", 1 << 20), (28, "<I", TRACE_MAX_DEPTH + 1)),
        f"n_expert_used {TRACE_MAX_DEPTH + 1} is not in 1..{TRACE_MAX_DEPTH}",
    ),
    (_field(32, "<I", 2**31), f"depth {2**31} is not in 1..n_expert (8)"),
    (_field(16, "<I", 2**32 - 1), f"record_size {2**32 - 1} != 60"),
    (_field(8, "<I", 99), "version 99 is not supported"),
    (_field(12, "<I", 2**31), f"header_size {2**31} != 512"),
    (_field(36, "<I", 2**31), f"unknown mode {2**31}"),
    (_field(40, "<i", -1), "depth_requested -1 is not in 0.."),
    (_field(44, "<f", float("nan")), "margin nan is not"),
    (_field(44, "<f", float("-inf")), "margin -inf is not"),
    (_field(48, "<I", 2**31), f"min_read {2**31} exceeds depth 3"),
    (_field(52, "<I", 0x80000008), "flags 0x80000008 has unknown bits 0x80000000"),
    (_field(120, "<32s", b"x" * 32), "arch is not NUL-terminated within its 32 bytes"),
    (_terminator_removed(152, 256), "model is not NUL-terminated within its 256 bytes"),
    (_field(408, "<I", 2**31), f"unknown prefetch mode {2**31}"),
    (_field(412, "<I", 2**31), f"prefetch_threads {2**31} is not in 0..16"),
    (_field(416, "<q", -1), "prefetch cap -1 is negative"),
    (_field(416, "<q", 2**62), f"prefetch_max_bytes {2**62} is not in 0.."),
    (_field(424, "<Q", 2**64 - 1), f"prefetch_totals.experts {2**64 - 1} is not in 0..{2**63 - 1}"),
    (_field(496, "<I", 2**31), f"prefetch_errors[0] errno {2**31} is not in 1..4095"),
]


IDS = [m.split(" is")[0].split(" !=")[0] for _, m in OUT_OF_BOUNDS]  # the field's name, and its value


@pytest.mark.parametrize("data, message", OUT_OF_BOUNDS, ids=IDS)
def test_field_out_of_bounds_exits_2_naming_it(capsys, tmp_path, data, message):
    path = tmp_path / "t"
    path.write_bytes(data)
    rc, err = run_stats(capsys, path)
    assert rc == EXIT_USAGE, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{PROG}: ERROR: {path}: "), err
    assert message in lines[0], err


def test_largest_n_expert_is_read(capsys, tmp_path):
    """n_expert = 2^31-1 is in bounds: the stats kernel takes it (its tables are capped) and exits 0."""
    path = tmp_path / "t"
    path.write_bytes(_field(24, "<I", TRACE_MAX_EXPERTS))
    assert run_stats(capsys, path) == (0, "")


def test_prefetch_totals_flag_in_a_version_1_trace_exits_2(capsys, tmp_path):
    data = bytearray(_field(8, "<I", 1))
    data[408:512] = bytes(104)  # version 1: offsets 408.. zero, so only the flag is wrong
    path = tmp_path / "t"
    path.write_bytes(bytes(data))
    rc, err = run_stats(capsys, path)
    assert rc == EXIT_USAGE and "bit 3 (PREFETCH_TOTALS) is set in a version-1 trace" in err, err
