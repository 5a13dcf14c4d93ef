"""onebit-bench's "unpatched pin" row: the zero-cost-off comparison against plain llama.cpp.

The row runs in a worker loaded with the unpatched pin's libllama (``./build.sh pristine``,
built here once if it is not cached: about 75 s of compile on 2 cores). That library has no
onebit_* symbol, so the worker must take no onebit call at all: it makes its context with
llama.cpp's own ``llama_init_from_model``. The test checks the row is there and measured, that
its worker mapped the unpatched library and resolved no onebit_* symbol, and that the patched
rows' workers did resolve ``onebit_init_from_model`` (the report is not blind). Timings are
never judged.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from onebit_predict.checks import rounds
from onebit_predict.commands.bench import main as bench_main
from onebit_predict.constants import ENV_MODE, EXIT_OK
from onebit_predict.llama.runner import RunError, refuse_knobs

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "qwen3moe-tiny.gguf"


@pytest.mark.needs_build
def test_bench_runs_the_unpatched_row_without_a_onebit_call(pristine_dir, run_cli, monkeypatch):
    # the unpatched library cannot hold a onebit symbol to resolve (its dynamic string table would name it)
    assert b"onebit_" not in (pristine_dir / "libllama.so").read_bytes()
    seen: list[tuple[list[str], Path, dict]] = []
    real = rounds.worker_json

    def record(cmd_args, lib_dir, what):
        out = real(cmd_args, lib_dir, what)
        seen.append((list(cmd_args), Path(lib_dir), out))
        return out

    monkeypatch.setattr(rounds, "worker_json", record)
    rc, out, err = run_cli(bench_main, MODEL, "--rounds", 1, "--json")
    assert rc == EXIT_OK, err
    rows = {r["name"]: r for r in json.loads(out)["rows"]}
    unpatched = [r for name, r in rows.items() if name.startswith("unpatched")]
    assert len(unpatched) == 1, list(rows)
    assert unpatched[0]["median_tok_s"] > 0 and unpatched[0]["ratio_to_off"] > 0
    assert rows["patched off"]["ratio_to_off"] == 1.0

    pristine_runs = [o for args, lib, o in seen if "--pristine" in args]
    assert len(pristine_runs) == 1 and all(lib == pristine_dir for args, lib, _ in seen if "--pristine" in args)
    run = pristine_runs[0]
    assert run["patched"] is False
    assert run["onebit_symbols"] == []
    assert Path(run["libllama"]).resolve().parent == pristine_dir.resolve()
    for args, _lib, o in seen:
        if "--pristine" not in args:  # the control: the patched workers do report what they resolved
            assert o["patched"] is True and "onebit_init_from_model" in o["onebit_symbols"]
            assert Path(o["libllama"]).resolve().parent != pristine_dir.resolve()


def test_an_unpatched_row_takes_no_knob():
    with pytest.raises(ValueError, match="takes no predictor knob"):
        rounds.Config("unpatched pin", {ENV_MODE: "router"}, pristine=True)
    rounds.Config("unpatched pin", {}, pristine=True)
    with pytest.raises(RunError, match="the unpatched libllama has no predictor"):
        refuse_knobs({ENV_MODE: "block"})
    refuse_knobs({ENV_MODE: "off", "ONEBIT_MOE_PREDICT_DEPTH": None})
