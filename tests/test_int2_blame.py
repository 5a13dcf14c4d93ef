"""``onebit-int2 blame`` (int2/blame.py) and the capture's ``replace`` hook it stands on (int2/capture.py).

- The hook reaches the graph: every layer's MoE output of the Q2_K model replaced by numpy's F16
  one brings its logits back to F16's (KL ~1e-7 against ~1e-2 without), and a hook that hands back
  the 2-bit output itself changes nothing (the check can fail both ways).
- blame's own control refuses a run whose replacement did not take (exit 1 from the command).
- A small blame on the real Q2_K variant: layer 0 never flips (its input is the embedding and
  attention, which no variant changes), every layer's 2-bit error removes some KL, and the table,
  ``--json`` and exit codes are the command's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from onebit_predict.commands.int2 import main as int2_main
from onebit_predict.int2 import blame as B
from onebit_predict.int2.capture import CaptureError, Capturer, corpus_streams, windows
from onebit_predict.int2.moe_numpy import load_moe
from onebit_predict.int2.variants import Store

REPO = Path(__file__).resolve().parent.parent
H256 = REPO / "models" / "qwen3moe-h256.gguf"
TRAIN_TOKENS = 2048  # the imatrix's text: a few seconds


@pytest.fixture(scope="module")
def q2(tmp_path_factory) -> Path:
    return Store(H256, tmp_path_factory.mktemp("int2"), threads=1, train_tokens=TRAIN_TOKENS).variant("q2_k").path


@pytest.fixture(scope="module")
def held() -> list[np.ndarray]:
    return windows(corpus_streams()[1], 2)


def _unchanged(_ref, layers):
    """A full_precision that writes back what the 2-bit experts computed: a replacement that takes nothing."""
    return lambda layer, act: act.y if layers is None or layer in layers else None


def _kl(full: Capturer, other: Capturer, wins: list[np.ndarray]) -> float:
    return float(np.mean(np.concatenate([B.token_kl(full.logprobs(w), other.logprobs(w)) for w in wins])))


@pytest.mark.needs_build
def test_replacing_every_layer_with_f16_brings_back_f16_s_logits(q2, held):
    ref = load_moe(H256)
    with (
        Capturer(H256, 1) as full,
        Capturer(q2, 1) as plain,
        Capturer(q2, 1, replace=B.full_precision(ref, None)) as every,
        Capturer(q2, 1, replace=lambda _layer, act: act.y) as same,
        Capturer(q2, 1, replace=B.full_precision(ref, [3])) as last,
    ):
        kl_plain, kl_every = _kl(full, plain, held), _kl(full, every, held)
        kl_same, kl_last = _kl(full, same, held), _kl(full, last, held)
        assert (every.replaced, same.replaced, last.replaced) == (2 * 4, 2 * 4, 2)
    assert kl_plain > 1e-3 and kl_every < 1e-5, (kl_plain, kl_every)
    assert kl_same == pytest.approx(kl_plain, rel=1e-6)  # writing back what was computed changes nothing
    assert kl_every < kl_last < kl_plain  # one layer removes a part


@pytest.mark.needs_build
def test_a_replacement_of_the_wrong_shape_is_an_error_not_a_write(q2, held):
    with Capturer(q2, 1, replace=lambda _layer, act: act.y[:-1]) as bad:
        with pytest.raises(CaptureError, match=r"ffn_moe_out-0: a replacement \(255, 256\) for \(256, 256\)"):
            bad.run(held[:1])
        assert bad.replaced == 0


@pytest.mark.needs_build
def test_blame_of_q2_k(q2):
    r = B.blame(H256, q2, "q2_k", heldout_windows=4, train_windows=2)
    assert r.tokens == 4 * 256 and [x.layer for x in r.layers] == [0, 1, 2, 3]
    assert r.kl_mean > 1e-3 and r.kl_all_replaced < B.CONTROL_KL_MAX
    assert r.kl_p99 <= r.kl_max and 0.5 < r.top1 < 1.0
    assert r.layers[0].flip == 0.0 and r.layers[0].kl_flipped is None  # the same input, the same router
    for x in r.layers:
        assert 0 < x.kl_removed < r.kl_mean and x.kl_replaced == pytest.approx(r.kl_mean - x.kl_removed)
        assert 1e-4 < x.energy_heldout < 0.5 and 1e-4 < x.energy_train < 0.5
    assert 0 < r.any_flip < 1 and r.any_flip >= max(x.flip for x in r.layers)
    flipped = [x for x in r.layers if x.kl_flipped is not None]
    assert flipped and all(x.kl_flipped > x.kl_kept for x in flipped)  # a flipped token costs more


@pytest.mark.needs_build
def test_blame_refuses_a_replacement_that_did_not_take(q2, monkeypatch):
    monkeypatch.setattr(B, "full_precision", _unchanged)
    with pytest.raises(B.BlameError, match="the replacement did not reach the graph"):
        B.blame(H256, q2, "q2_k", heldout_windows=2, train_windows=1)


@pytest.mark.needs_build
def test_blame_command(run_cli, tmp_path, q2, monkeypatch):
    cache = q2.parent.parent  # the fixture's store: its variant is found, not made again
    args = [H256, "--types", "q2_k", "--windows", "2", "--train-windows", "1", "--cache-dir", cache]
    args += ["--train-tokens", TRAIN_TOKENS]
    rc, out, err = run_cli(int2_main, "blame", *args, "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["model"] == str(H256.resolve()) and "2 held-out windows of 256 tokens" in report["text"]
    (row,) = report["rows"]
    assert row["variant"] == "q2_k" and row["model"] == str(q2) and len(row["layers"]) == 4
    rc, out, _ = run_cli(int2_main, "blame", *args)
    assert rc == 0 and "every layer replaced" in out and "energy held-out %" in out
    assert [ln.split()[:2] for ln in out.splitlines() if ln.startswith(" q2_k") or ln.startswith("q2_k ")] == [
        ["q2_k", str(layer)] for layer in range(4)
    ]
    monkeypatch.setattr(B, "full_precision", _unchanged)
    rc, out, err = run_cli(int2_main, "blame", *args)
    assert rc == 1 and out == "" and "did not reach the graph" in err
    rc, _, err = run_cli(int2_main, "blame", H256, "--types", "f16", "--cache-dir", tmp_path)
    assert rc == 2 and "blame needs a row other than f16" in err
