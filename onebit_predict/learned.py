"""The learned lookahead predictor: its sidecar file, the loss that trains it, and its scores.

What it is for. ``router`` mode with ``ONEBIT_MOE_PREDICT_AHEAD=K`` ranks layer l's experts by
applying layer l's own router (``ffn_gate_inp``) to the FFN input of layer l-K, K layers before
layer l runs, so that its expert reads can start early. That router was trained to read layer
l's FFN input, not layer l-K's. The learned predictor keeps the same shape and cost (one
``n_expert x n_embd`` matrix-vector product per predicted layer, plus a bias) and fits the
weights to the job: for each predicted layer l,

    logits_l = W_l x_{l-K} + b_l

where ``x_{l-K}`` is the FFN input (the MoE block's input, after the post-attention norm) of
layer l-K for the same token. ``W_l`` starts as layer l's router weight and ``b_l`` at zero
(so the untrained predictor *is* ``router`` mode), then Adam minimises the listwise loss
:func:`listwise_loss`: the mean over the ``n_expert_used`` experts layer l really selected of
``-log softmax(logits_l)``. ``tools/train_learned.py`` captures the training pairs from a
transformers model and writes the files; docs/learned.md has the commands and the figures.

The sidecar file (what llama.cpp's side reads, exactly): a GGUF file with

- ``general.architecture = "onebit_learned"``;
- ``onebit_learned.ahead`` (u32, K in 1..3: the same K for every layer of the file),
  ``onebit_learned.n_embd`` (u32), ``onebit_learned.n_expert`` (u32),
  ``onebit_learned.model_name`` (string: the ``general.name`` of the model's GGUF),
  ``onebit_learned.trained_on`` (string: ``"generation"`` or ``"chunks"``),
  ``onebit_learned.tokens`` (u32: the training tokens);
- the model it was trained on, which llama.cpp's side checks before it predicts (a sidecar of
  another model with the same shapes would otherwise predict silently and badly):
  ``onebit_learned.model.architecture`` (string: the model GGUF's ``general.architecture``) and
  ``onebit_learned.model.router_hash`` (u64: :func:`model_identity`, FNV-1a 64 over expert 0's
  router row, as little-endian float32, of every MoE layer in layer order);
- for every predicted layer l from K to n_layer-1 (l is the PREDICTED layer, its input is
  layer l-K's FFN input): ``learned.{l}.weight``, F32, numpy shape ``(n_expert, n_embd)``
  (ggml ``ne0 = n_embd, ne1 = n_expert``, as ``blk.{l}.ffn_gate_inp.weight``) and
  ``learned.{l}.bias``, F32, numpy shape ``(n_expert,)``; no other tensor.

:func:`read_learned` checks all of this (and that every value is finite, and that each layer's
``||W_l||_F`` and ``max|b_l|``, float64, are at most SIDECAR_MAX_GAIN = 65504, F16's largest value,
as the C++ loader does: sidecar.check_gain) and raises
:class:`LearnedError` naming the file and the fault; :func:`check_model` checks a sidecar
against the model GGUF it is meant for; :func:`stamp` rewrites a sidecar with a model's
identity, values unchanged (``onebit-learned stamp SIDECAR MODEL``).

Everything here needs numpy and gguf-py only; the training step is numpy too (Adam on the
analytic gradient), so the tests run without torch. Capturing the training pairs needs torch
and transformers (``tools/train_learned.py``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .sidecar import (
    KEY_ARCH,
    U32_MAX,
    U64_MAX,
    check_f32_array,
    check_gain,
    check_identity,
    field_value,
    frobenius,
    is_uint,
    open_sidecar,
    unknown_keys,
    write_sidecar,
)

ARCH = "onebit_learned"
KEY_AHEAD = f"{ARCH}.ahead"
KEY_N_EMBD = f"{ARCH}.n_embd"
KEY_N_EXPERT = f"{ARCH}.n_expert"
KEY_MODEL_NAME = f"{ARCH}.model_name"
KEY_TRAINED_ON = f"{ARCH}.trained_on"
KEY_TOKENS = f"{ARCH}.tokens"
KEY_MODEL_ARCH = f"{ARCH}.model.architecture"  # string: the model GGUF's general.architecture
KEY_ROUTER_HASH = f"{ARCH}.model.router_hash"  # u64: model_identity()'s hash
U32_KEYS = (KEY_AHEAD, KEY_N_EMBD, KEY_N_EXPERT, KEY_TOKENS)
STRING_KEYS = (KEY_MODEL_NAME, KEY_TRAINED_ON)
IDENTITY_KEYS = (KEY_MODEL_ARCH, KEY_ROUTER_HASH)

WEIGHT_NAME = "learned.{layer}.weight"  # F32, numpy (n_expert, n_embd)
BIAS_NAME = "learned.{layer}.bias"  # F32, numpy (n_expert,)
_TENSOR_RE = re.compile(r"learned\.(0|[1-9][0-9]*)\.(weight|bias)")

MIN_AHEAD, MAX_AHEAD = 1, 3  # as ONEBIT_MOE_PREDICT_AHEAD
TRAINED_ON = ("generation", "chunks")
FNV64_OFFSET = 0xCBF29CE484222325
FNV64_PRIME = 0x100000001B3
_ROUTER_RE = re.compile(r"blk\.(0|[1-9][0-9]*)\.ffn_gate_inp\.weight")


class LearnedError(ValueError):
    """A sidecar file (or a predictor about to be written) that is not what this module defines."""


@dataclass(frozen=True)
class LearnedLayer:
    """One predicted layer: ``logits = weight @ x + bias`` (weight (n_expert, n_embd), bias (n_expert,))."""

    weight: np.ndarray
    bias: np.ndarray


@dataclass(frozen=True)
class LearnedPredictor:
    """A whole sidecar: the keys and, per predicted layer l (K..n_layer-1), its weights."""

    ahead: int
    n_embd: int
    n_expert: int
    model_name: str
    trained_on: str
    tokens: int
    model_arch: str  # the model's general.architecture (KEY_MODEL_ARCH)
    router_hash: int  # model_identity()'s hash of the model (KEY_ROUTER_HASH), u64
    layers: Mapping[int, LearnedLayer] = field(default_factory=dict)

    @property
    def n_layer(self) -> int:
        """The model's layer count as the file implies it: the last predicted layer + 1."""
        return max(self.layers) + 1

    def logits(self, layer: int, x: np.ndarray) -> np.ndarray:
        """Layer ``layer``'s predicted logits from layer ``layer - ahead``'s FFN inputs ``x`` (..., n_embd)."""
        ly = self.layers[layer]
        return np.asarray(x, dtype=np.float32) @ ly.weight.T + ly.bias

    def validate(self, where: str = "predictor") -> None:
        """Raise :class:`LearnedError` unless this predictor can be written as a valid sidecar."""
        _check_header(where, self.ahead, self.n_embd, self.n_expert, self.model_name, self.trained_on, self.tokens)
        _check_identity(where, self.model_arch, self.router_hash)
        if not self.layers:
            raise LearnedError(f"{where}: no predicted layer")
        want = list(range(self.ahead, max(self.layers) + 1))
        if sorted(self.layers) != want:
            raise LearnedError(
                f"{where}: predicted layers {sorted(self.layers)} are not every layer from "
                f"ahead={self.ahead} to the last ({want})"
            )
        for li in want:
            ly = self.layers[li]
            _check_array(where, WEIGHT_NAME.format(layer=li), ly.weight, (self.n_expert, self.n_embd))
            _check_array(where, BIAS_NAME.format(layer=li), ly.bias, (self.n_expert,))
            check_gain(where, li, "the map's gain bound ||W||", frobenius(ly.weight), LearnedError)
            bias = float(np.max(np.abs(ly.bias.astype(np.float64))))
            check_gain(where, li, "the bias bound max|b|", bias, LearnedError)


