"""tools/router_maps.py's least-squares router map (it finds a map that exists, and no more), and the
torch forward pass's router maps and router inputs it is built on (skipped without torch)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tools.router_maps import fit_router_map, main

H256 = Path(__file__).resolve().parent.parent / "models" / "qwen3moe-h256.gguf"


def _case(seed: int = 0, n: int = 400, n_embd: int = 12, n_expert: int = 4):
    rng = np.random.default_rng(seed)
    xq = rng.standard_normal((n, n_embd))
    w = rng.standard_normal((n_expert, n_embd))
    r_true = 0.1 * rng.standard_normal((n_expert, n_embd))
    # x_f differs from x_q by exactly what moves the scores by x_q R^T
    xf = xq + xq @ r_true.T @ np.linalg.solve(w @ w.T, w)
    return xq, xf, w, r_true


def test_recovers_a_map_that_exists() -> None:
    xq, xf, w, r_true = _case()
    r, before, after = fit_router_map(xq, xf, w, ridge=0.0)
    assert r.shape == r_true.shape
    np.testing.assert_allclose(r, r_true, atol=1e-9)
    assert before > 1.0 and after < 1e-12 * before


def test_noise_it_cannot_follow_is_left() -> None:
    xq, _, w, _ = _case()
    noise = np.random.default_rng(1).standard_normal(xq.shape)  # independent of x_q: no map predicts it
    r, before, after = fit_router_map(xq, xq + noise, w, ridge=0.0)
    assert after == pytest.approx(before, rel=0.1) and after <= before


def test_ridge_shrinks_the_map() -> None:
    xq, xf, w, _ = _case()
    r0, _, after0 = fit_router_map(xq, xf, w, ridge=0.0)
    r1, _, after1 = fit_router_map(xq, xf, w, ridge=1.0)
    assert np.linalg.norm(r1) < np.linalg.norm(r0) and after1 > after0


def test_the_forward_pass_takes_router_maps_and_hands_out_router_inputs() -> None:
    """kl_fit's pass with a zero map is the pass without one; a map of the router's own weight, times
    -2, turns each layer's scores around (so layers 1.. route elsewhere); ``inputs`` gets each layer's
    router input, the one its scores come from."""
    torch = pytest.importorskip("torch", reason="needs torch (the optional 'fit' extra)")
    from onebit_predict.int2 import kl_fit as K

    model = K.TorchQwen3Moe(H256)
    tokens = torch.arange(32).view(1, 32) % 250
    n = model.hp.n_layer
    zero = [torch.zeros(model.hp.n_expert, model.hp.n_embd) for _ in range(n)]
    flip = [-2.0 * model.w[f"blk.{li}.ffn_gate_inp.weight"] for li in range(n)]
    with torch.no_grad():
        plain: list = []
        inputs: list = []
        ref = model.logits(tokens, None, plain, None, None, inputs)
        assert torch.equal(model.logits(tokens, None, None, None, zero), ref)
        flipped: list = []
        model.logits(tokens, None, flipped, None, flip)
    assert len(inputs) == n and inputs[0].shape == (32, model.hp.n_embd)
    w0 = model.w["blk.0.ffn_gate_inp.weight"]
    torch.testing.assert_close(plain[0], (inputs[0] @ w0.T).log_softmax(-1))
    torch.testing.assert_close(flipped[0], (-(inputs[0] @ w0.T)).log_softmax(-1))  # same input, scores negated


def test_a_model_that_is_not_there_is_an_input_error(tmp_path, capsys) -> None:
    missing = str(tmp_path / "none.gguf")
    assert main(["--model", missing, "--quantized", missing, "--compensator", missing]) == 2
    assert "none.gguf" in capsys.readouterr().err
