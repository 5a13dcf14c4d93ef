"""Capture a MoE model's per-layer activations from llama.cpp runs, and the compensator's fit data.

What it is for. The compensator (compensator.py) is fitted on what llama.cpp computes with the
2-bit experts: per MoE layer l, the MoE block's input ``ffn_norm-{l}`` (x, the normed FFN input),
its output ``ffn_moe_out-{l}`` (y) and its routing (``ffn_moe_topk-{l}``, the chosen experts, and
``ffn_moe_weights_norm-{l}``, their weights). :class:`Capturer` runs token windows through the
patched libllama (llama/runner.py) with the scheduler's eval callback
(``llama_context_params.cb_eval``): asked (``ask`` true) whether it wants a tensor, it says yes for
those names only; called again once the tensor is computed, it copies the data out with
``ggml_backend_tensor_get`` (libggml-base, next to the libllama loaded). Type and shape come from
the head of ``struct ggml_tensor`` (ggml/include/ggml.h: ``type`` int32 at offset 0, ``ne``
int64[4] at 16, ``nb`` size_t[4] at 48), cross-checked against ``ggml_nelements``. Every row is
an output (so the last layer's FFN is not cut to the output rows), one window is one ubatch, and
every predictor knob is off; a compensator sidecar, when given, is applied by llama.cpp itself
(ONEBIT_MOE_COMPENSATOR), and ``ffn_moe_out`` is then the corrected output.

Text: the corpus the tiny byte-level models were trained on (models/README.md; the split of
tools/train_tiny.py): the CPython stdlib sources, token id = byte, 256 = end of file, and a file
is validation text when ``int(sha1(relpath), 16) % 20 == 0``. The fit reads training text only;
held-out scores read validation text only. Windows are evenly spaced, ``WINDOW`` tokens long.
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..constants import ENV_COMPENSATOR
from ..corpus import EOD, corpus_files, is_validation, stdlib_root
from .compensator import SOURCE_INPUT, SOURCE_OUTPUT, Moments
from .moe_numpy import MoeModel, moe_forward, relative_error, route

WINDOW = 256  # tokens per window: the tiny models' training context
CAPTURED = ("ffn_norm", "ffn_moe_out", "ffn_moe_topk", "ffn_moe_weights_norm")
_NAME_RE = re.compile(r"(" + "|".join(CAPTURED) + r")-(0|[1-9][0-9]*)")
GGML_TYPE_F32, GGML_TYPE_I32 = 0, 26  # ggml_type (gguf-py GGMLQuantizationType)
_DTYPES = {GGML_TYPE_F32: np.float32, GGML_TYPE_I32: np.int32}


class CaptureError(ValueError):
    """A run whose activations are not what this module reads."""


# --- the text --------------------------------------------------------------------------------


def corpus_streams(root: Path | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(training, validation) token streams of the corpus (onebit_predict/corpus.py): its files' bytes
    in sorted relative-path order, each followed by ``EOD``, as int32."""
    files = corpus_files(root)
    if not files:
        raise CaptureError(f"{root or stdlib_root()}: no *.py sources (the CPython stdlib) to read text from")
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    for rel, path in files:
        parts[is_validation(rel)] += [np.frombuffer(path.read_bytes(), np.uint8).astype(np.int32), np.array([EOD])]
    return np.concatenate(parts[False]), np.concatenate(parts[True])


def windows(stream: np.ndarray, n: int, length: int = WINDOW) -> list[np.ndarray]:
    """``n`` evenly spaced windows of ``length`` tokens of ``stream`` (the first at 0)."""
    if n < 1 or len(stream) < length + n:
        raise ValueError(f"windows: {n} windows of {length} tokens from a stream of {len(stream)}")
    step = (len(stream) - length) // n
    return [np.asarray(stream[i * step : i * step + length]) for i in range(n)]


# --- the capture ------------------------------------------------------------------------------


