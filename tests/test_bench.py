"""onebit-bench runs every configuration side by side and reports ratios to patched off.

Only the shape of the result is asserted: timings are measured by the benchmark, never
judged by a test.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from onebit_predict.commands.bench import main as bench_main
from onebit_predict.constants import EXIT_OK, EXIT_USAGE

REPO = Path(__file__).resolve().parent.parent


def test_bench_reports_every_configuration(tiny_model, capsys):
    rc = bench_main([str(tiny_model("qwen3moe")), "--rounds", "1", "--prompt", "8", "--generate", "4", "--json"])
    assert rc == EXIT_OK
    report = json.loads(capsys.readouterr().out)
    names = [r["name"] for r in report["rows"]]
    assert names[-6:] == ["patched off", "router", "router + trace", "block", "block no-attn", "block layers 1-2"]
    rows = {r["name"]: r for r in report["rows"]}
    assert rows["patched off"]["ratio_to_off"] == 1.0
    for r in report["rows"]:
        assert r["median_tok_s"] > 0 and r["min_tok_s"] <= r["median_tok_s"] <= r["max_tok_s"]
        assert r["compute_mib"] > 0  # parsed from llama.cpp's reservation log
    # the speculative block is planned and reserved: its graph needs more compute memory
    assert rows["block"]["compute_mib"] >= rows["patched off"]["compute_mib"]


def test_bench_usage(tmp_path, capsys):
    assert bench_main([str(tmp_path / "none.gguf")]) == EXIT_USAGE
    (tmp_path / "m.gguf").write_bytes(b"x")
    assert bench_main([str(tmp_path / "m.gguf"), "--rounds", "0"]) == EXIT_USAGE
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "short.txt").write_bytes(b"abc")
    assert bench_main([str(tmp_path / "m.gguf"), "--text-file", str(tmp_path / "short.txt")]) == EXIT_USAGE
    assert "must exist and hold at least" in capsys.readouterr().err


def test_bench_checks_its_arguments_before_the_build(tmp_path, monkeypatch, run_cli):
    # no build anywhere: a usage error must still be named as such, never "run ./build.sh"
    from onebit_predict.llama import paths

    monkeypatch.setattr(paths, "CURRENT_ENV", tmp_path / "none.env")
    for key in ("LLAMA_TREE", "LLAMA_BUILD_DIR", "LLAMA_LIB_DIR", "LLAMA_CPP_LIB_PATH"):
        monkeypatch.delenv(key, raising=False)
    model = REPO / "models" / "qwen3moe-tiny.gguf"  # a real MoE: only the flags are wrong
    for args, said in [
        (["--rounds", "0"], "--rounds"),
        (["--layers", "3-1"], "reversed range"),
        (["--memory-limit", "half"], "neither a share"),
        (["--cold", "--memory-limit", "50%"], "two settings"),
        (["--memory-limit", "resident,1%"], "at least 16 MiB"),  # a share of the model's expert bytes
        (["--worker"], "unrecognized arguments"),  # the worker's options are the worker's own
        (["--env", "{}"], "unrecognized arguments"),
    ]:
        rc, _, err = run_cli(bench_main, model, *args)
        assert rc == EXIT_USAGE and said in err and "build.sh" not in err, (args, err)
    # the arguments are fine: only now is the missing build the error
    rc, _, err = run_cli(bench_main, model, "--memory-limit", "resident")
    assert rc == EXIT_USAGE and "build.sh" in err


def test_the_worker_is_its_own_entry_point(tmp_path):
    """checks/rounds.py starts ``python -m onebit_predict.commands.bench_worker``; without a model or
    with a malformed --env it says so (exit 2), with no traceback and before loading llama.cpp."""
    from onebit_predict.checks import rounds

    assert rounds.WORKER_MODULE == "onebit_predict.commands.bench_worker"
    model = REPO / "models" / "qwen3moe-tiny.gguf"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    for args, said in [
        ([str(tmp_path / "none.gguf")], "no such file"),
        ([str(model), "--env", "[1]"], "JSON object of strings"),
        ([str(model), "--env", "{"], "--env"),
        ([str(model), "--rounds", "1"], "unrecognized arguments"),  # onebit-bench's, not the worker's
    ]:
        p = subprocess.run(
            [sys.executable, "-m", rounds.WORKER_MODULE, *args], capture_output=True, text=True, env=env, timeout=120
        )
        assert p.returncode == EXIT_USAGE and said in p.stderr and p.stdout == "", (args, p.stderr)
        assert "Traceback" not in p.stderr
