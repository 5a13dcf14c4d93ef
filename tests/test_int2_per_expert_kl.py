"""The compensator's two new forms, before any patch: a map per routed expert (int2/per_expert.py,
numpy, scored end to end through the capture's hook) and every layer's map fitted to the KL
(int2/kl_fit.py, torch: the optional ``fit`` extra, skipped where torch is absent).

- per-expert: a small fit on the real Q2_K variant removes residual energy in layer 0 on held-out
  windows, holds the values it says, and its row runs through llama.cpp's graph (a KL that differs
  from the plain row's); the command takes one variant and at most one sidecar, exit 2 otherwise.
- kl_fit: its torch forward pass is llama.cpp's on the F16 model (KL < 1e-5 per token); a fit of
  two steps writes a valid sidecar whose kept held-out KL is never above the start's; the router
  term is in what the fit lowers (a batch's routers' KL falls further than a control's whose term
  weighs next to nothing), and only when asked; without torch the module names the extra.
- per-expert maps fitted with the sidecar (``fit-kl --expert-rank``): they start at zero, move,
  round-trip through their archive and run in llama.cpp's graph beside their sidecar; an archive of
  another model's shape, a missing sidecar or a lone flag is an input error.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from onebit_predict.commands.int2 import main as int2_main
from onebit_predict.int2 import kl_fit as K
from onebit_predict.int2 import per_expert as P
from onebit_predict.int2.capture import Capturer, corpus_streams, windows
from onebit_predict.int2.texts import corpus_text
from onebit_predict.int2.variants import HELDOUT_TOKENS, Store

REPO = Path(__file__).resolve().parent.parent
H256 = REPO / "models" / "qwen3moe-h256.gguf"
TORCH = "needs torch (the optional 'fit' extra)"


@pytest.fixture(scope="module")
def q2(tmp_path_factory) -> Path:
    return Store(H256, tmp_path_factory.mktemp("int2"), threads=1, train_tokens=2048).variant("q2_k").path


@pytest.fixture(scope="module")
def start(q2, tmp_path_factory) -> Path:
    """A rank-16 least-squares sidecar of ``q2`` (output source): the KL fits' start, fitted once."""
    pytest.importorskip("torch", reason=TORCH)  # only the KL fits use it: no fit where they skip
    from onebit_predict.commands.compensator import main as compensator_main

    out = tmp_path_factory.mktemp("ls") / "ls.comp.gguf"
    argv = ["fit", "--model", str(H256), "--quantized", str(q2), "--out", str(out), "--source", "output"]
    assert (
        compensator_main([*argv, "--ranks", "16", "--rank", "16", "--tokens", "2048", "--heldout-tokens", "512"]) == 0
    )
    return out


@pytest.mark.needs_build
def test_a_map_per_expert(q2):
    fits = P.fit(H256, q2, [16], train_windows=8)
    pe = fits[16]
    assert sorted({li for li, _ in pe.maps}) == [0, 1, 2, 3] and pe.values() == len(pe.maps) * 2 * 16 * 256
    plain, row = P.score(H256, q2, fits, heldout_windows=2)
    assert (plain.name, plain.values, plain.energy_removed) == ("plain", 0, {})
    _, val = corpus_streams()  # the default held-out stream is the validation split; another stream, other windows
    assert [r.kl_mean for r in P.score(H256, q2, fits, heldout_windows=2, heldout=val.tolist())] == [
        plain.kl_mean,
        row.kl_mean,
    ]
    assert P.score(H256, q2, {}, heldout_windows=2, heldout=val[::-1].tolist())[0].kl_mean != plain.kl_mean
    assert row.name == "per-expert input" and row.rank == 16 and row.kl_mean != plain.kl_mean
    assert row.energy_removed[0] > 0.3, row.energy_removed  # layer 0: the easiest, as the per-layer map's 98 %
    with pytest.raises(ValueError, match="per-expert source 'middle'"):
        P.fit(H256, q2, [16], "middle", train_windows=2)


@pytest.mark.parametrize("text", ["val", "outside"])
def test_per_expert_scores_the_text_asked_for(run_cli, tmp_path, monkeypatch, text):
    """--text reaches per-expert's held-out windows (val: the validation split, score's default), and its
    report names that text; the fit stays on the training split."""
    import onebit_predict.commands.int2 as C

    seen = []

    def score(*args, heldout=None, **kwargs):
        seen.append(heldout)
        return [P.RowScore("plain", None, 0.01, 0.1, 1.0, 0.9, {}, 0)]

    monkeypatch.setattr(C.Store, "variant", lambda self, name: SimpleNamespace(path=tmp_path / f"{name}.gguf"))
    monkeypatch.setattr(C.per_expert, "fit", lambda *args, **kwargs: {})
    monkeypatch.setattr(C.per_expert, "score", score)
    argv = ["per-expert", H256, "--types", "q2_k", "--text", text, "--json", "--cache-dir", tmp_path / "cache"]
    rc, out, err = run_cli(int2_main, *argv)
    assert rc == 0, err
    report = json.loads(out)
    if text == "val":
        assert seen == [None] and report["heldout"] == "val" and "validation split" in report["text"]
    else:
        want = corpus_text(text, HELDOUT_TOKENS, tmp_path / "cache")
        assert seen == [want.tokens()] and report["heldout"]["split"] == text and "outside" in report["text"]


