"""The predictor's settings through the C API (onebit_init_from_model): the precedence over the
ONEBIT_* environment, contexts made from two threads at once with different settings, and a
runner that never touches os.environ."""

from __future__ import annotations

import os
import threading

import pytest

from onebit_predict.constants import ENV_DEPTH, ENV_MODE, ENV_OUT
from onebit_predict.llama.runner import Context, ContextSettings, Model
from onebit_predict.policy import resolve_knob
from onebit_predict.trace import Trace

pytestmark = pytest.mark.needs_build


def header(model: Model, settings: dict, path) -> object:
    with Context(model, ContextSettings(), settings | {ENV_OUT: str(path)}):
        pass
    return Trace.open(path).header


@pytest.mark.parametrize(
    ("given", "environ", "want"),
    [
        ({}, "2", 2),  # not given: the environment's
        ({ENV_DEPTH: "3"}, "2", 3),  # given: it wins
        ({ENV_DEPTH: None}, "2", 0),  # given as None (""): the default, whatever the environment says
        ({}, None, 0),  # neither: the default
    ],
)
def test_the_c_api_wins_over_the_environment(given, environ, want, tiny_model, tmp_path, monkeypatch):
    if environ is None:
        monkeypatch.delenv(ENV_DEPTH, raising=False)
    else:
        monkeypatch.setenv(ENV_DEPTH, environ)
    with Model(tiny_model("qwen3moe")) as model:
        h = header(model, {ENV_MODE: "router"} | given, tmp_path / "t.bin")
    assert h.depth_requested == want
    # the policy's twin of the rule: the C value is NULL when not given, "" when given as None
    c_value = (given[ENV_DEPTH] or "") if ENV_DEPTH in given else None
    assert int(resolve_knob(c_value, environ) or 0) == want


def test_two_threads_create_contexts_with_their_own_settings(tiny_model, tmp_path):
    before = dict(os.environ)
    modes = ["router", "block"] * 4
    got: dict[int, str] = {}

    with Model(tiny_model("qwen3next")) as model:

        def make(i: int) -> None:
            got[i] = header(model, {ENV_MODE: modes[i]}, tmp_path / f"t{i}.bin").mode_name

        threads = [threading.Thread(target=make, args=(i,)) for i in range(len(modes))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [got[i] for i in range(len(modes))] == modes
    assert dict(os.environ) == before  # the runner set no variable
