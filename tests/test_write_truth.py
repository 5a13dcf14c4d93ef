"""Every writer writes a whole file or none, and fails on a short write (onebit_predict/atomic.py).

A full disk is made real with a tiny tmpfs (``mount -t tmpfs -o size=64k``; the tests that need
one skip, saying why, where mounting is refused), or, for onebit-tiny without the build, with a
stand-in for the build's ``onebit-tiny-gguf`` that writes a cut file and exits 0, as the real
tool does on a full disk. Before: ``onebit-tiny`` exited 0 with 65,536 of 2,696,864 bytes; the
trace writer, the grower, the learned sidecar writer and the plots raised but left half a file
under the name asked for.
"""

from __future__ import annotations

import dataclasses
import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from onebit_predict.atomic import PARTIAL, atomic_path, atomic_write_bytes, atomic_write_text
from onebit_predict.commands import stats
from onebit_predict.commands import tiny as tiny_command
from onebit_predict.constants import EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE
from onebit_predict.grow.grow import grow
from onebit_predict.grow.vocab import add_byte_vocab
from onebit_predict.learned import LearnedLayer, LearnedPredictor, read_learned, write_learned
from onebit_predict.llama import tiny
from onebit_predict.trace import Trace, TraceHeader
from onebit_predict.trace_writer import TraceWriter

MODELS = Path(__file__).resolve().parent.parent / "models"
QWEN3MOE = MODELS / "qwen3moe-tiny.gguf"


@pytest.fixture
def small_fs(tmp_path) -> Iterator[Callable[[str], Path]]:
    """``small_fs(size)``: a directory on a tmpfs of that size (``64k``), unmounted at the end."""
    mounted: list[Path] = []

    def mount(size: str = "64k") -> Path:
        d = tmp_path / f"small{len(mounted)}"
        d.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], capture_output=True)
        if proc.returncode != 0:
            why = proc.stderr.decode(errors="replace").strip() or f"mount exited {proc.returncode}"
            pytest.skip(f"cannot mount a {size} tmpfs to fill ({why}): the short-write test needs one (root)")
        mounted.append(d)
        return d

    yield mount
    for d in mounted:
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)


def names(d: Path) -> list[str]:
    """What a directory holds, temporary files included."""
    return sorted(os.listdir(d))


# --- the helper ---------------------------------------------------------------------------


def test_atomic_write_on_a_full_disk_leaves_the_old_file(small_fs):
    d = small_fs("64k")
    atomic_write_text(d / "a.json", "old\n")
    with pytest.raises(OSError) as e:
        atomic_write_bytes(d / "a.json", b"x" * 200_000)
    assert e.value.errno is not None
    assert names(d) == ["a.json"] and (d / "a.json").read_text() == "old\n"


def test_atomic_path_removes_the_temporary_file_on_an_error(tmp_path):
    with pytest.raises(RuntimeError), atomic_path(tmp_path / "f.png") as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".png" and PARTIAL in tmp.name and tmp.is_file()
        tmp.write_bytes(b"half")
        raise RuntimeError("the writer failed")
    assert names(tmp_path) == []


def test_atomic_path_keeps_the_umask_mode(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "r.json", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "r.json").stat().st_mode) == 0o644


# --- onebit-tiny: the C tool does not check its writes ----------------------------------------


def _fake_tool(tmp_path: Path, monkeypatch, script: str) -> None:
    """Put a stand-in for the build's onebit-tiny-gguf (``$2`` is the file it writes) in place."""
    bin_dir = tmp_path / "build" / "bin"
    bin_dir.mkdir(parents=True)
    tool = bin_dir / tiny.TINY_TOOL
    tool.write_text(f"#!/bin/sh\n{script}\n")
    tool.chmod(0o755)
    monkeypatch.setattr(tiny, "build_info", lambda: SimpleNamespace(build_dir=tmp_path / "build"))


