"""No command reports success for a trace that is not whole (issue 21, items 1, 5 and 9).

- header flag bits 6 ``OPEN`` and 7 ``INCOMPLETE`` (docs/trace-format.md): read, not refused;
- ``onebit-stats`` (rates, replay, simulate) warns once per such trace and exits 0;
- ``onebit-trace`` exits 1 with the reason for a trace that is missing, INCOMPLETE, still OPEN
  or cut short, leaves nothing under ``--out`` (it writes under a temporary name), refuses a
  dense model (exit 2) and refuses the knobs llama.cpp's ``--moe-predict-*`` flags refuse (exit 2,
  the policy's words);
- ``onebit-bitident`` fails a mode whose trace could not be written ("writing the trace
  failed"), not with what the missing bytes would seem to say.

The runs are simulated by writing the trace by hand where a test does not need the build; the
tests marked needs_build write to a tiny tmpfs that fills up.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from onebit_predict.checks import bitident as bitident_check
from onebit_predict.commands import bitident as bitident_cmd
from onebit_predict.commands import stats as stats_cmd
from onebit_predict.commands import trace as trace_cmd
from onebit_predict.constants import (
    EXIT_CHECK_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_USAGE,
    TRACE_HDR_FLAG_INCOMPLETE,
    TRACE_HDR_FLAG_OPEN,
    TRACE_HDR_FLAGS_KNOWN,
)
from onebit_predict.costmodel.expert_bytes import ModelError
from onebit_predict.llama import record as record_mod
from onebit_predict.trace import Trace, TraceHeader
from onebit_predict.trace_writer import TraceWriter
from onebit_predict.trace_written import written_problem

OPEN_WORDS = "not closed cleanly (the writer died or is still running): 6 records read, totals unknown"
INCOMPLETE_WORDS = "incomplete: record write(s) failed (full disk?); the table covers only the 6 records written"
BAD_FLAGS = [(TRACE_HDR_FLAG_OPEN, OPEN_WORDS), (TRACE_HDR_FLAG_INCOMPLETE, INCOMPLETE_WORDS)]


def header(flags: int = 0) -> TraceHeader:
    return TraceHeader.build(
        n_layer=3, n_expert=4, n_expert_used=1, depth=2, layers={1}, flags=flags, arch="qwen3moe", model="tiny"
    )


def write(path: Path, flags: int = 0, steps: int = 2) -> Path:
    """A trace of ``steps`` decode steps over 3 layers (layer 1 predicted one ahead): 3 records a step."""
    with TraceWriter(path, header(flags)) as w:
        for pos in range(steps):
            for layer in range(3):
                w.add(step=pos, seq_id=0, pos=pos, layer=layer, actual=[pos % 4], pred=[0, 1] if layer == 1 else None)
    return path


# --- the header bits ---------------------------------------------------------------------


def test_the_two_bits_are_known_and_distinct():
    assert (TRACE_HDR_FLAG_OPEN, TRACE_HDR_FLAG_INCOMPLETE) == (0x40, 0x80)
    assert TRACE_HDR_FLAGS_KNOWN & 0xC0 == 0xC0


@pytest.mark.parametrize(
    ("flags", "is_open", "incomplete"),
    [(0, False, False), (TRACE_HDR_FLAG_OPEN, True, False), (TRACE_HDR_FLAG_INCOMPLETE, False, True)],
)
def test_header_bits_round_trip(flags, is_open, incomplete):
    h = TraceHeader.from_bytes(header(flags).to_bytes())  # validated: the bits are not refused
    assert (h.open, h.incomplete) == (is_open, incomplete)
    assert h.ahead == 1 and h.flags & 0xC0 == flags


def test_header_bits_from_the_documented_offset(tmp_path):
    """Bit 6 and bit 7 of the u32 at offset 52, set in bytes written by another writer than ours."""
    raw = bytearray(header().to_bytes())
    raw[52] |= 0x40 | 0x80
    h = TraceHeader.from_bytes(bytes(raw))
    assert h.open and h.incomplete


@pytest.mark.parametrize(("flags", "words"), BAD_FLAGS)
def test_reader_reads_and_warns_once(tmp_path, caplog, flags, words):
    path = write(tmp_path / "t.bin", flags)
    with caplog.at_level(logging.WARNING, logger="onebit_predict.trace"):
        t = Trace.open(path)
    assert t.n_records == 6
    assert caplog.text.count(words) == 1, caplog.text


def test_clean_trace_does_not_warn(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="onebit_predict.trace"):
        Trace.open(write(tmp_path / "t.bin"))
    assert caplog.text == ""


# --- onebit-stats: warn once per trace, exit 0 ---------------------------------------------


@pytest.fixture
def stats(run_cli):
    return lambda *args: run_cli(stats_cmd.main, *args)


@pytest.mark.parametrize(("flags", "words"), BAD_FLAGS)
def test_stats_rates_warns_once_and_exits_0(tmp_path, stats, flags, words):
    path = write(tmp_path / "t.bin", flags)
    rc, out, err = stats(path, "--engine", "numpy")
    assert rc == EXIT_OK, err
    assert err.count(words) == 1 and f"{path}: {words}" in err, err
    assert "total" in out
    assert ("NOT CLOSED CLEANLY" in out) == bool(flags & TRACE_HDR_FLAG_OPEN)
    assert ("INCOMPLETE" in out) == bool(flags & TRACE_HDR_FLAG_INCOMPLETE)


def test_stats_json_carries_the_bits(tmp_path, stats):
    clean, dead = write(tmp_path / "clean.bin"), write(tmp_path / "dead.bin", TRACE_HDR_FLAG_OPEN)
    rc, out, err = stats(clean, dead, "--engine", "numpy", "--json")
    assert rc == EXIT_OK, err
    headers = [t["header"] for t in json.loads(out)["traces"]]
    assert [(h["open"], h["incomplete"]) for h in headers] == [(False, False), (True, False)]
    assert err.count("not closed cleanly") == 1  # the dead trace only, once


def test_stats_clean_trace_says_nothing(tmp_path, stats):
    rc, _, err = stats(write(tmp_path / "t.bin"), "--engine", "numpy")
    assert rc == EXIT_OK and "closed cleanly" not in err and "incomplete" not in err


@pytest.mark.parametrize(
    "sub",
    [
        ["replay", "--slots", "2"],
        ["simulate", "--expert-bytes", "1MB", "--bandwidth", "3GB/s", "--layer-ms", "1"],
    ],
)
@pytest.mark.parametrize(("flags", "words"), BAD_FLAGS)
def test_replay_and_simulate_warn_once(tmp_path, stats, sub, flags, words):
    path = write(tmp_path / "t.bin", flags)
    rc, _, err = stats(sub[0], path, *sub[1:])
    assert rc == EXIT_OK, err
    assert err.count(words) == 1, err


# --- written_problem: the verdict on a trace just written --------------------------------


def test_written_problem(tmp_path):
    assert written_problem(write(tmp_path / "ok.bin")) is None
    assert written_problem(tmp_path / "absent.bin").startswith("no trace written: ")
    (tmp_path / "empty.bin").write_bytes(b"")
    assert "writing the trace failed" in written_problem(tmp_path / "empty.bin")
    assert "is 0 bytes, shorter than its 512-byte header" in written_problem(tmp_path / "empty.bin")
    assert "INCOMPLETE" in written_problem(write(tmp_path / "inc.bin", TRACE_HDR_FLAG_INCOMPLETE))
    assert "OPEN" in written_problem(write(tmp_path / "open.bin", TRACE_HDR_FLAG_OPEN))
    cut = write(tmp_path / "cut.bin")
    cut.write_bytes(cut.read_bytes()[:-3])
    assert "partial record" in written_problem(cut)
    (tmp_path / "junk.bin").write_bytes(b"x" * 600)
    assert "bad magic" in written_problem(tmp_path / "junk.bin")
    assert "as named" in written_problem(tmp_path / "absent.bin", "as named")


# --- onebit-trace: never success for a trace that is not whole -----------------------------


@pytest.fixture
def model_file(tmp_path, monkeypatch) -> Path:
    """A file standing for a MoE model (require_moe_model passes it), in a directory of its own."""
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "model.gguf"
    path.write_bytes(b"GGUF")
    monkeypatch.setattr(trace_cmd, "require_moe_model", lambda p: None)
    return path


def fake_run(monkeypatch, flags: int | None, cut: int = 0, raises: BaseException | None = None) -> list[Path]:
    """Replace the llama.cpp run: write a trace with ``flags`` where libllama was told to (None:
    write nothing; ``cut``: bytes cut off its end; ``raises``: fail after writing). Returns the
    paths libllama was given."""
    given: list[Path] = []

    def run(opts, trace: Path, progress) -> int:
        given.append(trace)
        if flags is not None:
            write(trace, flags)
            if cut:
                trace.write_bytes(trace.read_bytes()[:-cut])
        if raises is not None:
            raise raises
        return 6

    monkeypatch.setattr(record_mod, "_record", run)
    return given


def trace_args(model: Path, out: Path, *extra: str) -> list[str]:
    return [str(model), "--mode", "router", "--out", str(out), "--tokens", "4", *extra]


def test_trace_success_renames_onto_out(tmp_path, model_file, monkeypatch, run_cli):
    given = fake_run(monkeypatch, 0)
    out = tmp_path / "d" / "t.bin"
    rc, _, err = run_cli(trace_cmd.main, *trace_args(model_file, out))
    assert rc == EXIT_OK, err
    assert Trace.open(out).n_records == 6
    # written under another name in the same directory, gone now
    assert given[0] != out and given[0].parent == out.parent and not given[0].exists()
    assert os.listdir(out.parent) == ["t.bin"]


@pytest.mark.parametrize(
    ("flags", "cut", "words"),
    [
        (None, 0, "no trace written: "),
        (TRACE_HDR_FLAG_INCOMPLETE, 0, "INCOMPLETE"),
        (TRACE_HDR_FLAG_OPEN, 0, "OPEN"),
        (0, 3, "partial record"),
        (0, 6 * 44 + 200, "shorter than its 512-byte header"),
    ],
)
def test_trace_not_whole_exits_1_and_leaves_nothing(tmp_path, model_file, monkeypatch, run_cli, flags, cut, words):
    fake_run(monkeypatch, flags, cut)
    out = tmp_path / "d" / "t.bin"
    rc, _, err = run_cli(trace_cmd.main, *trace_args(model_file, out))
    assert rc == EXIT_CHECK_FAILED, err
    assert words in err and str(out) in err, err
    assert os.listdir(out.parent) == []  # neither --out nor the temporary file


def test_trace_failure_keeps_the_old_file(tmp_path, model_file, monkeypatch, run_cli):
    out = tmp_path / "t.bin"
    out.write_bytes(b"the previous trace")
    fake_run(monkeypatch, TRACE_HDR_FLAG_INCOMPLETE)
    rc, _, _ = run_cli(trace_cmd.main, *trace_args(model_file, out))
    assert rc == EXIT_CHECK_FAILED
    assert out.read_bytes() == b"the previous trace"
    assert sorted(os.listdir(tmp_path)) == ["m", "t.bin"]


def test_trace_interrupted_leaves_no_temp_file(tmp_path, model_file, monkeypatch):
    fake_run(monkeypatch, TRACE_HDR_FLAG_OPEN, raises=KeyboardInterrupt())
    out = tmp_path / "d" / "t.bin"
    assert trace_cmd.main(trace_args(model_file, out)) == EXIT_INTERRUPTED  # Ctrl-C: one line, exit 130
    assert os.listdir(out.parent) == []


def test_trace_stats_reads_the_renamed_trace(tmp_path, model_file, monkeypatch, run_cli):
    fake_run(monkeypatch, 0)
    out = tmp_path / "t.bin"
    rc, stdout, err = run_cli(trace_cmd.main, *trace_args(model_file, out, "--stats"))
    assert rc == EXIT_OK, err
    assert f"{out}: 6 records" in stdout


def test_trace_refuses_a_dense_model_before_running(tmp_path, monkeypatch, run_cli):
    given = fake_run(monkeypatch, 0)
    model = tmp_path / "dense.gguf"
    model.write_bytes(b"GGUF")

    def dense(path):
        raise ModelError(f"{path} has no routed experts (architecture llama, no ffn_gate_inp)")

    monkeypatch.setattr(trace_cmd, "require_moe_model", dense)
    rc, _, err = run_cli(trace_cmd.main, *trace_args(model, tmp_path / "t.bin"))
    assert rc == EXIT_USAGE and "has no routed experts" in err
    assert given == [] and not (tmp_path / "t.bin").exists()


def test_trace_refuses_a_real_dense_gguf(tmp_path, run_cli):
    """require_moe_model itself, on a GGUF with no router tensor (gguf-py writes it)."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    model = tmp_path / "dense.gguf"
    w = gguf.GGUFWriter(str(model), "llama")
    w.add_block_count(1)
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    rc, _, err = run_cli(trace_cmd.main, *trace_args(model, tmp_path / "t.bin"))
    assert rc == EXIT_USAGE and "no routed experts" in err, err


