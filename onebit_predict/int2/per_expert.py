"""A low-rank correction per routed expert, measured in numpy before any patch (``onebit-int2 per-expert``).

What it is for. The per-layer compensator (compensator.py) maps the MoE block's output ``y`` to a
correction; but the 2-bit error is a sum over the routed experts, each gated, and one map of the
block cannot know which experts ran. This module measures the form that can:

    y' = y + sum over the routed experts e of  g_e * up_e (down_e s_e)

``s_e`` is the MoE block's input x (each expert's own input; ``input``) or the expert's own 2-bit
output ``q_e(x)`` (``output``), ``g_e`` the expert's router weight, and ``up_e down_e`` a rank-r
map per (layer, expert). Each map is fitted by reduced-rank regression
(compensator.fit_layers, its ridge chosen on a fifth of the training capture as compensator.sweep
does) on the training rows routed to that expert, weighted by the gate: sources ``g_e s_e``, targets
``g_e (f_e(x) - q_e(x))``, with ``f_e`` the F16 expert and ``q_e`` the 2-bit one, both computed in
numpy (moe_numpy.py) on the 2-bit run's captured input.

Measured on held-out windows, two ways:

- the residual energy it removes per layer, ``1 - ||f16(x) - y'||^2 / ||f16(x) - y||^2``, the
  per-layer sidecar's own score (compensator.FitScore);
- end to end: KL(F16 || row) per token, with ``y'`` written into llama.cpp's graph by the capture's
  ``replace`` hook (capture.py), so every later layer runs on the corrected output, as a patch
  would. The per-layer sidecar's row is llama.cpp's own (ONEBIT_MOE_COMPENSATOR), on the same
  windows.

Its cost, per MoE layer: ``n_expert * 2 r n_embd`` values held, ``n_expert_used * 2 r n_embd``
multiply-adds per token.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..atomic import atomic_write_bytes
from .blame import token_kl
from .capture import Capturer, LayerActivations, corpus_streams, reference_output, windows
from .compensator import SOURCE_INPUT, SOURCE_OUTPUT, Compensator, CompensatorLayer, Moments, read_compensator, sweep
from .moe_numpy import MoeModel, _silu, load_moe

RANKS = (16, 64)
TRAIN_WINDOWS = 256  # 65,536 training tokens, as onebit-compensator fit
HELDOUT_WINDOWS = 64
TUNE_EVERY = 5  # 1 training window in 5 tunes the ridge


def expert_output(model: MoeModel, layer: int, e: int, x: np.ndarray) -> np.ndarray:
    """Expert ``e``'s own output (N, n_embd) for inputs ``x``, not weighted by its gate."""
    ly = model.layers[layer]
    x = np.asarray(x, np.float32)
    return (_silu(x @ ly.gate[e].T) * (x @ ly.up[e].T)) @ ly.down[e].T


def _key(e: int) -> str:
    return f"expert{e}"


def collect(
    capturer: Capturer, full: MoeModel, quant: MoeModel, wins: Sequence[np.ndarray], tune_every: int, source: str
) -> tuple[dict[tuple[str, int], Moments], dict[tuple[str, int], Moments]]:
    """Per (expert, layer), the gate-weighted fit data of ``wins``: (fit part, tuning part); the source
    is the expert's input x (SOURCE_INPUT) or its own 2-bit output q_e(x) (SOURCE_OUTPUT)."""
    main: dict[tuple[str, int], Moments] = {}
    tune: dict[tuple[str, int], Moments] = {}
    for i, w in enumerate(wins):
        into = tune if tune_every and i % tune_every == tune_every - 1 else main
        for li, act in capturer.run([w]).layers.items():
            for e in range(full.n_expert):
                rows, slot = np.nonzero(act.experts == e)
                if not len(rows):
                    continue
                xs, g = act.x[rows], act.weights[rows, slot][:, None].astype(np.float64)
                f, q = expert_output(full, li, e, xs), expert_output(quant, li, e, xs)
                src = xs if source == SOURCE_INPUT else q
                into.setdefault((_key(e), li), Moments.zeros(xs.shape[1])).add(g * src, g * (f - q), g * f)
    return main, tune