def test_tiny_a_cut_model_is_exit_1_and_no_file(tmp_path, monkeypatch, capsys):
    _fake_tool(tmp_path, monkeypatch, f'head -c 65536 "{QWEN3MOE}" > "$2"')  # a full disk, exit 0
    out = tmp_path / "out" / "t.gguf"
    rc = tiny_command.main(["--arch", "qwen3moe", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == EXIT_CHECK_FAILED, err
    assert f"{out}: written short: its 65536 bytes do not read back as a GGUF" in err
    assert names(out.parent) == []


def test_tiny_a_header_cut_short_is_exit_1(tmp_path, monkeypatch, capsys):
    _fake_tool(tmp_path, monkeypatch, f'head -c 100 "{QWEN3MOE}" > "$2"')
    out = tmp_path / "t.gguf"
    rc = tiny_command.main(["--arch", "qwen3moe", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == EXIT_CHECK_FAILED and "written short: its 100 bytes" in err
    assert not out.exists() and not list(tmp_path.glob(f"*{PARTIAL}*"))


def test_tiny_a_whole_model_is_renamed_into_place(tmp_path, monkeypatch, capsys):
    _fake_tool(tmp_path, monkeypatch, f'cat "{QWEN3MOE}" > "$2"')
    out = tmp_path / "t.gguf"
    out.write_bytes(b"the previous file")
    assert tiny_command.main(["--arch", "qwen3moe", "--out", str(out)]) == EXIT_OK
    assert out.read_bytes() == QWEN3MOE.read_bytes()
    assert names(tmp_path) == ["build", "t.gguf"]


@pytest.mark.needs_build
def test_tiny_on_a_full_disk_is_exit_1(small_fs, capsys):
    d = small_fs("64k")
    rc = tiny_command.main(["--arch", "olmoe", "--out", str(d / "t.gguf")])
    err = capsys.readouterr().err
    assert rc == EXIT_CHECK_FAILED, err
    assert "written short" in err or "cannot write it" in err
    assert names(d) == []


# --- the Python writers on a full disk: an error, and nothing under the final name -------------


def test_trace_writer_on_a_full_disk(small_fs):
    d = small_fs("64k")
    header = TraceHeader.build(n_layer=8, n_expert=16, n_expert_used=4)
    records = np.zeros(2000, dtype=header.dtype)  # 168 KB
    with pytest.raises(OSError), TraceWriter(d / "t.trace", header) as w:
        w.write(records)
    assert names(d) == []


def test_trace_writer_left_by_an_error_leaves_nothing(tmp_path):
    header = TraceHeader.build(n_layer=2, n_expert=4, n_expert_used=2)
    with pytest.raises(RuntimeError), TraceWriter(tmp_path / "t.trace", header) as w:
        w.add(step=0, seq_id=0, pos=0, layer=1, actual=[0, 1])
        raise RuntimeError("the run failed")
    assert names(tmp_path) == []
    with TraceWriter(tmp_path / "t.trace", header) as w:
        w.add(step=0, seq_id=0, pos=0, layer=1, actual=[0, 1])
    assert names(tmp_path) == ["t.trace"] and len(Trace.open(tmp_path / "t.trace").records) == 1


def test_grow_on_a_full_disk(small_fs):
    d = small_fs("64k")
    with pytest.raises(OSError):
        grow(QWEN3MOE, d / "g.gguf", 512, "f32")
    assert names(d) == []


def test_vocab_on_a_full_disk(small_fs):
    d = small_fs("64k")
    with pytest.raises(OSError):
        add_byte_vocab(QWEN3MOE, d / "v.gguf")
    assert names(d) == []


def _predictor(n_embd: int = 64, n_expert: int = 64, n_layer: int = 8) -> LearnedPredictor:
    rng = np.random.default_rng(0)
    layers = {
        layer: LearnedLayer(
            rng.standard_normal((n_expert, n_embd), dtype=np.float32), np.zeros(n_expert, dtype=np.float32)
        )
        for layer in range(1, n_layer)
    }
    keys: dict[str, object] = dict(ahead=1, n_embd=n_embd, n_expert=n_expert, model_name="test")
    keys.update(trained_on="chunks", tokens=100, layers=layers)
    have = {f.name for f in dataclasses.fields(LearnedPredictor)}
    keys.update({k: v for k, v in (("model_arch", "qwen3moe"), ("router_hash", 1)) if k in have})
    return LearnedPredictor(**keys)


def test_learned_sidecar_on_a_full_disk(small_fs, tmp_path):
    d = small_fs("64k")
    pred = _predictor()  # 7 layers x 16 KiB
    with pytest.raises(OSError):
        write_learned(d / "l.gguf", pred)
    assert names(d) == []
    ok = tmp_path / "ok"
    ok.mkdir()
    write_learned(ok / "l.gguf", pred)
    assert read_learned(ok / "l.gguf").n_embd == 64 and names(ok) == ["l.gguf"]


@pytest.mark.parametrize("suffix", ["png", "svg", "pdf"])
def test_simulate_plot_on_a_full_disk_is_exit_2_and_no_file(suffix, small_fs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    d = small_fs("8k")
    trace = tmp_path / "t.trace"
    with TraceWriter(trace, TraceHeader.build(n_layer=4, n_expert=8, n_expert_used=2)) as w:
        for step in range(4):
            for layer in range(1, 4):  # layer 0 is predicted by no layer
                w.add(step=step, seq_id=0, pos=step, layer=layer, actual=[step % 8, 7], pred=[step % 8, 6])
    argv = ["simulate", str(trace), "--expert-bytes", "1MB", "--bandwidth", "3GB/s", "--layer-ms", "1"]
    rc = stats.main([*argv, "--plot", str(d / f"p.{suffix}")])
    err = capsys.readouterr().err
    assert rc == EXIT_USAGE and "No space left" in err, err
    assert names(d) == []
    assert stats.main([*argv, "--plot", str(tmp_path / f"p.{suffix}")]) == EXIT_OK
    magic = {"png": b"\x89PNG", "svg": b"<?xml", "pdf": b"%PDF"}[suffix]
    assert (tmp_path / f"p.{suffix}").read_bytes().startswith(magic)
