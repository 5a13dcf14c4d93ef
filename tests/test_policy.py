"""onebit_predict.policy against every case of ctest_port/cases.tsv, and its warning texts."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ctest_port.cases import DepthCase, KnobCase, LayersCase, MinCase, PolicyCase, ReadCase, read_cases
from onebit_predict.constants import MODE_ROUTER
from onebit_predict.policy import (
    Env,
    effective_depth,
    effective_min,
    n_read,
    parse_layers,
    parse_policy,
    resolve_knob,
)

CASES = read_cases()


def cases_of(kind: type) -> pytest.MarkDecorator:
    return pytest.mark.parametrize("case", [c for c in CASES if isinstance(c, kind)], ids=lambda c: f"line{c.line}")


@cases_of(DepthCase)
def test_effective_depth(case: DepthCase) -> None:
    assert effective_depth(case.req, case.n_expert, case.n_used) == case.expected


@cases_of(MinCase)
def test_effective_min(case: MinCase) -> None:
    assert effective_min(case.req, case.depth, case.n_used) == case.expected


@cases_of(ReadCase)
def test_n_read(case: ReadCase) -> None:
    assert n_read(case.logits, case.depth, case.margin, case.min_read) == case.expected


@cases_of(LayersCase)
def test_parse_layers(case: LayersCase) -> None:
    mask, warnings = parse_layers(case.spec, case.n_layer)
    assert (mask, len(warnings)) == (case.layers, case.n_warnings)


@cases_of(PolicyCase)
def test_parse_policy(case: PolicyCase) -> None:
    p, warnings = parse_policy(case.env, case.n_layer, case.n_expert, case.n_used)
    got = (p.mode, p.depth, p.margin, p.min_read, p.n_layer_predicted, p.no_attn, p.stats, len(warnings))
    assert got == case[5:]
    assert p.n_layer_predicted == len(p.predicted_layers)


def test_warning_texts() -> None:
    env = Env(mode=" Turbo ", depth="0", margin="-1", min="12", layers=" 0-2, x,9-7, ,99", no_attn="maybe", stats="2 ")
    _, warnings = parse_policy(env, 48, 128, 8)
    assert warnings == [
        "ONEBIT_MOE_PREDICT=' Turbo ' is not one of off|router|block|learned; using off",
        "ONEBIT_MOE_PREDICT_DEPTH=0 must be at least 1; ignored",
        "ONEBIT_MOE_PREDICT_MARGIN='-1' is not a finite non-negative number; ignored (no gate)",
        "ONEBIT_MOE_PREDICT_MIN=12 exceeds the depth 8; clamped to 8",
        "ONEBIT_MOE_PREDICT_LAYERS item '0-2' includes layer 0, which has no layer before it; layer 0 ignored",
        "ONEBIT_MOE_PREDICT_LAYERS item 'x' is not N or A-B; ignored",
        "ONEBIT_MOE_PREDICT_LAYERS item '9-7' is a reversed range; ignored",
        "ONEBIT_MOE_PREDICT_LAYERS has an empty item; ignored",
        "ONEBIT_MOE_PREDICT_LAYERS item '99' is out of range (the model has layers 0..47); ignored",
        "ONEBIT_MOE_PREDICT_NO_ATTN='maybe' is not one of 1|0|true|false|yes|no|on|off; using 0",
        "ONEBIT_MOE_PREDICT_STATS='2 ' is not one of 1|0|true|false|yes|no|on|off; using 0",
    ]


def test_warning_texts_clamps_and_nothing_left() -> None:
    _, warnings = parse_policy(Env(depth="+300", min=" 1e3", layers=" 0 "), 48, 256, 8)
    assert warnings == [
        "ONEBIT_MOE_PREDICT_DEPTH=300 exceeds n_expert=256; clamped to 256",
        "ONEBIT_MOE_PREDICT_MIN=' 1e3' is not a non-negative integer; ignored",
        "ONEBIT_MOE_PREDICT_LAYERS item '0' includes layer 0, which has no layer before it; layer 0 ignored",
        "ONEBIT_MOE_PREDICT_LAYERS=' 0 ' leaves no layer to predict; predicting none",
    ]
    _, warnings = parse_policy(Env(depth="١٢"), 48, 256, 8)
    assert warnings == ["ONEBIT_MOE_PREDICT_DEPTH='١٢' is not a non-negative integer; ignored"]


def test_layer_checks_in_order() -> None:
    # reversed before out of range, out of range before layer 0
    assert parse_layers("9-7,0-9", 6)[1] == [
        "ONEBIT_MOE_PREDICT_LAYERS item '9-7' is a reversed range; ignored",
        "ONEBIT_MOE_PREDICT_LAYERS item '0-9' is out of range (the model has layers 0..5); ignored",
        "ONEBIT_MOE_PREDICT_LAYERS='9-7,0-9' leaves no layer to predict; predicting none",
    ]


def test_resolved_policy() -> None:
    p, warnings = parse_policy(Env(mode="ROUTER", depth="16", margin="0.1", min="2", layers="5-7,1"), 48, 128, 8)
    assert warnings == []
    assert (p.mode, p.depth_requested, p.depth, p.min_requested, p.min_read) == (MODE_ROUTER, 16, 16, 2, 2)
    assert p.margin == float(np.float32(0.1)) != 0.1
    assert p.predicted_layers == (1, 5, 6, 7) and p.n_layer_predicted == 4
    unset, _ = parse_policy(Env(), 48, 128, 8)
    assert (unset.depth_requested, unset.min_requested, unset.margin) == (0, -1, math.inf)


def test_env_from_environ() -> None:
    environ = {"ONEBIT_MOE_PREDICT": "block", "ONEBIT_MOE_PREDICT_LAYERS": "", "ONEBIT_MOE_PREDICT_OUT": "/tmp/t"}
    assert Env.from_environ(environ) == Env(mode="block", layers="")
    assert Env.from_environ({}) == Env()


@cases_of(KnobCase)
def test_resolve_knob(case: KnobCase) -> None:
    assert resolve_knob(case.api, case.env) == case.expected
