"""The native table (ONEBIT_MOE_PREDICT_STATS, printed by libllama) and onebit-stats count the
same rows: every bitident scenario, router and block, per layer and in total."""

from __future__ import annotations

import re

import pytest

from onebit_predict.checks.bitident import FEEDS, SCENARIOS, RunOutput, run_env
from onebit_predict.constants import ENV_STATS
from onebit_predict.llama.runner import Context, Model, builtin_tokens
from onebit_predict.metrics.stats import compute_stats
from onebit_predict.trace import Trace

# onebit: layer tokens actual read gated hits read_recall precision
ROW = re.compile(r"^onebit:\s+(\d+|total)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+\S+\s+\S+$")
UNSCORED = re.compile(r"^onebit:\s+\d+(\s+-)+$")  # a layer with nothing scored


def native_table(err: str) -> dict[str, tuple[int, ...]]:
    """The last native hit-rate table in ``err``: layer (or "total") -> (tokens, actual, read, gated, hits)."""
    start = err.rindex("onebit: moe-predict stats")
    rows = {}
    for line in err[start:].splitlines()[2:]:
        m = ROW.match(line)
        if m:
            rows[m.group(1)] = tuple(int(v) for v in m.groups()[1:])
        elif not UNSCORED.match(line):
            break
    return rows


@pytest.mark.parametrize("mode", ["router", "block"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_native_table_and_onebit_stats_agree(scenario, mode, tiny_model, tmp_path, capsys):
    path = tmp_path / "t.bin"
    env = run_env(mode, path, leak=False) | {ENV_STATS: "1"}
    with Model(tiny_model("qwen3next")) as model:
        toks = builtin_tokens(200, model.n_vocab, 0)
        capsys.readouterr()
        with Context(model, scenario.settings, env) as ctx:
            FEEDS[scenario.feed](ctx, RunOutput(), toks)
    native = native_table(capsys.readouterr().err)
    st = compute_stats(Trace.open(path))
    ours = {
        str(layer): (c.tokens, c.actual, c.read, c.gated, c.hits_read) for layer, c in st.layers.items() if c.tokens
    }
    t = st.total
    ours["total"] = (t.tokens, t.actual, t.read, t.gated, t.hits_read)
    assert native["total"][0] > 0  # something was scored
    assert {k: v for k, v in native.items() if k == "total" or v[0] > 0} == ours