class _TensorHead(ctypes.Structure):
    """The head of ``struct ggml_tensor``: type (int32 at 0), buffer, ne (int64[4] at 16), nb (size_t[4] at 48)."""

    _fields_ = [
        ("type", ctypes.c_int32),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
    ]


def _ggml_base(lib_dir: Path) -> ctypes.CDLL:
    """libggml-base of ``lib_dir``, its functions typed."""
    g = ctypes.CDLL(str(lib_dir / "libggml-base.so"))
    p, size = ctypes.c_void_p, ctypes.c_size_t
    for name, res, args in (
        ("ggml_get_name", ctypes.c_char_p, [p]),
        ("ggml_nbytes", size, [p]),
        ("ggml_nelements", ctypes.c_int64, [p]),
        ("ggml_backend_tensor_get", None, [p, p, size, size]),
        ("ggml_backend_tensor_set", None, [p, p, size, size]),
    ):
        fn = getattr(g, name)
        fn.restype, fn.argtypes = res, args
    return g


@dataclass(frozen=True)
class LayerActivations:
    """One layer's captured rows: x and y (N, n_embd) float32, llama.cpp's routing (N, k) or None."""

    x: np.ndarray
    y: np.ndarray
    experts: np.ndarray | None
    weights: np.ndarray | None


@dataclass(frozen=True)
class Capture:
    """A run's activations per MoE layer, and its next-token loss: ``nll`` summed over ``n_predicted``."""

    layers: Mapping[int, LayerActivations]
    n_tokens: int
    nll: float
    n_predicted: int


Replace = Callable[[int, LayerActivations], "np.ndarray | None"]
"""``(layer, that layer's captured input, output and routing) -> the output to use instead, or None``."""


