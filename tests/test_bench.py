"""onebit-bench runs every configuration side by side and reports ratios to patched off.

Only the shape of the result is asserted: timings are measured by the benchmark, never
judged by a test.
"""

from __future__ import annotations

import json

from onebit_predict.commands.bench import main as bench_main
from onebit_predict.constants import EXIT_OK, EXIT_USAGE


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