@dataclass(frozen=True)
class PerExpert:
    """The fitted maps of one rank: (layer, expert) -> map."""

    rank: int
    maps: Mapping[tuple[int, int], CompensatorLayer]
    source: str  # SOURCE_INPUT (the expert's input x) or SOURCE_OUTPUT (its own 2-bit output)
    quant: MoeModel  # the 2-bit experts, for an output-source map's q_e(x)

    def correct(self, layer: int, act: LayerActivations) -> np.ndarray:
        """``y'`` for one layer's captured rows."""
        y = np.array(act.y, np.float32)
        for e in range(int(act.experts.max()) + 1):
            m = self.maps.get((layer, e))
            rows, slot = np.nonzero(act.experts == e)
            if m is None or not len(rows):
                continue
            xs = act.x[rows]
            src = xs if self.source == SOURCE_INPUT else expert_output(self.quant, layer, e, xs)
            y[rows] += act.weights[rows, slot][:, None] * m.apply(src)
        return y

    def values(self) -> int:
        """The values it holds (float32 each)."""
        return sum(m.up.size + m.down.size for m in self.maps.values())


def write_maps(path: Path, maps: Mapping[tuple[int, int], CompensatorLayer]) -> None:
    """Per-expert maps of one rank (kl_fit's ``experts``) as a numpy archive, written whole or not at all:
    ``keys`` (n, 2) layer and expert, ``down`` (n, r, n_embd), ``up`` (n, n_embd, r). No runtime reads it:
    it carries a fit to :func:`read_maps` and :func:`score`."""
    keys = sorted(maps)
    buf = io.BytesIO()
    np.savez(
        buf,
        keys=np.array(keys, np.int32).reshape(-1, 2),
        down=np.stack([maps[k].down for k in keys]).astype(np.float32),
        up=np.stack([maps[k].up for k in keys]).astype(np.float32),
    )
    atomic_write_bytes(path, buf.getvalue())


def read_maps(path: Path, quantized: Path) -> PerExpert:
    """:func:`write_maps`'s archive as a PerExpert (output source) of the 2-bit model ``quantized``;
    ValueError naming the file where it is not one, or not one of that model's shape."""
    try:
        with np.load(path, allow_pickle=False) as z:
            keys, down, up = z["keys"], z["down"], z["up"]
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"{path}: not a per-expert archive ({e})") from None
    if keys.ndim != 2 or keys.shape[1] != 2 or down.ndim != 3 or up.shape != (len(keys), down.shape[2], down.shape[1]):
        raise ValueError(f"{path}: per-expert archive of inconsistent shapes {keys.shape}, {down.shape}, {up.shape}")
    quant = load_moe(quantized)
    foreign = [(int(li), int(e)) for li, e in keys if int(li) not in quant.layers or not 0 <= e < quant.n_expert]
    if down.shape[2] != quant.n_embd or foreign:
        raise ValueError(f"{path}: maps of n_embd {down.shape[2]} for (layer, expert) {foreign[:3] or 'all'}, "
                         f"not of {quantized} (n_embd {quant.n_embd}, {quant.n_expert} experts, "
                         f"MoE layers {sorted(quant.layers)})")  # fmt: skip
    maps = {(int(li), int(e)): CompensatorLayer(down=down[i], up=up[i]) for i, (li, e) in enumerate(keys)}
    return PerExpert(int(down.shape[1]), maps, SOURCE_OUTPUT, quant)


@dataclass(frozen=True)
class RowScore:
    """One row on the held-out windows."""

    name: str
    rank: int | None
    kl_mean: float
    kl_p99: float
    kl_max: float
    top1: float
    energy_removed: dict[int, float]  # per layer; empty for rows measured only end to end
    values: int  # float32 values the correction holds (0: none)


def fit(
    full_path: Path,
    quantized: Path,
    ranks: Sequence[int] = RANKS,
    source: str = SOURCE_INPUT,
    *,
    train_windows: int = TRAIN_WINDOWS,
    threads: int = 1,
    log: Callable[[str], None] = lambda _: None,
) -> dict[int, PerExpert]:
    """Per-expert maps of each rank, fitted on the 2-bit run's training capture."""
    if source not in (SOURCE_INPUT, SOURCE_OUTPUT):
        raise ValueError(f"per-expert source {source!r} is not {SOURCE_INPUT} or {SOURCE_OUTPUT}")
    full, quant = load_moe(full_path), load_moe(quantized)
    train, _ = corpus_streams()
    with Capturer(quantized, threads) as cap:
        main, tune = collect(cap, full, quant, windows(train, train_windows), TUNE_EVERY, source)
    log(f"per-expert fit data: {sum(m.n for m in main.values())} routed rows in {len(main)} (expert, layer) pairs")
    _, fitted = sweep(main, tune, main, list(ranks))  # held-out scores come from the end-to-end run
    return {
        r: PerExpert(
            r, {(li, int(k[len("expert") :])): ly for (k, li, rk), ly in fitted.items() if rk == r}, source, quant
        )
        for r in ranks
    }