def _check_header(where: str, ahead, n_embd, n_expert, model_name, trained_on, tokens) -> None:
    for key, v in ((KEY_AHEAD, ahead), (KEY_N_EMBD, n_embd), (KEY_N_EXPERT, n_expert), (KEY_TOKENS, tokens)):
        if not is_uint(v, U32_MAX):
            raise LearnedError(f"{where}: {key} = {v!r} is not a u32")
    if not MIN_AHEAD <= int(ahead) <= MAX_AHEAD:
        raise LearnedError(f"{where}: {KEY_AHEAD} = {ahead} is out of range {MIN_AHEAD}..{MAX_AHEAD}")
    if int(n_embd) < 1:
        raise LearnedError(f"{where}: {KEY_N_EMBD} = 0")
    if int(n_expert) < 2:
        raise LearnedError(f"{where}: {KEY_N_EXPERT} = {n_expert}: a MoE layer has at least 2 experts")
    if not isinstance(model_name, str) or not model_name:
        raise LearnedError(f"{where}: {KEY_MODEL_NAME} is empty or not a string")
    if trained_on not in TRAINED_ON:
        raise LearnedError(f"{where}: {KEY_TRAINED_ON} = {trained_on!r} is not one of {', '.join(TRAINED_ON)}")


def _check_identity(where: str, model_arch, router_hash) -> None:
    check_identity(where, KEY_MODEL_ARCH, model_arch, KEY_ROUTER_HASH, router_hash, LearnedError)