class Capturer:
    """A model loaded with a context whose eval callback captures :data:`CAPTURED` (a context manager).

    ``compensator``, when given, is the patched build's own compensator (ONEBIT_MOE_COMPENSATOR): the
    graph adds it, and ``ffn_moe_out-{l}`` is then the corrected output. Every other knob is off.

    ``replace``, when given, is asked for each layer's MoE output once it is computed (its input and
    routing were computed before it, so they are at hand); an array it returns is written into the
    graph's ``ffn_moe_out-{l}`` with ``ggml_backend_tensor_set`` before the next node reads it (the
    scheduler computes no node after the one its callback is called for until the callback returns),
    so the rest of the forward pass runs on it. The capture keeps what the graph computed, not the
    replacement. It is how onebit-int2 blame puts one layer's full-precision output into a 2-bit model.
    """

    def __init__(
        self, model_path: Path, threads: int = 1, compensator: Path | None = None, replace: Replace | None = None
    ) -> None:
        from ..llama.moe_api import FIELDS
        from ..llama.runner import Context, ContextSettings, Model, llama

        lib = llama()
        self._g = _ggml_base(Path(lib.llama_cpp._lib._name).parent)
        self._error: BaseException | None = None
        self._got: dict[tuple[str, int], np.ndarray] = {}
        self._replace = replace
        self.replaced = 0  # layers' outputs replaced since the context was made
        self.last_logprobs: np.ndarray | None = None  # run()'s last window's (T, n_vocab)
        self.model = Model(Path(model_path))
        settings = ContextSettings(n_ctx=WINDOW, n_batch=WINDOW, n_ubatch=WINDOW, n_threads=threads)
        self._cb = lib.ggml_backend_sched_eval_callback(self._callback)
        try:
            off = {env: None for _, env in FIELDS}  # every predictor knob at its default: off, whatever the environment
            if compensator is not None:
                off[ENV_COMPENSATOR] = str(compensator)
            self.ctx = Context(self.model, settings, off, cb_eval=self._cb)
        except BaseException:
            self.model.close()
            raise

    def _read(self, t: int) -> np.ndarray:
        head = _TensorHead.from_address(t)
        ne, nb = [int(n) for n in head.ne], [int(n) for n in head.nb]
        dtype = _DTYPES.get(int(head.type))
        if dtype is None or nb[0] != np.dtype(dtype).itemsize or any(n != 1 for n in ne[2:]):
            raise CaptureError(f"{self._g.ggml_get_name(t).decode()}: type {head.type}, ne {ne}, nb {nb}: not read")
        if self._g.ggml_nelements(t) != int(np.prod(ne)):
            raise CaptureError("struct ggml_tensor's layout is not the one this module reads (ggml.h changed?)")
        nbytes = self._g.ggml_nbytes(t)
        buf = np.empty(nbytes, np.uint8)
        self._g.ggml_backend_tensor_get(t, buf.ctypes.data, 0, nbytes)
        view = np.ndarray((ne[1], ne[0]), dtype=dtype, buffer=buf, strides=(nb[1], nb[0]))
        return np.array(view)

    def _write(self, t: int, layer: int) -> None:
        """Ask ``replace`` for layer ``layer``'s output and write it into the tensor ``t``."""
        got = self._got
        if ("ffn_norm", layer) not in got:
            raise CaptureError(f"ffn_moe_out-{layer} computed before ffn_norm-{layer}: nothing to replace it from")
        act = LayerActivations(
            got[("ffn_norm", layer)], got[("ffn_moe_out", layer)],
            got.get(("ffn_moe_topk", layer)), got.get(("ffn_moe_weights_norm", layer)),
        )  # fmt: skip
        new = self._replace(layer, act) if self._replace is not None else None
        if new is None:
            return
        new = np.ascontiguousarray(new, np.float32)
        head = _TensorHead.from_address(t)
        if new.shape != act.y.shape or int(head.nb[1]) != 4 * act.y.shape[1]:
            raise CaptureError(f"ffn_moe_out-{layer}: a replacement {new.shape} for {act.y.shape}, rows {head.nb[1]} B")
        self._g.ggml_backend_tensor_set(t, new.ctypes.data, 0, new.nbytes)
        self.replaced += 1

    def _callback(self, t: int, ask: bool, _user: object) -> bool:
        # an exception must not cross into C: kept, raised by run() once llama_decode returns
        try:
            m = _NAME_RE.fullmatch(self._g.ggml_get_name(t).decode("utf-8", "replace"))
            if ask:
                return m is not None
            if m is None:
                return True
            key = (m.group(1), int(m.group(2)))
            if key in self._got:
                raise CaptureError(f"{m.group(0)} computed twice in one ubatch")
            self._got[key] = self._read(t)
            if self._replace is not None and key[0] == "ffn_moe_out":
                self._write(t, key[1])
        except BaseException as e:  # noqa: BLE001 - see above
            self._error = self._error or e
        return True

    def _decode(self, tokens: np.ndarray) -> tuple[dict[tuple[str, int], np.ndarray], np.ndarray]:
        """Run one window from position 0; (captured tensors, every row's log-probabilities (T, n_vocab))."""
        n = len(tokens)
        if not 2 <= n <= WINDOW or int(np.max(tokens)) >= self.model.n_vocab:
            raise ValueError(f"a window of {n} tokens up to id {np.max(tokens)} (model: {self.model.n_vocab} ids)")
        self._got, self._error = {}, None
        self.ctx.clear_memory()
        rows = self.ctx.decode([int(t) for t in tokens], list(range(n)), [0] * n, [True] * n)
        if self._error is not None:
            raise self._error
        z = np.frombuffer(b"".join(rows), np.float32).reshape(n, -1).astype(np.float64)
        z -= z.max(axis=1, keepdims=True)
        return self._got, z - np.log(np.exp(z).sum(axis=1, keepdims=True))

    def logprobs(self, tokens: np.ndarray) -> np.ndarray:
        """The log-probabilities (T, n_vocab) float64 of every row of one window."""
        return self._decode(tokens)[1]

    def run(self, wins: Iterable[np.ndarray]) -> Capture:
        """Capture every MoE layer over ``wins`` (each its own sequence, at most WINDOW tokens)."""
        per: dict[tuple[str, int], list[np.ndarray]] = {}
        n_tokens, nll, n_pred = 0, 0.0, 0
        for w in wins:
            got, lp = self._decode(w)
            self.last_logprobs = lp
            w_nll = -float(np.sum(lp[np.arange(len(w) - 1), np.asarray(w[1:])]))
            for key, arr in got.items():
                if arr.shape[0] != len(w):
                    raise CaptureError(f"{key[0]}-{key[1]} has {arr.shape[0]} rows for {len(w)} tokens")
                per.setdefault(key, []).append(arr)
            n_tokens, nll, n_pred = n_tokens + len(w), nll + w_nll, n_pred + len(w) - 1
        layers = {}
        for li in sorted({li for name, li in per if name == "ffn_moe_out"}):
            if ("ffn_norm", li) not in per:
                raise CaptureError(f"layer {li}: ffn_moe_out-{li} but no ffn_norm-{li} in the graph")
            cat = {name: np.concatenate(per[name, li]) if (name, li) in per else None for name in CAPTURED}
            layers[li] = LayerActivations(
                cat["ffn_norm"], cat["ffn_moe_out"], cat["ffn_moe_topk"], cat["ffn_moe_weights_norm"]
            )
        if not layers:
            raise CaptureError(f"{self.model.path}: no ffn_moe_out-{{l}} tensor in its graph: not a MoE model")
        return Capture(layers, n_tokens, nll, n_pred)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()

    def __enter__(self) -> Capturer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the fit data -----------------------------------------------------------------------------