def test_trace_out_a_directory_is_a_usage_error(tmp_path, model_file, monkeypatch, run_cli):
    given = fake_run(monkeypatch, 0)
    rc, _, err = run_cli(trace_cmd.main, *trace_args(model_file, tmp_path))
    assert rc == EXIT_USAGE and "is a directory" in err and given == []


# --- onebit-trace: the knobs' grammar is llama.cpp's (item 9) ----------------------------


@pytest.mark.parametrize(
    ("option", "value", "words"),
    [
        ("--ahead", "4", "(ONEBIT_MOE_PREDICT_AHEAD=4 exceeds 3)"),
        ("--ahead", "0", "(ONEBIT_MOE_PREDICT_AHEAD=0 must be at least 1)"),
        ("--depth", "abc", "(ONEBIT_MOE_PREDICT_DEPTH='abc' is not a non-negative integer)"),
        ("--depth", "0", "(ONEBIT_MOE_PREDICT_DEPTH=0 must be at least 1)"),
        ("--margin", "nan", "(ONEBIT_MOE_PREDICT_MARGIN='nan' is not a finite non-negative number)"),
        ("--margin", "-1", "(ONEBIT_MOE_PREDICT_MARGIN='-1' is not a finite non-negative number)"),
        ("--min", "x", "(ONEBIT_MOE_PREDICT_MIN='x' is not a non-negative integer)"),
        ("--layers", "0-3", "(ONEBIT_MOE_PREDICT_LAYERS item '0-3' includes layer 0, which has no layer before it)"),
        ("--layers", "3-1", "(ONEBIT_MOE_PREDICT_LAYERS item '3-1' is a reversed range)"),
        ("--layers", "1,,2", "(ONEBIT_MOE_PREDICT_LAYERS has an empty item)"),
        ("--depth", "", ""),
    ],
)
def test_trace_refuses_what_the_policy_would_replace(tmp_path, model_file, monkeypatch, run_cli, option, value, words):
    given = fake_run(monkeypatch, 0)
    rc, _, err = run_cli(trace_cmd.main, *trace_args(model_file, tmp_path / "t.bin", option, value))
    assert rc == EXIT_USAGE, err
    assert f"invalid value for {option}: '{value}' {words}".rstrip() in err, err
    assert given == []  # refused before anything ran


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("--ahead", "3"),
        ("--depth", "4"),
        ("--margin", "0.5"),
        ("--margin", " 2e-1 "),
        ("--min", "0"),
        ("--layers", "1,5-9"),
    ],
)
def test_trace_takes_what_the_policy_takes(tmp_path, model_file, monkeypatch, run_cli, option, value):
    fake_run(monkeypatch, 0)
    rc, _, err = run_cli(trace_cmd.main, *trace_args(model_file, tmp_path / "t.bin", option, value))
    assert rc == EXIT_OK, err