def _check_array(where: str, name: str, arr, shape: tuple[int, ...]) -> None:
    check_f32_array(where, name, arr, shape, LearnedError)


# --- the file -------------------------------------------------------------------------------


def write_learned(path: str | Path, pred: LearnedPredictor) -> None:
    """Write ``pred`` as a sidecar GGUF at ``path`` (validated first: :class:`LearnedError`), whole or
    not at all (sidecar.write_sidecar)."""
    path = Path(path)
    pred.validate(str(path))
    keys = [("u32", KEY_AHEAD, pred.ahead), ("u32", KEY_N_EMBD, pred.n_embd), ("u32", KEY_N_EXPERT, pred.n_expert)]
    keys += [("string", KEY_MODEL_NAME, pred.model_name), ("string", KEY_TRAINED_ON, pred.trained_on)]
    keys += [("u32", KEY_TOKENS, pred.tokens), ("string", KEY_MODEL_ARCH, pred.model_arch)]
    keys += [("u64", KEY_ROUTER_HASH, pred.router_hash)]
    tensors = []
    for li in sorted(pred.layers):
        ly = pred.layers[li]
        tensors += [(WEIGHT_NAME.format(layer=li), ly.weight), (BIAS_NAME.format(layer=li), ly.bias)]
    write_sidecar(path, ARCH, keys, tensors)


def _field_value(path: Path, fields, key: str, kind: str):
    return field_value(path, fields, key, kind, LearnedError)


def _read_identity(path: Path, fields, need_identity: bool) -> tuple[str, int]:
    missing = [k for k in IDENTITY_KEYS if k not in fields]
    if missing and need_identity:
        raise LearnedError(
            f"{path}: the sidecar names no model (key(s) {', '.join(missing)} missing), and llama.cpp refuses it: "
            "train it again (tools/train_learned.py) or stamp it with the model it was trained on "
            "(onebit-learned stamp SIDECAR MODEL.gguf)"
        )
    if missing:
        return "", -1
    model_arch = _field_value(path, fields, KEY_MODEL_ARCH, "string")
    router_hash = _field_value(path, fields, KEY_ROUTER_HASH, "u64")
    _check_identity(str(path), model_arch, router_hash)
    return model_arch, router_hash


def read_learned(path: str | Path) -> LearnedPredictor:
    """Read and validate a sidecar; :class:`LearnedError` (naming ``path`` and the fault) on a bad file,
    one that names no model (:data:`KEY_MODEL_ARCH`, :data:`KEY_ROUTER_HASH`) included."""
    return _read(Path(path), need_identity=True)