def reference_output(ref: MoeModel, li: int, act: LayerActivations) -> np.ndarray:
    """``ref``'s MoE output on the captured input, routed as the captured run routed (or by ``ref``'s router)."""
    return moe_forward(ref, li, act.x, act.experts, act.weights)


def collect_moments(
    capturer: Capturer,
    ref: MoeModel,
    wins: Sequence[np.ndarray],
    *,
    tune_every: int = 0,
    chunk: int = 16,
    log: Callable[[str], None] | None = None,
) -> tuple[dict[tuple[str, int], Moments], dict[tuple[str, int], Moments]]:
    """The fit data of every (source, layer) over ``wins``: sources from the captured run (x for
    ``input``, y for ``output``), residual target ``ref``'s output minus the run's y. Window i goes
    to the second dict when ``tune_every`` and ``i % tune_every == tune_every - 1``, else to the first."""
    main: dict[tuple[str, int], Moments] = {}
    tune: dict[tuple[str, int], Moments] = {}
    for start in range(0, len(wins), chunk):
        part = range(start, min(start + chunk, len(wins)))
        for into in (main, tune):
            picked = [wins[i] for i in part if (into is tune) == bool(tune_every and i % tune_every == tune_every - 1)]
            if not picked:
                continue
            cap = capturer.run(picked)
            for li, act in cap.layers.items():
                y_ref = reference_output(ref, li, act)
                r = y_ref - act.y
                for source, s in ((SOURCE_INPUT, act.x), (SOURCE_OUTPUT, act.y)):
                    into.setdefault((source, li), Moments.zeros(s.shape[1])).add(s, r, y_ref)
        if log is not None:
            log(f"captured {part.stop} of {len(wins)} windows")
    return main, tune


@dataclass(frozen=True)
class ReferenceCheck:
    """How well the numpy MoE block reproduces a run's captured output on one layer."""

    layer: int
    rel_err: float  # ||numpy - captured|| / ||captured||, routed as the run routed
    rel_err_own: float  # the same, numpy routing with its own router
    routing_agree: float  # fraction of tokens whose expert set numpy's router picks the same


def check_reference(ref: MoeModel, cap: Capture) -> list[ReferenceCheck]:
    """Compare ``ref``'s numpy MoE output with a run's captured ``ffn_moe_out`` on its captured input."""
    out = []
    for li, act in sorted(cap.layers.items()):
        own_e, own_w = route(ref, li, act.x)
        err = relative_error(reference_output(ref, li, act), act.y)
        err_own = relative_error(moe_forward(ref, li, act.x, own_e, own_w), act.y)
        agree = float("nan")
        if act.experts is not None:
            agree = float(np.mean(np.all(np.sort(own_e, axis=1) == np.sort(act.experts, axis=1), axis=1)))
        out.append(ReferenceCheck(li, err, err_own, agree))
    return out