def test_knob_words_match_llama_cpp_flags():
    """What tests/test_llama_tools.py asserts of llama-completion's --moe-predict-depth x and
    --moe-predict-margin -1, in onebit-trace's words."""
    assert trace_cmd.knob_problem("depth", "x") == (
        "invalid value for --depth: 'x' (ONEBIT_MOE_PREDICT_DEPTH='x' is not a non-negative integer)"
    )
    assert "is not a finite non-negative number" in trace_cmd.knob_problem("margin", "-1")
    # each knob alone, as llama.cpp checks a flag: a large depth is the model's business (clamped there)
    assert trace_cmd.knob_problem("depth", "999") is None


# --- onebit-bitident: a trace that could not be written ----------------------------------


@contextmanager
def _no_model(*_args, **_kw) -> Iterator[object]:
    class Fake:
        path = Path("fake.gguf")
        n_vocab = 256

    yield Fake()


def _fake_bitident_runs(monkeypatch, flags: int | None) -> None:
    """Every run logits-identical; a predictor run's trace is written as a full disk leaves it
    (None: 0 bytes, the header's own write failed) or with ``flags``."""

    def run_once(model, scenario, mode, trace, leak, seed, learned=None):
        out = bitident_check.RunOutput(rows=[b"\0" * 8], n_routed=1)
        if trace is not None:
            if flags is None:
                trace.write_bytes(b"")
            else:
                write(trace, flags)
        return out

    monkeypatch.setattr(bitident_check, "run_once", run_once)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (None, "is 0 bytes, shorter than its 512-byte header (a full disk?"),
        (TRACE_HDR_FLAG_INCOMPLETE, "INCOMPLETE"),
        (TRACE_HDR_FLAG_OPEN, "OPEN"),
    ],
)
def test_bitident_blames_the_write(tmp_path, monkeypatch, run_cli, flags, words):
    _fake_bitident_runs(monkeypatch, flags)
    monkeypatch.setattr(bitident_cmd, "Model", _no_model)
    monkeypatch.setattr(bitident_cmd, "require_moe_model", lambda p: None, raising=False)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    args = [model, "--modes", "router", "--scenarios", "prefill+decode", "--keep-traces", tmp_path / "keep"]
    rc, out, err = run_cli(bitident_cmd.main, *args)
    assert rc == EXIT_CHECK_FAILED, err
    assert "FAILED: writing the trace failed: " in out and words in out, out
    assert "NOT IDENTICAL" in out