def _read(path: Path, need_identity: bool) -> LearnedPredictor:
    """:func:`read_learned`; with ``need_identity`` False (:func:`stamp` only) a sidecar that names no
    model reads with ``model_arch`` "" and ``router_hash`` -1 (and so cannot be written as it is)."""
    import gguf

    reader = open_sidecar(path, ARCH, LearnedError)
    fields = reader.fields
    unknown = unknown_keys(fields, ARCH, U32_KEYS + STRING_KEYS + IDENTITY_KEYS)
    if unknown:
        raise LearnedError(f"{path}: unknown key(s) {', '.join(unknown)}")
    vals = {k: _field_value(path, fields, k, "u32") for k in U32_KEYS}
    vals |= {k: _field_value(path, fields, k, "string") for k in STRING_KEYS}
    ahead, n_embd, n_expert = vals[KEY_AHEAD], vals[KEY_N_EMBD], vals[KEY_N_EXPERT]
    _check_header(str(path), ahead, n_embd, n_expert, vals[KEY_MODEL_NAME], vals[KEY_TRAINED_ON], vals[KEY_TOKENS])
    model_arch, router_hash = _read_identity(path, fields, need_identity)

    tensors: dict[tuple[int, str], object] = {}
    for t in reader.tensors:
        m = _TENSOR_RE.fullmatch(t.name)
        if m is None:
            raise LearnedError(f"{path}: unexpected tensor {t.name!r} (only learned.{{l}}.weight/bias)")
        li, kind = int(m.group(1)), m.group(2)
        if li < ahead:
            raise LearnedError(f"{path}: tensor {t.name} is for layer {li} < ahead={ahead}, which is never predicted")
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            raise LearnedError(f"{path}: tensor {t.name} is {t.tensor_type.name}, expected F32")
        want_ne = [n_embd, n_expert] if kind == "weight" else [n_expert]
        ne = [int(n) for n in t.shape]
        if ne != want_ne:
            raise LearnedError(f"{path}: tensor {t.name} has ggml ne {ne}, expected {want_ne}")
        tensors[(li, kind)] = t
    if not tensors:
        raise LearnedError(f"{path}: no learned.{{l}}.weight/bias tensor")
    last = max(li for li, _ in tensors)
    layers = {}
    for li in range(ahead, last + 1):
        for kind in ("weight", "bias"):
            if (li, kind) not in tensors:
                raise LearnedError(f"{path}: tensor learned.{li}.{kind} is missing (layers {ahead}..{last})")
        wt = np.array(tensors[(li, "weight")].data, dtype=np.float32).reshape(n_expert, n_embd)
        bs = np.array(tensors[(li, "bias")].data, dtype=np.float32).reshape(n_expert)
        layers[li] = LearnedLayer(weight=wt, bias=bs)
    pred = LearnedPredictor(
        ahead=ahead,
        n_embd=n_embd,
        n_expert=n_expert,
        model_name=vals[KEY_MODEL_NAME],
        trained_on=vals[KEY_TRAINED_ON],
        tokens=vals[KEY_TOKENS],
        model_arch=model_arch,
        router_hash=router_hash,
        layers=layers,
    )
    # finiteness (and the rest once more); a sidecar read for stamp() names no model yet
    checked = pred if need_identity else dataclasses.replace(pred, model_arch="-", router_hash=0)
    checked.validate(str(path))
    return pred


def fnv1a64(data: bytes, h: int = FNV64_OFFSET) -> int:
    """FNV-1a 64 of ``data``, continuing from ``h`` (the offset basis for a fresh hash)."""
    for b in data:
        h = ((h ^ b) * FNV64_PRIME) & U64_MAX
    return h


