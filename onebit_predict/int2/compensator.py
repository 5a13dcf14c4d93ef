"""The 2-bit compensator: its sidecar file, the model it names, and the least-squares fit.

What it is for. 2-bit experts (Q2_K, IQ2_XXS) lose quality. Per MoE layer l the compensator
adds a linear map to the layer's MoE output, ``y = moe_q2(x) + C_l s``, where ``s`` is either
the MoE block's input ``x`` (the ``ffn_norm-{l}`` tensor, source ``"input"``) or the MoE output
``y`` itself, before compensation (source ``"output"``). ``C_l = up_l @ down_l`` has rank r
(r = n_embd is full rank). It is fitted offline, by least squares, on activations of the 2-bit
model's run on training text (capture.py): ``s`` from the 2-bit run and the target residual
``moe_f16(x) - y_q2``, the full-precision experts (moe_numpy.py) minus what llama.cpp's 2-bit
experts computed, with the same routing.

The sidecar file (what llama.cpp's side reads, exactly): a GGUF file with

- ``general.architecture = "onebit_compensator"``;
- ``onebit_compensator.n_embd``, ``onebit_compensator.rank`` (1..n_embd) and
  ``onebit_compensator.n_layer`` (the model's layer count: ``block_count`` less
  ``nextn_predict_layers``), each u32;
- ``onebit_compensator.source`` (string): ``"input"`` (s = the MoE block's input x) or
  ``"output"`` (s = the MoE output before compensation);
- the model it was fitted for: ``onebit_compensator.model.architecture`` (string: the model
  GGUF's ``general.architecture``) and ``onebit_compensator.model.experts_hash`` (u64:
  :func:`experts_hash`: the learned predictor's router hash (learned.model_identity: FNV-1a 64
  over expert 0's router row, as little-endian float32, of every MoE layer), continued with
  FNV-1a 64 over, for each MoE layer l in increasing order (the layers with
  ``blk.{l}.ffn_gate_inp.weight``, l < n_layer), the ggml type ids, 4 bytes little-endian
  uint32 each, of ``ffn_gate_exps``, ``ffn_up_exps`` and ``ffn_down_exps`` (0xffffffff for one
  the layer lacks). Quantization leaves the router alone, so the types tell a Q2_K file from its
  F16 source or an IQ2_XXS sibling. Not the experts' bytes: llama.cpp repacks Q2_K and other
  types in memory (its extra buffer types), so the loader cannot read the file's bytes back;
  two quantizations to the same types of the same model (Q2_K with and without an importance
  matrix) are not told apart);
- optional, informational: ``onebit_compensator.model_name`` (string: ``general.name``),
  ``onebit_compensator.fitted_on`` (string: what it was fitted on), ``onebit_compensator.tokens``
  (u32: the training tokens);
- for every MoE layer l (the loader refuses a missing one): ``compensator.{l}.down``, F32, numpy
  shape ``(rank, n_embd)`` (ggml ``ne0 = n_embd, ne1 = rank``) and ``compensator.{l}.up``, F32,
  numpy shape ``(n_embd, rank)`` (ggml ``ne0 = rank, ne1 = n_embd``); no other tensor. The graph
  computes ``t = down @ s``, then ``c = up @ t``, and adds ``c`` to the MoE output.

:func:`read_compensator` checks all of this that the file alone can say (and that every value
is finite, and that each layer's gain bound ``||up||_F * ||down||_F``, float64, is at most
SIDECAR_MAX_GAIN = 65504, F16's largest value, as the C++ loader does: sidecar.check_gain) and
raises :class:`CompensatorError` naming the file and the fault; which layers are
MoE layers only the model says: :func:`check_model` refuses a sidecar for another model
(architecture or experts hash, naming both hashes), another shape, or a missing layer.

The fit. For one layer and source, with the rows of ``S`` the sources and those of ``R`` the
residual targets, :class:`Moments` keeps ``G = S^T S``, ``H = S^T R`` and ``||R||^2`` (float64;
captures stream through them, and any split's residual is a function of them). The full-rank
fit is ridge regression, ``B = (G + lam I)^-1 H`` (``C = B^T``; ``lam = ridge * trace(G) / n_embd``,
0 is plain least squares, computed through the eigendecomposition of G, which is what
``numpy.linalg.lstsq`` gives for full-column-rank S). Rank r: the best rank-r C in the data norm
(reduced-rank regression), not a truncated SVD of C: minimising ``||R - S B||^2 + lam ||B||^2``
over rank(B) <= r gives ``B_r = B V_r V_r^T``, V_r the top r eigenvectors of the fitted values'
Gram matrix ``B^T (G + lam I) B = H^T B`` (the right singular vectors of the fitted values
``[S; sqrt(lam) I] B``; Eckart-Young on them). So ``up = V_r`` and ``down = (B V_r)^T``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..learned import LearnedError, fnv1a64
from ..learned import model_identity as router_identity
from ..sidecar import (
    KEY_ARCH,
    U32_MAX,
    check_f32_array,
    check_gain,
    check_identity,
    field_value,
    frobenius,
    is_uint,
    open_gguf,
    open_sidecar,
    unknown_keys,
    write_sidecar,
)

ARCH = "onebit_compensator"
KEY_N_EMBD = f"{ARCH}.n_embd"
KEY_RANK = f"{ARCH}.rank"
KEY_N_LAYER = f"{ARCH}.n_layer"
KEY_SOURCE = f"{ARCH}.source"
KEY_MODEL_ARCH = f"{ARCH}.model.architecture"  # string: the model GGUF's general.architecture
KEY_EXPERTS_HASH = f"{ARCH}.model.experts_hash"  # u64: experts_hash()
KEY_MODEL_NAME = f"{ARCH}.model_name"  # optional, informational
KEY_FITTED_ON = f"{ARCH}.fitted_on"  # optional, informational
KEY_TOKENS = f"{ARCH}.tokens"  # optional, informational
REQUIRED_KEYS = {
    KEY_N_EMBD: "u32",
    KEY_RANK: "u32",
    KEY_N_LAYER: "u32",
    KEY_SOURCE: "string",
    KEY_MODEL_ARCH: "string",
    KEY_EXPERTS_HASH: "u64",
}
OPTIONAL_KEYS = {KEY_MODEL_NAME: "string", KEY_FITTED_ON: "string", KEY_TOKENS: "u32"}

DOWN_NAME = "compensator.{layer}.down"  # F32, numpy (rank, n_embd)
UP_NAME = "compensator.{layer}.up"  # F32, numpy (n_embd, rank)
_TENSOR_RE = re.compile(r"compensator\.(0|[1-9][0-9]*)\.(down|up)")
EXPERT_ROLES = ("gate", "up", "down")  # the expert tensors whose types the experts hash covers, in its order
NO_TENSOR = 0xFFFFFFFF  # the type id the hash takes for an expert tensor a layer lacks
GAIN_BOUND = "the map's gain bound ||up||*||down||"  # what the refusal of a huge map names (sidecar.check_gain)

SOURCE_INPUT = "input"  # s = the MoE block's input (ffn_norm-{l})
SOURCE_OUTPUT = "output"  # s = the MoE output before compensation (ffn_moe_out-{l})
SOURCES = (SOURCE_INPUT, SOURCE_OUTPUT)
RIDGES = (0.0, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1)  # relative ridge: lam = ridge * trace(G) / n_embd


class CompensatorError(ValueError):
    """A sidecar file (or a compensator about to be written) that is not what this module defines."""


@dataclass(frozen=True)
class CompensatorLayer:
    """One MoE layer's map ``c = up @ (down @ s)``: down (rank, n_embd), up (n_embd, rank)."""

    down: np.ndarray
    up: np.ndarray

    @property
    def gain_bound(self) -> float:
        """``||up||_F * ||down||_F`` (float64): at least the spectral norm of C, so no unit-norm source
        comes out longer; a sidecar holds it to SIDECAR_MAX_GAIN (sidecar.check_gain)."""
        return frobenius(self.up) * frobenius(self.down)

    @property
    def matrix(self) -> np.ndarray:
        """C = up @ down, (n_embd, n_embd)."""
        return self.up.astype(np.float64) @ self.down.astype(np.float64)

    def apply(self, s: np.ndarray) -> np.ndarray:
        """The correction for sources ``s`` (..., n_embd), as the graph computes it (float32)."""
        s = np.asarray(s, dtype=np.float32)
        return (s @ self.down.T) @ self.up.T