# --- one fit's captures ------------------------------------------------------------------------


@dataclass
class FitData:
    """What :func:`capture_fit_data` measured: the moments of the training windows (split into fit
    and tuning parts) and of the held-out ones, and the reference checks."""

    fit_part: dict[tuple[str, int], Moments]
    tune_part: dict[tuple[str, int], Moments]
    heldout: dict[tuple[str, int], Moments]
    check_full: list[ReferenceCheck]  # numpy full-precision MoE vs the full-precision run
    check_quantized: list[ReferenceCheck]  # numpy 2-bit MoE vs the 2-bit run
    train_tokens: int
    heldout_tokens: int


@dataclass(frozen=True)
class HeldoutScore:
    """A model's next-token predictions on held-out windows against the full-precision model's."""

    nll: float  # mean next-token NLL, nats
    kl: float  # mean KL(full || this) over every row, nats (0 for the full model itself)
    top1: float  # fraction of rows whose most likely token is the full model's


def heldout_scores(
    full: Capturer, others: Mapping[str, Capturer], wins: Sequence[np.ndarray]
) -> dict[str, HeldoutScore]:
    """:class:`HeldoutScore` of ``full`` (key ``"full"``) and of each of ``others``, window by window
    in lock step (no logits kept beyond one window)."""
    names = ["full", *others]
    nll = dict.fromkeys(names, 0.0)
    kl = dict.fromkeys(names, 0.0)
    top1 = dict.fromkeys(names, 0)
    rows = predicted = 0
    for w in wins:
        base = full.logprobs(w)
        target = np.asarray(w[1:])
        for name in names:
            lp = base if name == "full" else others[name].logprobs(w)
            nll[name] -= float(np.sum(lp[np.arange(len(w) - 1), target]))
            kl[name] += float(np.sum(np.exp(base) * (base - lp)))
            top1[name] += int(np.sum(lp.argmax(axis=1) == base.argmax(axis=1)))
        rows, predicted = rows + len(w), predicted + len(w) - 1
    return {n: HeldoutScore(nll[n] / predicted, kl[n] / rows, top1[n] / rows) for n in names}


def capture_fit_data(
    full: Path,
    quantized: Path,
    train_wins: Sequence[np.ndarray],
    heldout_wins: Sequence[np.ndarray],
    *,
    threads: int = 1,
    tune_every: int = 5,
    check_windows: int = 4,
    log: Callable[[str], None] = lambda _: None,
) -> FitData:
    """Capture the 2-bit model (``quantized``) on the training and held-out windows and turn the
    captures into fit data against ``full``'s experts in numpy (:func:`collect_moments`); check the
    numpy MoE against both models' runs on the first ``check_windows`` held-out windows.
    (:func:`heldout_scores` then measures a fitted compensator end to end.)"""
    from .moe_numpy import load_moe

    ref, ref_q = load_moe(full), load_moe(quantized)
    check_wins = heldout_wins[:check_windows]
    with Capturer(full, threads) as cap_full:
        check_full = check_reference(ref, cap_full.run(check_wins))
    with Capturer(quantized, threads) as cap_q:
        check_q = check_reference(ref_q, cap_q.run(check_wins))
        tuning = f"1 in {tune_every} tunes the ridge" if tune_every else "no ridge tuning"
        log(f"training text: {len(train_wins)} windows of {WINDOW} tokens ({tuning})")
        fit_part, tune_part = collect_moments(cap_q, ref, train_wins, tune_every=tune_every, log=log)
        heldout, _ = collect_moments(cap_q, ref, heldout_wins)
    return FitData(
        fit_part,
        tune_part,
        heldout,
        check_full,
        check_q,
        train_tokens=sum(len(w) for w in train_wins),
        heldout_tokens=sum(len(w) for w in heldout_wins),
    )