def model_identity(model_gguf: str | Path) -> tuple[str, int]:
    """(general.architecture, router hash) of a model GGUF: what a sidecar trained on it names
    (:data:`KEY_MODEL_ARCH`, :data:`KEY_ROUTER_HASH`) and what llama.cpp's side compares.

    The hash is FNV-1a 64 over the bytes (little-endian float32) of expert 0's router row of
    every MoE layer in layer order: row 0 (n_embd values) of each ``blk.{l}.ffn_gate_inp.weight``,
    converted to float32 (exact for F32, F16 and BF16; ``gguf.quants.dequantize`` otherwise, as
    ggml's ``to_float``). Layers are those llama.cpp's ``hparams.n_layer()`` counts: ``block_count``
    less ``nextn_predict_layers`` (the MTP layers, absent for most models). :class:`LearnedError`
    for a file that is not a GGUF, or one without a router.
    """
    import gguf

    model_gguf = Path(model_gguf)
    try:
        reader = gguf.GGUFReader(model_gguf)
    except (OSError, ValueError, KeyError, IndexError, EOFError) as e:
        raise LearnedError(f"{model_gguf}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    fields = reader.fields
    if KEY_ARCH not in fields:
        raise LearnedError(f"{model_gguf}: has no key {KEY_ARCH}")
    arch = str(fields[KEY_ARCH].contents())
    n_layer = None
    if f"{arch}.block_count" in fields:
        n_layer = int(fields[f"{arch}.block_count"].contents())
        if f"{arch}.nextn_predict_layers" in fields:
            n_layer -= int(fields[f"{arch}.nextn_predict_layers"].contents())
    routers = {}
    for t in reader.tensors:
        m = _ROUTER_RE.fullmatch(t.name)
        if m is not None and (n_layer is None or int(m.group(1)) < n_layer):
            routers[int(m.group(1))] = t
    if not routers:
        raise LearnedError(f"{model_gguf}: no blk.{{l}}.ffn_gate_inp.weight (a router): not a MoE model")
    h = FNV64_OFFSET
    for li in sorted(routers):
        h = fnv1a64(_expert0_row(model_gguf, routers[li]).tobytes(), h)
    return arch, h


def _expert0_row(model_gguf: Path, t) -> np.ndarray:
    """Row 0 (expert 0) of a gguf-py ReaderTensor of ggml ne [n_embd, n_expert], as little-endian float32."""
    import gguf
    from gguf import quants

    n_embd = int(t.shape[0])
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        row = np.asarray(t.data).reshape(-1)[:n_embd]
    else:  # gguf-py hands these over as bytes, (n_expert, bytes per row)
        n_rows = int(np.prod([int(n) for n in t.shape[1:]], dtype=np.int64))
        raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(n_rows, -1)[0]
        try:
            row = quants.dequantize(raw, t.tensor_type).reshape(-1)
        except (NotImplementedError, ValueError, quants.QuantError) as e:
            raise LearnedError(f"{model_gguf}: {t.name} is {t.tensor_type.name}, which is not read as float") from e
    row = np.asarray(row, dtype="<f4")
    if row.shape != (n_embd,):
        raise LearnedError(f"{model_gguf}: {t.name}: expert 0's row has {row.size} values, expected {n_embd}")
    return row


def check_model(pred: LearnedPredictor, model_gguf: str | Path) -> None:
    """Raise :class:`LearnedError` unless ``pred`` fits the model GGUF: the model it names (architecture and
    router hash, :func:`model_identity`), name, n_embd, expert count, layers."""
    import gguf

    model_gguf = Path(model_gguf)
    f = gguf.GGUFReader(model_gguf).fields

    def val(key: str):
        if key not in f:
            raise LearnedError(f"{model_gguf}: has no key {key}")
        return f[key].contents()

    arch = val(KEY_ARCH)
    want = {
        "model_name": val("general.name"),
        "n_embd": int(val(f"{arch}.embedding_length")),
        "n_expert": int(val(f"{arch}.expert_count")),
        "n_layer": int(val(f"{arch}.block_count")),
    }
    have = {"model_name": pred.model_name, "n_embd": pred.n_embd, "n_expert": pred.n_expert, "n_layer": pred.n_layer}
    m_arch, m_hash = model_identity(model_gguf)
    bad = []
    if pred.model_arch != m_arch:
        bad.append(f"trained on another model: {KEY_MODEL_ARCH} {pred.model_arch!r} != {m_arch!r}")
    if pred.router_hash != m_hash:
        bad.append(f"trained on another model: {KEY_ROUTER_HASH} {_hex(pred.router_hash)} != {_hex(m_hash)}")
    bad += [f"{k} {have[k]!r} != {want[k]!r}" for k in want if have[k] != want[k]]
    if bad:
        raise LearnedError(f"sidecar does not fit {model_gguf}: {'; '.join(bad)}")


def _hex(h: int) -> str:
    return f"{h:016x}" if 0 <= h <= U64_MAX else repr(h)  # as llama.cpp's log prints it


def stamp(sidecar: str | Path, model_gguf: str | Path, out: str | Path | None = None) -> LearnedPredictor:
    """Rewrite ``sidecar`` at ``out`` (default: in place, atomically) naming ``model_gguf``
    (:func:`model_identity`), every other key and every value unchanged; for a sidecar written
    before the identity keys, or one whose model was re-exported. Refused (:class:`LearnedError`)
    unless the sidecar then fits the model (:func:`check_model`: name, n_embd, experts, layers)."""
    sidecar = Path(sidecar)
    pred = _read(sidecar, need_identity=False)
    arch, h = model_identity(model_gguf)
    pred = dataclasses.replace(pred, model_arch=arch, router_hash=h)
    check_model(pred, model_gguf)
    write_learned(sidecar if out is None else Path(out), pred)
    return pred


# --- the loss and the training step (numpy) ----------------------------------------------------


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def listwise_loss(logits: np.ndarray, actual: np.ndarray) -> float:
    """Mean over rows and over each row's k actual experts of ``-log softmax(logits)[expert]``.

    ``logits`` (N, n_expert), ``actual`` (N, k) expert ids (the set layer l really used).
    """
    ls = _log_softmax(np.asarray(logits, dtype=np.float64))
    return float(-np.take_along_axis(ls, np.asarray(actual, dtype=np.int64), axis=1).mean())


def listwise_grad(
    weight: np.ndarray, bias: np.ndarray, x: np.ndarray, actual: np.ndarray
) -> tuple[float, np.ndarray, np.ndarray]:
    """(loss, dloss/dweight, dloss/dbias) of :func:`listwise_loss` for ``logits = x @ weight.T + bias``.

    With p = softmax(logits) and y = 1/k on the k actual experts (0 elsewhere), the gradient
    of a row's loss wrt its logits is ``p - y``; the loss is the mean over the N rows.
    """
    x = np.asarray(x, dtype=np.float32)
    n, k = actual.shape
    z = x @ weight.T + bias
    ls = _log_softmax(z.astype(np.float64))
    loss = float(-np.take_along_axis(ls, actual.astype(np.int64), axis=1).mean())
    g = np.exp(ls)
    np.add.at(g, (np.repeat(np.arange(n), k), actual.reshape(-1).astype(np.int64)), -1.0 / k)
    g = (g / n).astype(np.float32)
    return loss, g.T @ x, g.sum(axis=0)


@dataclass
class TrainResult:
    weight: np.ndarray
    bias: np.ndarray
    loss_before: float
    loss_after: float
    steps: int


def train_layer(
    x: np.ndarray,
    actual: np.ndarray,
    weight0: np.ndarray,
    bias0: np.ndarray | None = None,
    *,
    epochs: int = 4,
    lr: float = 2e-3,
    batch: int = 256,
    seed: int = 0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
) -> TrainResult:
    """Fit ``logits = x @ W.T + b`` to the actual sets with Adam on :func:`listwise_loss`.

    ``x`` (N, n_embd) float32 inputs, ``actual`` (N, k) expert ids, ``weight0`` (n_expert,
    n_embd) the start (layer l's router), ``bias0`` the start of the bias (zero when None).
    Shuffled minibatches (numpy ``default_rng(seed)``), ``epochs`` passes; deterministic.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    actual = np.ascontiguousarray(actual)
    w = np.array(weight0, dtype=np.float32)
    b = np.zeros(w.shape[0], np.float32) if bias0 is None else np.array(bias0, dtype=np.float32)
    if x.ndim != 2 or actual.ndim != 2 or len(x) != len(actual) or x.shape[1] != w.shape[1]:
        raise ValueError(f"train_layer: shapes x {x.shape}, actual {actual.shape}, weight {w.shape} do not fit")
    loss_before = listwise_loss(x @ w.T + b, actual)
    rng = np.random.default_rng(seed)
    m = [np.zeros_like(w), np.zeros_like(b)]
    v = [np.zeros_like(w), np.zeros_like(b)]
    b1, b2 = betas
    t = 0
    for _ in range(epochs):
        order = rng.permutation(len(x))
        for s in range(0, len(x), batch):
            idx = order[s : s + batch]
            _, gw, gb = listwise_grad(w, b, x[idx], actual[idx])
            t += 1
            for i, (p, g) in enumerate(((w, gw), (b, gb))):
                m[i] = b1 * m[i] + (1 - b1) * g
                v[i] = b2 * v[i] + (1 - b2) * g * g
                step = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
                p -= (step * m[i] / (np.sqrt(v[i]) + eps)).astype(np.float32)
    return TrainResult(w, b, loss_before, listwise_loss(x @ w.T + b, actual), t)


# --- scores ------------------------------------------------------------------------------------


def recall_hits(logits: np.ndarray, actual: np.ndarray, depth: int) -> int:
    """How many of the actual experts (N, k) are among each row's ``depth`` best logits (N, n_expert).

    Read recall at ``depth`` = this / ``actual.size`` (micro-averaged, as onebit-stats).
    Ties rank the lower expert id first (a stable sort of the negated logits).
    """
    top = np.argsort(-np.asarray(logits), axis=1, kind="stable")[:, :depth]
    return int((top[:, :, None] == np.asarray(actual)[:, None, :]).any(axis=1).sum())


def prev_token_hits(actual: np.ndarray, scored: np.ndarray) -> int:
    """The previous-token baseline's hits: ``actual`` (n_seq, T, k) of one layer, ``scored`` (n_seq, T)
    bool, the rows scored (never position 0): how many of each scored row's experts the row before used."""
    scored = np.asarray(scored, dtype=bool)
    if scored.shape != actual.shape[:2]:
        raise ValueError(f"prev_token_hits: scored {scored.shape} does not fit actual {actual.shape}")
    if scored[:, 0].any():
        raise ValueError("prev_token_hits: position 0 has no previous token")
    cur, prev = actual[:, 1:][scored[:, 1:]], actual[:, :-1][scored[:, 1:]]
    return int((cur[:, :, None] == prev[:, None, :]).any(axis=-1).sum())