@dataclass(frozen=True)
class Compensator:
    """A whole sidecar: the keys and, per MoE layer, its map."""

    n_embd: int
    rank: int
    n_layer: int
    source: str
    model_arch: str  # the model's general.architecture (KEY_MODEL_ARCH)
    experts_hash: int  # experts_hash() of the model (KEY_EXPERTS_HASH), u64
    model_name: str = ""
    fitted_on: str = ""
    tokens: int = 0
    layers: Mapping[int, CompensatorLayer] = field(default_factory=dict)

    def correct(self, layer: int, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """The compensated MoE output of ``layer`` for inputs ``x`` and 2-bit outputs ``y`` (T, n_embd)."""
        ly = self.layers.get(layer)
        if ly is None:
            return y
        return y + ly.apply(x if self.source == SOURCE_INPUT else y)

    def validate(self, where: str = "compensator") -> None:
        """Raise :class:`CompensatorError` unless this can be written as a valid sidecar."""
        _check_header(where, self.n_embd, self.rank, self.n_layer, self.source, self.tokens)
        _check_identity(where, self.model_arch, self.experts_hash)
        if not isinstance(self.model_name, str) or not isinstance(self.fitted_on, str):
            raise CompensatorError(f"{where}: {KEY_MODEL_NAME} and {KEY_FITTED_ON} are strings")
        if not self.layers:
            raise CompensatorError(f"{where}: no layer")
        beyond = sorted(li for li in self.layers if not 0 <= li < self.n_layer)
        if beyond:
            raise CompensatorError(f"{where}: layer(s) {beyond} are not layers of a {self.n_layer}-layer model")
        for li in sorted(self.layers):
            ly = self.layers[li]
            _check_array(where, DOWN_NAME.format(layer=li), ly.down, (self.rank, self.n_embd))
            _check_array(where, UP_NAME.format(layer=li), ly.up, (self.n_embd, self.rank))
            check_gain(where, li, GAIN_BOUND, ly.gain_bound, CompensatorError)


def _check_header(where: str, n_embd, rank, n_layer, source, tokens) -> None:
    for key, v in ((KEY_N_EMBD, n_embd), (KEY_RANK, rank), (KEY_N_LAYER, n_layer), (KEY_TOKENS, tokens)):
        if not is_uint(v, U32_MAX):
            raise CompensatorError(f"{where}: {key} = {v!r} is not a u32")
    if int(n_embd) < 1 or int(n_layer) < 1:
        raise CompensatorError(f"{where}: {KEY_N_EMBD} = {n_embd}, {KEY_N_LAYER} = {n_layer}: both must be >= 1")
    if not 1 <= int(rank) <= int(n_embd):
        raise CompensatorError(f"{where}: {KEY_RANK} = {rank} is out of range 1..n_embd={n_embd}")
    if source not in SOURCES:
        raise CompensatorError(f"{where}: {KEY_SOURCE} = {source!r} is not one of {', '.join(SOURCES)}")


def _check_identity(where: str, model_arch, h) -> None:
    check_identity(where, KEY_MODEL_ARCH, model_arch, KEY_EXPERTS_HASH, h, CompensatorError)


def _check_array(where: str, name: str, arr, shape: tuple[int, ...]) -> None:
    check_f32_array(where, name, arr, shape, CompensatorError)


# --- the file -------------------------------------------------------------------------------


def write_compensator(path: str | Path, comp: Compensator) -> None:
    """Write ``comp`` as a sidecar GGUF at ``path`` (validated first: :class:`CompensatorError`),
    whole or not at all (atomic.py)."""
    path = Path(path)
    comp.validate(str(path))
    keys = [("u32", KEY_N_EMBD, comp.n_embd), ("u32", KEY_RANK, comp.rank), ("u32", KEY_N_LAYER, comp.n_layer)]
    keys += [("string", KEY_SOURCE, comp.source), ("string", KEY_MODEL_ARCH, comp.model_arch)]
    keys += [("u64", KEY_EXPERTS_HASH, comp.experts_hash)]
    keys += [("string", KEY_MODEL_NAME, comp.model_name)] if comp.model_name else []
    keys += [("string", KEY_FITTED_ON, comp.fitted_on)] if comp.fitted_on else []
    keys += [("u32", KEY_TOKENS, comp.tokens)]
    tensors = []
    for li in sorted(comp.layers):
        ly = comp.layers[li]
        tensors += [(DOWN_NAME.format(layer=li), ly.down), (UP_NAME.format(layer=li), ly.up)]
    write_sidecar(path, ARCH, keys, tensors)


def _field_value(path: Path, fields, key: str, kind: str):
    return field_value(path, fields, key, kind, CompensatorError)


def read_compensator(path: str | Path) -> Compensator:
    """Read and validate a sidecar; :class:`CompensatorError` naming ``path`` and the fault."""
    import gguf

    path = Path(path)
    reader = open_sidecar(path, ARCH, CompensatorError)
    fields = reader.fields
    unknown = unknown_keys(fields, ARCH, REQUIRED_KEYS | OPTIONAL_KEYS)
    if unknown:
        raise CompensatorError(f"{path}: unknown key(s) {', '.join(unknown)}")
    v = {k: _field_value(path, fields, k, kind) for k, kind in REQUIRED_KEYS.items()}
    v |= {k: _field_value(path, fields, k, kind) for k, kind in OPTIONAL_KEYS.items() if k in fields}
    n_embd, rank, n_layer = v[KEY_N_EMBD], v[KEY_RANK], v[KEY_N_LAYER]
    _check_header(str(path), n_embd, rank, n_layer, v[KEY_SOURCE], v.get(KEY_TOKENS, 0))
    _check_identity(str(path), v[KEY_MODEL_ARCH], v[KEY_EXPERTS_HASH])

    tensors: dict[tuple[int, str], object] = {}
    for t in reader.tensors:
        m = _TENSOR_RE.fullmatch(t.name)
        if m is None:
            raise CompensatorError(f"{path}: unexpected tensor {t.name!r} (only compensator.{{l}}.down/up)")
        li, kind = int(m.group(1)), m.group(2)
        if li >= n_layer:
            raise CompensatorError(f"{path}: tensor {t.name} is for layer {li}, beyond n_layer={n_layer}")
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise CompensatorError(f"{path}: tensor {t.name} is {t.tensor_type.name}, expected F32")
        want_ne = [n_embd, rank] if kind == "down" else [rank, n_embd]
        ne = [int(n) for n in t.shape]
        if ne != want_ne:
            raise CompensatorError(f"{path}: tensor {t.name} has ggml ne {ne}, expected {want_ne}")
        tensors[(li, kind)] = t
    if not tensors:
        raise CompensatorError(f"{path}: no compensator.{{l}}.down/up tensor")
    layers = {}
    for li in sorted({li for li, _ in tensors}):
        for kind in ("down", "up"):
            if (li, kind) not in tensors:
                raise CompensatorError(f"{path}: layer {li} has no tensor compensator.{li}.{kind}")
        down = np.array(tensors[(li, "down")].data, dtype=np.float32).reshape(rank, n_embd)
        up = np.array(tensors[(li, "up")].data, dtype=np.float32).reshape(n_embd, rank)
        layers[li] = CompensatorLayer(down=down, up=up)
    comp = Compensator(
        n_embd=n_embd,
        rank=rank,
        n_layer=n_layer,
        source=v[KEY_SOURCE],
        model_arch=v[KEY_MODEL_ARCH],
        experts_hash=v[KEY_EXPERTS_HASH],
        model_name=v.get(KEY_MODEL_NAME, ""),
        fitted_on=v.get(KEY_FITTED_ON, ""),
        tokens=v.get(KEY_TOKENS, 0),
        layers=layers,
    )
    comp.validate(str(path))  # finiteness, and the rest once more
    return comp


# --- the model it names ----------------------------------------------------------------------


@dataclass(frozen=True)
class ModelIdentity:
    """What a sidecar fitted on a model GGUF names, and what :func:`check_model` compares."""

    arch: str
    experts_hash: int
    n_embd: int
    n_layer: int  # block_count less nextn_predict_layers (llama.cpp's hparams.n_layer())
    moe_layers: tuple[int, ...]  # layers with a router (blk.{l}.ffn_gate_inp.weight), l < n_layer
    expert_types: tuple[str, ...]  # the ggml type name of each MoE layer's ffn_down_exps (- for none)
    name: str = ""


def model_identity(model_gguf: str | Path) -> ModelIdentity:
    """The identity of a MoE model GGUF (:func:`experts_hash` and the shape the sidecar must have);
    :class:`CompensatorError` for a file that is not a GGUF or has no router."""
    model_gguf = Path(model_gguf)
    fields = (reader := open_gguf(model_gguf, CompensatorError)).fields

    def key(k: str):
        if k not in fields:
            raise CompensatorError(f"{model_gguf}: has no key {k}")
        return fields[k].contents()

    arch = str(key(KEY_ARCH))
    n_layer = int(key(f"{arch}.block_count"))
    if f"{arch}.nextn_predict_layers" in fields:
        n_layer -= int(fields[f"{arch}.nextn_predict_layers"].contents())
    try:
        _, h = router_identity(model_gguf)
    except LearnedError as e:
        raise CompensatorError(str(e)) from e
    types = {t.name: t.tensor_type for t in reader.tensors}
    moe = sorted(li for li in range(n_layer) if f"blk.{li}.ffn_gate_inp.weight" in types)
    for li in moe:
        for role in EXPERT_ROLES:
            t = types.get(f"blk.{li}.ffn_{role}_exps.weight")
            h = fnv1a64((NO_TENSOR if t is None else int(t)).to_bytes(4, "little"), h)
    down = [types.get(f"blk.{li}.ffn_down_exps.weight") for li in moe]
    return ModelIdentity(
        arch=arch,
        experts_hash=h,
        n_embd=int(key(f"{arch}.embedding_length")),
        n_layer=n_layer,
        moe_layers=tuple(moe),
        expert_types=tuple("-" if t is None else t.name for t in down),
        name=str(fields["general.name"].contents()) if "general.name" in fields else "",
    )


def experts_hash(model_gguf: str | Path) -> int:
    """The model's experts hash (:data:`KEY_EXPERTS_HASH`; the module docstring says over what)."""
    return model_identity(model_gguf).experts_hash


def check_model(comp: Compensator, model_gguf: str | Path) -> None:
    """Raise :class:`CompensatorError` unless ``comp`` fits the model GGUF: the model it names
    (architecture and experts hash), n_embd, n_layer, and exactly its MoE layers."""
    ident = model_identity(model_gguf)
    bad = []
    if comp.model_arch != ident.arch:
        bad.append(f"fitted for another model: {KEY_MODEL_ARCH} {comp.model_arch!r} != {ident.arch!r}")
    if comp.experts_hash != ident.experts_hash:
        bad.append(
            f"fitted for other experts: {KEY_EXPERTS_HASH} {comp.experts_hash:016x} != the model's "
            f"{ident.experts_hash:016x} (its experts are {'/'.join(sorted(set(ident.expert_types)))})"
        )
    if comp.n_embd != ident.n_embd:
        bad.append(f"n_embd {comp.n_embd} != {ident.n_embd}")
    if comp.n_layer != ident.n_layer:
        bad.append(f"n_layer {comp.n_layer} != {ident.n_layer}")
    missing = sorted(set(ident.moe_layers) - set(comp.layers))
    extra = sorted(set(comp.layers) - set(ident.moe_layers))
    if missing:
        bad.append(f"missing MoE layer(s) {missing}")
    if extra:
        bad.append(f"layer(s) {extra} are not MoE layers of the model")
    if bad:
        raise CompensatorError(f"compensator does not fit {model_gguf}: {'; '.join(bad)}")


# --- the fit -------------------------------------------------------------------------------


@dataclass
class Moments:
    """One layer's fit data, summed: ``gram = S^T S``, ``cross = S^T R``, ``rr = ||R||^2``,
    ``ref = ||Y_ref||^2`` (the full-precision output's energy, for scale), ``n`` rows."""

    gram: np.ndarray
    cross: np.ndarray
    rr: float = 0.0
    ref: float = 0.0
    n: int = 0

    @classmethod
    def zeros(cls, n_embd: int) -> Moments:
        return cls(np.zeros((n_embd, n_embd)), np.zeros((n_embd, n_embd)))

    def add(self, s: np.ndarray, r: np.ndarray, ref: np.ndarray | None = None) -> None:
        """Add rows: sources ``s`` (N, n_embd), residual targets ``r`` (N, n_embd), reference outputs ``ref``."""
        s, r = np.asarray(s, np.float64), np.asarray(r, np.float64)
        self.gram += s.T @ s
        self.cross += s.T @ r
        self.rr += float(np.sum(r * r))
        self.ref += 0.0 if ref is None else float(np.sum(np.asarray(ref, np.float64) ** 2))
        self.n += len(s)

    def __add__(self, other: Moments) -> Moments:
        return Moments(
            self.gram + other.gram, self.cross + other.cross, self.rr + other.rr, self.ref + other.ref, self.n + other.n
        )

    def residual(self, c: np.ndarray) -> float:
        """``||R - S C^T||^2`` for a map C (n_embd, n_embd): ``rr - 2 tr(C H) + tr(C G C^T)``."""
        c = np.asarray(c, np.float64)
        return float(self.rr - 2.0 * np.sum(c * self.cross.T) + np.sum((c @ self.gram) * c))

    def removed(self, c: np.ndarray) -> float:
        """The fraction of the residual energy that C removes (1: all of it; < 0: it adds error)."""
        return 1.0 - self.residual(c) / self.rr if self.rr > 0 else 0.0


def fit_layers(m: Moments, ranks: Sequence[int], ridge: float = 0.0) -> dict[int, CompensatorLayer]:
    """The best map of each rank in ``ranks`` for the data in ``m`` (the module docstring says how),
    with the relative ridge ``ridge`` (lam = ridge * trace(G) / n_embd)."""
    n = m.gram.shape[0]
    bad = [r for r in ranks if not 1 <= r <= n]
    if bad:
        raise ValueError(f"fit_layers: rank(s) {bad} out of range 1..{n}")
    g, q = np.linalg.eigh(m.gram)
    g = g + ridge * float(np.trace(m.gram)) / n
    keep = g > max(float(g.max()), 0.0) * n * np.finfo(np.float64).eps  # a pseudo-inverse where S is rank-deficient
    inv = np.where(keep, 1.0 / np.where(keep, g, 1.0), 0.0)
    b = q @ (inv[:, None] * (q.T @ m.cross))  # (G + lam I)^-1 H: C = B^T
    fitted = m.cross.T @ b  # B^T (G + lam I) B
    _, v = np.linalg.eigh((fitted + fitted.T) / 2)
    v = v[:, ::-1]
    out = {}
    for r in ranks:
        vr = v[:, :r]
        out[r] = CompensatorLayer(
            down=np.ascontiguousarray((b @ vr).T, np.float32), up=np.ascontiguousarray(vr, np.float32)
        )
    return out


def fit_layer(m: Moments, rank: int, ridge: float = 0.0) -> CompensatorLayer:
    """The best rank-``rank`` map for the data in ``m`` (:func:`fit_layers`)."""
    return fit_layers(m, [rank], ridge)[rank]


@dataclass(frozen=True)
class FitScore:
    """One (layer, source, rank) fit: its ridge (chosen on the tuning split) and the residual energy
    removed on the training capture and on held-out text; ``baseline`` = held-out ``||R||^2 / ||Y_ref||^2``."""

    layer: int
    source: str
    rank: int
    ridge: float
    train_removed: float
    heldout_removed: float
    baseline: float


def sweep(
    fit_part: Mapping[tuple[str, int], Moments],
    tune_part: Mapping[tuple[str, int], Moments],
    heldout: Mapping[tuple[str, int], Moments],
    ranks: Sequence[int],
    ridges: Sequence[float] = RIDGES,
) -> tuple[list[FitScore], dict[tuple[str, int, int], CompensatorLayer]]:
    """Fit every (source, layer) of the moments at every rank: the ridge that removes the most of
    ``tune_part``'s residual when fitted on ``fit_part``, then refitted on both and scored on
    ``heldout``. Returns the scores and the fitted layers, keyed (source, layer, rank)."""
    scores, fitted = [], {}
    for source, li in sorted(fit_part):
        m_fit, m_tune, m_val = fit_part[source, li], tune_part[source, li], heldout[source, li]
        m_all = m_fit + m_tune
        tuned = {a: fit_layers(m_fit, ranks, a) for a in ridges}
        best = {r: max(ridges, key=lambda a, r=r: m_tune.removed(tuned[a][r].matrix)) for r in ranks}
        final = {a: fit_layers(m_all, [r for r in ranks if best[r] == a], a) for a in set(best.values())}
        base = m_val.rr / m_val.ref if m_val.ref > 0 else float("nan")
        for rank in ranks:
            ly = final[best[rank]][rank]
            c = ly.matrix
            scores.append(FitScore(li, source, rank, best[rank], m_all.removed(c), m_val.removed(c), base))
            fitted[source, li, rank] = ly
    return scores, fitted


def total_removed(heldout: Mapping[tuple[str, int], Moments], scores: Sequence[FitScore], source: str, rank: int):
    """The held-out residual energy removed over all layers together (energy-weighted), or None."""
    rows = [s for s in scores if s.source == source and s.rank == rank]
    if not rows:
        return None
    rr = sum(heldout[source, s.layer].rr for s in rows)
    return sum(s.heldout_removed * heldout[source, s.layer].rr for s in rows) / rr if rr > 0 else 0.0


def choose(
    heldout: Mapping[tuple[str, int], Moments], scores: Sequence[FitScore], source: str | None, rank: int | None
) -> tuple[str, int]:
    """The (source, rank) to write: those given, else the ones that remove the most held-out residual
    energy over all layers (:func:`total_removed`); a tie keeps the input source and the lower rank."""
    sources = [source] if source else list(SOURCES)
    ranks = [rank] if rank else sorted({s.rank for s in scores})
    best = max(
        ((s, r) for s in sources for r in ranks),
        key=lambda sr: (total_removed(heldout, scores, *sr) or 0.0, -SOURCES.index(sr[0]), -sr[1]),
    )
    return best
