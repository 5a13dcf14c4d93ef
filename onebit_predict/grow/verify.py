"""The proof that a grown model is its original: same routing, same logits.

Both models run through the patched libllama on the first bytes of the held-out text
(models/heldout.txt; token id = byte), as ``onebit-trace --bytes --prefill N --generate 0``
does: a prefill of ``prefill`` tokens in one batch, then the rest one token at a time,
teacher-forced, with the predictor on (``router``) writing a trace. Compared:

- **routing**: the traces' records row for row: the same layer, seq_id, pos, and the same
  actual expert ids in the same order. ``rows_equal / rows``.
- **logits**: the NMSE of the grown model's logits against the other's over every row read
  (the last prefill row and each decoded token): ``sum((g - o)^2) / sum(o^2)``.

A grown model's arithmetic is its original's only when its experts are stored in the same
type: ggml multiplies F16 weights with activations rounded to F16, F32 weights with F32
ones. So the F32 grown model is held to its **reference**, the source with its experts
converted to F32 at their own width (grow/grow.py at width n_ff, exactly the same
values), and the F16 one to the source itself; both must route identically and have an
NMSE below :data:`NMSE_EXACT`. Against the original file every model reports its routing
fraction and NMSE (the quantized ones: reported, not held to a bound: quantizing changes
the function, attention included). A quantized grown model's reference is the same type at
the smallest width a K-quant row allows (``n_ff`` rounded up to 256): llama-quantize
quantizes each 256-block of a row on its own, and the blocks past the first are all zeros,
so every width from there on should compute the same; reported, not held to it.

``extra_bufts``: llama.cpp's extra buffer types (``llama_model_params.use_extra_bufts``:
the CPU backend's AMX and repacked weights). On, the default, is how the other commands
run; the quantized models run with it off, both they and the original they are compared
with, because on a CPU with AMX the quantized AMX kernels use tile instructions that die
with SIGILL where the kernel does not grant them (this project's VM, docs/results.md).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..llama.paths import REPO_ROOT
from ..llama.record import PredictorKnobs
from ..llama.runner import Context, ContextSettings, Model
from ..trace import Trace
from .grow import QK_K
from .store import Store

HELDOUT = REPO_ROOT / "models" / "heldout.txt"
N_BYTES = 96
PREFILL = 16
NMSE_EXACT = 1e-10  # the bound for F32 (against its reference) and F16 (against the source)
ROUTING_FIELDS = ("layer", "seq_id", "pos", "actual_ids")


@dataclass(frozen=True)
class Run:
    """What one model did on the text."""

    path: Path
    logits: np.ndarray  # (rows, n_vocab) float32
    routing: np.ndarray  # the trace's records, ROUTING_FIELDS only


@dataclass(frozen=True)
class Comparison:
    rows: int  # trace records compared (the longer trace's count)
    rows_equal: int
    logit_rows: int
    nmse: float

    @property
    def routing_equal(self) -> bool:
        return self.rows_equal == self.rows

    @property
    def routing_fraction(self) -> float:
        return self.rows_equal / self.rows if self.rows else 1.0


def heldout_tokens(n_bytes: int = N_BYTES, path: Path = HELDOUT) -> list[int]:
    """The first ``n_bytes`` bytes of the held-out text, as token ids."""
    data = Path(path).read_bytes()[:n_bytes]
    if len(data) < 2:
        raise ValueError(f"{path}: needs at least 2 bytes")
    return list(data)


def run(model_path: Path, tokens: list[int], prefill: int = PREFILL, threads: int = 2, extra_bufts: bool = True) -> Run:
    """Prefill, then decode the rest one by one with the router predictor tracing; logits and routing."""
    if not 1 <= prefill < len(tokens):
        raise ValueError(f"prefill {prefill} must be in 1..{len(tokens) - 1}")
    settings = ContextSettings(n_ctx=max(256, len(tokens)), n_batch=prefill, n_ubatch=prefill, n_threads=threads)
    with tempfile.TemporaryDirectory(prefix="onebit-grow-") as tmp:
        trace_path = Path(tmp) / "trace.bin"
        rows: list[bytes] = []
        with Model(Path(model_path), extra_bufts=extra_bufts) as model:
            if model.n_vocab < 256:
                raise ValueError(f"{model_path}: byte tokens need a vocabulary of at least 256 ids")
            with Context(model, settings, PredictorKnobs("router").env(trace_path)) as ctx:
                rows += ctx.decode(
                    tokens[:prefill], list(range(prefill)), [0] * prefill, [False] * (prefill - 1) + [True]
                )
                for pos in range(prefill, len(tokens)):
                    rows += ctx.decode([tokens[pos]], [pos], [0], [True])
        trace = Trace.open(trace_path)
        routing = np.concatenate([c[list(ROUTING_FIELDS)] for c in trace.iter_chunks()] or [np.empty(0)])
    logits = np.stack([np.frombuffer(r, dtype=np.float32) for r in rows])
    return Run(Path(model_path), logits, routing)


def compare(a: Run, b: Run) -> Comparison:
    """b against a: routing rows equal, NMSE of b's logits against a's."""
    n = min(len(a.routing), len(b.routing))
    same = np.ones(n, dtype=bool)
    for name in ROUTING_FIELDS:
        x, y = a.routing[name][:n], b.routing[name][:n]
        same &= (x == y).reshape(n, -1).all(axis=1)
    if a.logits.shape != b.logits.shape:
        raise ValueError(f"{a.path} and {b.path} gave logits of different shapes")
    ref = a.logits.astype(np.float64)
    err = float(np.sum((b.logits.astype(np.float64) - ref) ** 2))
    nmse = err / float(np.sum(ref**2))
    return Comparison(max(len(a.routing), len(b.routing)), int(same.sum()), len(a.logits), nmse)


def reference(store: Store, kind: str) -> tuple[Path, bool]:
    """The model whose arithmetic a grown model of ``kind`` should reproduce, and whether it must."""
    if kind == "f16":
        return store.source, True
    if kind == "f32":
        return store.get(store.info.n_ff, "f32").path, True
    return store.get(-(-store.info.n_ff // QK_K) * QK_K, kind).path, False


class Verifier:
    """Runs each model once and compares; holds the runs of the originals and references."""

    def __init__(self, tokens: list[int] | None = None, prefill: int = PREFILL, threads: int = 2) -> None:
        self.tokens = tokens if tokens is not None else heldout_tokens()
        self.prefill = prefill
        self.threads = threads
        self._runs: dict[tuple[Path, bool], Run] = {}

    def run(self, path: Path, extra_bufts: bool = True) -> Run:
        key = (Path(path).resolve(), extra_bufts)
        if key not in self._runs:
            self._runs[key] = run(key[0], self.tokens, self.prefill, self.threads, extra_bufts)
        return self._runs[key]

    def compare(self, original: Path, grown: Path, extra_bufts: bool = True) -> Comparison:
        """grown against original, both run with the same ``extra_bufts``."""
        return compare(self.run(original, extra_bufts), self.run(grown, extra_bufts))


HELDOUT_SEQ_LEN = 256  # the trained models' held-out snippet: sequences of this many byte tokens


def heldout_sequences(path: Path) -> list[list[int]]:
    """The held-out snippet (tools/train_tiny.py writes it, 4 x 256 bytes) as 256-token sequences
    (token id = byte value)."""
    raw = path.read_bytes()
    return [list(raw[i : i + HELDOUT_SEQ_LEN]) for i in range(0, len(raw), HELDOUT_SEQ_LEN)]


def llama_logits(gguf_path: Path, seqs: list[list[int]], threads: int = 1):
    """llama.cpp logits (numpy, [n_seq, len, n_vocab]) of each sequence, each in a fresh context."""
    n = max(len(s) for s in seqs)
    settings = ContextSettings(n_ctx=max(256, n), n_batch=n, n_ubatch=n, n_threads=threads)
    env = {k: None for k in ("ONEBIT_MOE_PREDICT", "ONEBIT_MOE_PREDICT_OUT", "ONEBIT_MOE_PREDICT_STATS")}
    out = []
    with Model(gguf_path) as model:
        for s in seqs:
            with Context(model, settings, env) as ctx:
                rows = ctx.decode(s, list(range(len(s))), [0] * len(s), [True] * len(s))
            out.append(np.stack([np.frombuffer(r, dtype=np.float32) for r in rows]))
    return np.stack(out)