def test_per_expert_takes_one_variant_and_one_sidecar(run_cli, tmp_path):
    rc, _, err = run_cli(int2_main, "per-expert", H256, "--types", "q2_k,iq2_s", "--cache-dir", tmp_path)
    assert rc == 2 and "per-expert takes one variant (--types), not q2_k,iq2_s" in err
    side = tmp_path / "s.gguf"
    side.write_bytes(b"x")
    rc, _, err = run_cli(int2_main, "per-expert", H256, "--types", "q2_k", "--compensator", f"iq2_s={side}",
                         "--cache-dir", tmp_path)  # fmt: skip
    assert rc == 2 and "at most one --compensator, for q2_k" in err


def test_kl_fit_names_its_extra_without_torch(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch":
            raise ImportError("no torch")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    with pytest.raises(K.KlFitError, match=r"pip install -e \.\[fit\]"):
        K.require_torch()


@pytest.mark.needs_build
def test_the_torch_forward_pass_is_llama_cpp_s():
    torch = pytest.importorskip("torch", reason=TORCH)
    model = K.TorchQwen3Moe(H256)
    (w,) = windows(corpus_streams()[1], 1)
    with Capturer(H256, 1) as cap:
        ref = cap.logprobs(w)
    lp = model.logits(torch.from_numpy(w[None].astype(np.int64)))[0].double().log_softmax(-1).numpy()
    kl = float(np.mean(np.sum(np.exp(ref) * (ref - lp), axis=1)))
    assert kl < 1e-5, kl
    assert float(np.mean(np.sum(np.exp(ref) * (ref - np.roll(lp, 1, axis=0)), axis=1))) > 0.1  # the check can fail


@pytest.mark.needs_build
def test_a_short_kl_fit_writes_a_valid_sidecar(q2, start, tmp_path):
    from onebit_predict.int2.compensator import check_model, read_compensator, write_compensator

    got = K.fit(H256, q2, start, train_windows=2, heldout_windows=2, steps=2, batch=1)
    assert got.best_heldout_kl <= got.start_heldout_kl and len(got.steps) == 2
    out = tmp_path / "kl.comp.gguf"
    write_compensator(out, got.compensator)
    again = read_compensator(out)
    check_model(again, q2)
    assert again.rank == 16 and "then KL against F16 + 1 x the routers' KL, 2 steps" in again.fitted_on  # the default


@pytest.mark.needs_build
def test_the_router_term_pulls_the_routers_towards_f16s(q2, start):
    # one training window, so every step sees the same batch: its routers' KL before each update. Adam's
    # first step need not lower it (it did not on one CPU), so the claim is on where six steps end, against
    # a control whose routers' term weighs next to nothing
    pulled = K.fit(H256, q2, start, train_windows=1, heldout_windows=1, steps=6, batch=1, router_weight=100.0)
    seen = [s.train_router_kl for s in pulled.steps]
    assert seen[-1] < 0.85 * seen[0], seen
    control = K.fit(H256, q2, start, train_windows=1, heldout_windows=1, steps=6, batch=1, router_weight=1e-9)
    unpulled = [s.train_router_kl for s in control.steps]
    assert unpulled[0] == pytest.approx(seen[0]) and seen[-1] < unpulled[-1], (seen, unpulled)
    assert pulled.start_heldout_router_kl > 0 and "+ 100 x the routers' KL" in pulled.compensator.fitted_on
    alone = K.fit(H256, q2, start, train_windows=1, heldout_windows=1, steps=1, batch=1, router_weight=0.0)
    assert alone.steps[0].train_router_kl is None and "routers" not in alone.compensator.fitted_on


def test_fit_kl_command_input_errors(run_cli, tmp_path, monkeypatch):
    from onebit_predict.commands.compensator import main as compensator_main

    side = tmp_path / "s.gguf"
    side.write_bytes(b"x")
    base = ["fit-kl", "--model", H256, "--quantized", H256, "--out", tmp_path / "o.gguf"]
    rc, _, err = run_cli(compensator_main, *base, "--start", tmp_path / "absent.gguf")
    assert rc == 2 and "no such file" in err
    rc, _, err = run_cli(compensator_main, *base, "--start", side, "--lr", "0")
    assert rc == 2 and "'0' is not a finite number > 0" in err
    rc, _, err = run_cli(compensator_main, *base, "--start", side, "--router-weight", "-1")
    assert rc == 2 and "'-1' is not a finite number >= 0" in err

    def no_torch():
        raise K.KlFitError(f"fitting to the KL needs torch: pip install -e .[{K.EXTRA}]")

    monkeypatch.setattr(K, "require_torch", no_torch)
    rc, out, err = run_cli(compensator_main, *base, "--start", side)
    assert rc == 2 and out == "" and "pip install -e .[fit]" in err


@pytest.mark.needs_build
def test_a_kl_fit_with_maps_per_expert_moves_them_and_scores_them_with_its_sidecar(q2, start, tmp_path):
    """--expert-rank: the experts' maps start at zero (the sidecar alone, to the bit), move in the fit, and
    the archive they are written to is scored with the sidecar beside them through llama.cpp's graph."""
    torch = pytest.importorskip("torch", reason=TORCH)
    model = K.TorchQwen3Moe(q2)
    x = torch.from_numpy(np.stack(windows(corpus_streams()[1], 1)).astype(np.int64))
    zero = [(torch.ones(8, 4, 256), torch.zeros(8, 256, 4)) for _ in range(4)]
    assert torch.equal(model.logits(x, None, None, zero), model.logits(x))
    moved = [(d, u + 1e-2) for d, u in zero]
    assert not torch.equal(model.logits(x, None, None, moved), model.logits(x))  # the check can fail

    got = K.fit(H256, q2, start, train_windows=1, heldout_windows=1, steps=3, batch=1, expert_rank=4, lr=1e-3)
    assert sorted(got.experts) == [(li, e) for li in range(4) for e in range(8)]
    assert {m.down.shape + m.up.shape for m in got.experts.values()} == {(4, 256, 256, 4)}
    kept_zero = got.best_step == 0
    assert kept_zero == all(not m.up.any() for m in got.experts.values())  # up moved unless the start was kept

    archive = tmp_path / "maps.npz"
    P.write_maps(archive, got.experts)
    back = P.read_maps(archive, q2)
    assert back.rank == 4 and back.source == "output" and sorted(back.maps) == sorted(got.experts)
    assert all(np.array_equal(back.maps[k].up, got.experts[k].up) for k in got.experts)
    plain, side, both = P.score(H256, q2, {4: back}, start, heldout_windows=1, on_sidecar=True)
    assert both.name == "per-layer + per-expert output" and both.values == side.values + back.values()
    assert (both.kl_mean == side.kl_mean) == kept_zero  # the maps ran in the graph, on the sidecar's run
    (tmp_path / "bad.npz").write_bytes(b"not an archive")
    with pytest.raises(ValueError, match="bad.npz: not a per-expert archive"):
        P.read_maps(tmp_path / "bad.npz", q2)


def test_per_expert_maps_need_their_sidecar_and_fit_kl_their_archive(run_cli, tmp_path):
    from onebit_predict.commands.compensator import main as compensator_main

    maps = tmp_path / "m.npz"
    maps.write_bytes(b"x")
    rc, _, err = run_cli(int2_main, "per-expert", H256, "--types", "q2_k", "--maps", maps, "--cache-dir", tmp_path)
    assert rc == 2 and "--maps scores the maps with the sidecar fitted beside them: give --compensator" in err
    side = tmp_path / "s.gguf"
    side.write_bytes(b"x")
    base = ["fit-kl", "--model", H256, "--quantized", H256, "--start", side, "--out", tmp_path / "o.gguf"]
    rc, _, err = run_cli(compensator_main, *base, "--expert-rank", "16")
    assert rc == 2 and "--expert-rank and --experts-out go together" in err
    rc, _, err = run_cli(compensator_main, *base, "--expert-rank", "0", "--experts-out", maps)
    assert rc == 2 and "'0' is not a positive integer" in err
    nowhere = tmp_path / "no" / "m.npz"
    rc, _, err = run_cli(compensator_main, *base, "--expert-rank", "4", "--experts-out", nowhere)
    assert rc == 2 and f"--experts-out {nowhere}: the directory {nowhere.parent} does not exist" in err


@pytest.mark.needs_build
def test_per_expert_maps_of_another_model_are_refused(q2, tmp_path):
    """An archive whose maps do not fit the 2-bit model (another width, a layer it has not) is an input
    error naming both, before any scoring; the model's own shape is read back."""
    from onebit_predict.int2.compensator import CompensatorLayer

    def archive(n_embd: int, keys: list[tuple[int, int]]) -> Path:
        path = tmp_path / f"m{n_embd}-{len(keys)}.npz"
        layer = CompensatorLayer(np.zeros((2, n_embd), np.float32), np.zeros((n_embd, 2), np.float32))
        P.write_maps(path, {k: layer for k in keys})
        return path

    assert P.read_maps(archive(256, [(0, 0), (3, 7)]), q2).rank == 2
    with pytest.raises(ValueError, match=r"maps of n_embd 128 .* \(n_embd 256, 8 experts"):
        P.read_maps(archive(128, [(0, 0)]), q2)
    with pytest.raises(ValueError, match=r"\(layer, expert\) \[\(4, 0\)\]"):
        P.read_maps(archive(256, [(0, 0), (4, 0)]), q2)
    with pytest.raises(ValueError, match=r"\[\(0, 8\)\]"):
        P.read_maps(archive(256, [(0, 8)]), q2)