def score(
    full_path: Path,
    quantized: Path,
    fits: Mapping[int, PerExpert],
    sidecar: Path | None = None,
    *,
    heldout_windows: int = HELDOUT_WINDOWS,
    heldout: Sequence[int] | None = None,
    threads: int = 1,
    on_sidecar: bool = False,
    baseline: Path | None = None,
) -> list[RowScore]:
    """The plain 2-bit row, the per-layer sidecar's (when given) and each per-expert rank's, end to end
    and in residual energy, on the same held-out windows: evenly spaced over ``heldout``'s tokens
    (None: the corpus's validation split). ``on_sidecar``: each per-expert row runs with the sidecar
    too (the maps kl_fit fitted together: the experts' maps inside the MoE output, the sidecar's on it);
    ``baseline``: one more per-layer sidecar's row (one fitted without maps per expert), on the same windows."""
    full = load_moe(full_path)
    held = windows(corpus_streams()[1] if heldout is None else np.asarray(heldout, np.int32), heldout_windows)
    comp = read_compensator(sidecar) if sidecar is not None else None
    rows: list[_Row] = []
    with Capturer(full_path, threads) as cap_full:
        try:
            rows.append(("plain", None, Capturer(quantized, threads), None, 0))
            if baseline is not None:
                alone = read_compensator(baseline)
                rows.append(
                    _sidecar_row(f"per-layer {alone.source}, fitted alone", alone, baseline, quantized, threads)
                )
            if comp is not None:
                side = _sidecar_row(f"per-layer {comp.source}", comp, sidecar, quantized, threads)
                rows.append(side)
            for r, pe in sorted(fits.items()):
                if on_sidecar and comp is not None:
                    both = _both_correct(comp, pe)
                    cap = Capturer(quantized, threads, sidecar, replace=pe.correct)
                    rows.append((f"per-layer + per-expert {pe.source}", r, cap, both, side[4] + pe.values()))
                    continue
                cap = Capturer(quantized, threads, replace=pe.correct)
                rows.append((f"per-expert {pe.source}", r, cap, pe.correct, pe.values()))
            kls: list[list[np.ndarray]] = [[] for _ in rows]
            top1 = [0] * len(rows)
            err = [dict.fromkeys(full.layers, 0.0) for _ in rows]
            for w in held:
                f_lp = cap_full.logprobs(w)
                for i, (_, _, cap, _, _) in enumerate(rows):
                    layers = cap.run([w]).layers
                    lp = cap.last_logprobs
                    kls[i].append(token_kl(f_lp, lp))
                    top1[i] += int(np.sum(f_lp.argmax(axis=1) == lp.argmax(axis=1)))
                    if i:
                        continue
                    for li, act in layers.items():  # every correction's energy on the plain run's own rows
                        want = reference_output(full, li, act).astype(np.float64)
                        for j, (_, _, _, fix, _) in enumerate(rows):
                            got = act.y if fix is None else fix(li, act)
                            err[j][li] += float(np.sum((want - got) ** 2))
        finally:
            for _, _, cap, _, _ in rows:
                cap.close()
    out = []
    for i, (name, rank, _, fix, n) in enumerate(rows):
        kl = np.concatenate(kls[i])
        removed = {li: 1 - err[i][li] / err[0][li] for li in err[i]} if fix is not None else {}
        p99, top = float(np.percentile(kl, 99)), top1[i] / len(kl)
        out.append(RowScore(name, rank, float(kl.mean()), p99, float(kl.max()), top, removed, n))
    return out


Correct = Callable[[int, LayerActivations], np.ndarray]
# a scored row: name, rank, capturer, the correction in numpy (on the plain run's rows, for the energy), values held
_Row = tuple[str, int | None, Capturer, Correct | None, int]


def _sidecar_row(name: str, comp: Compensator, path: Path, quantized: Path, threads: int) -> _Row:
    """A per-layer sidecar's row: llama.cpp applies ``path`` (ONEBIT_MOE_COMPENSATOR), numpy ``comp``."""
    values = sum(x.up.size + x.down.size for x in comp.layers.values())
    return (name, comp.rank, Capturer(quantized, threads, path), _sidecar_correct(comp), values)


def _both_correct(comp: Compensator, pe: PerExpert) -> Correct:
    """The experts' maps, then the sidecar's on their sum, as the graph runs them (ffn_moe_out, then the
    compensator): for the energy score."""
    return lambda layer, act: comp.correct(layer, act.x, pe.correct(layer, act))


def _sidecar_correct(comp: Compensator) -> Correct:
    """The sidecar's correction in numpy (Compensator.correct), for the energy score."""
    return lambda layer, act: comp.correct(layer, act.x, act.y)