def test_bitident_missing_trace(tmp_path):
    predicted, problem, ran = bitident_check.run_problem(tmp_path / "absent.bin", 1, "router", False)
    assert (predicted, ran) == (0, "router") and problem.startswith("no trace written: ")


# --- a real full disk (the build, root, a 4 KiB tmpfs) -------------------------------------


@pytest.fixture
def full_disk(tmp_path) -> Iterator[Path]:
    """A 4 KiB tmpfs: the header fits, the records do not."""
    where = tmp_path / "tiny-fs"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


@pytest.mark.needs_build
def test_trace_on_a_full_disk_exits_1(tiny_model, full_disk, run_cli):
    out = full_disk / "t.bin"
    args = [tiny_model("qwen3moe"), "--mode", "router", "--out", out, "--tokens", "48", "--generate", "16"]
    rc, _, err = run_cli(trace_cmd.main, *args)
    assert rc == EXIT_CHECK_FAILED, err
    assert "writing the trace failed" in err, err
    assert os.listdir(full_disk) == []


@pytest.mark.needs_build
def test_bitident_on_a_full_disk_blames_the_write(tiny_model, full_disk, run_cli):
    model = tiny_model("qwen3moe")
    args = [model, "--modes", "router,block", "--scenarios", "prefill+decode", "--keep-traces", full_disk]
    rc, out, err = run_cli(bitident_cmd.main, *args)
    assert rc == EXIT_CHECK_FAILED, out + err
    lines = [line for line in out.splitlines() if "prefill+decode" in line]
    assert len(lines) == 2 and all("FAILED: writing the trace failed" in line for line in lines), out
