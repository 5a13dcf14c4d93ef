"""Run token ids through the patched libllama with llama-cpp-python's low-level API.

The commands (``onebit-trace``, ``onebit-bitident``) need what the high-level ``Llama``
class hides: several sequences in one batch, explicit ubatch sizes, flash attention on and
off, state save/restore, and logits read back as raw bytes. A context's predictor settings,
keyed by their ONEBIT_* variable names, go through the C API (moe_api.py,
``onebit_init_from_model``): a knob given (None: its default) wins over the process
environment, which is never read or written here; a knob not given falls back to it.

A process loads one libllama: the patched build, or, after :func:`use_unpatched` (onebit-bench's
"unpatched pin" row), the unpatched pin's (``./build.sh pristine``). That one has no onebit_*
symbol, so the runner never looks one up there: its contexts come from plain
``llama_init_from_model``, and a context asked for any predictor knob is refused.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .moe_api import bind, moe_params
from .paths import use_patched_libllama, use_pristine_libllama

_llama: Any = None
_log_callback: Any = None  # kept referenced: llama.cpp calls it for the life of the process
_init_from_model: Any = None  # onebit_init_from_model, bound on first use (patched build only)
_patched = True  # which build llama() loads: decided before it loads, never probed from the library


class RunError(RuntimeError):
    """llama.cpp refused a model, a context or a batch."""


def use_unpatched() -> None:
    """Load the unpatched pin's libllama instead of the patched one (before the first
    :func:`llama`): this process then takes no onebit_* call at all."""
    global _patched
    if _llama is not None and _patched:
        raise RuntimeError("the patched libllama is already loaded in this process")
    _patched = False


def patched() -> bool:
    """Whether this process runs the patched libllama (the default) rather than the unpatched pin's."""
    return _patched


def onebit_symbols() -> list[str]:
    """The onebit_* functions this process resolved in the loaded libllama (ctypes keeps each
    function an attribute lookup resolved on the library object); none on the unpatched build."""
    if _llama is None:
        return []
    return sorted(name for name in vars(_llama.llama_cpp._lib) if name.startswith("onebit"))


def llama() -> Any:
    """The llama_cpp module, loaded against the patched libllama, or the unpatched pin's after
    :func:`use_unpatched` (once)."""
    global _llama, _log_callback
    if _llama is None:
        if _patched:
            use_patched_libllama()
        else:
            use_pristine_libllama()
        import llama_cpp  # noqa: PLC0415 - must follow LLAMA_CPP_LIB_PATH

        _llama = llama_cpp
        verbose = os.environ.get("ONEBIT_VERBOSE", "") not in ("", "0")

        @llama_cpp.llama_log_callback
        def forward(level: int, text: bytes, _user: Any) -> None:
            # keep onebit's own lines, warnings and errors; llama.cpp's load chatter only with ONEBIT_VERBOSE=1
            line = text.decode("utf-8", "replace")
            if verbose or level in (3, 4) or line.startswith("onebit"):
                sys.stderr.write(line)

        _log_callback = forward
        llama_cpp.llama_log_set(_log_callback, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
    return _llama


def builtin_tokens(n: int, n_vocab: int, seed: int) -> list[int]:
    """The built-in token stream: n ids drawn uniformly from the vocabulary with a fixed seed."""
    return np.random.default_rng(seed).integers(0, n_vocab, size=n).tolist()


@dataclass(frozen=True)
class ContextSettings:
    """Everything that must be identical between two runs whose logits are compared."""

    n_ctx: int = 256
    n_batch: int = 64
    n_ubatch: int = 8
    n_threads: int = 2
    flash_attn: bool = False
    n_seq_max: int = 1


class Model:
    """A GGUF loaded on the CPU."""

    def __init__(self, path: Path, use_mmap: bool = True, extra_bufts: bool = True) -> None:
        """``extra_bufts``: llama.cpp's extra buffer types (``use_extra_bufts``: the CPU's AMX or
        repacked weights); off, every weight is multiplied by the plain CPU kernels."""
        lib = llama()
        if not path.is_file():
            raise RunError(f"{path}: no such file")
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_extra_bufts = extra_bufts
        if not use_mmap:
            params.load_mode = lib.LLAMA_LOAD_MODE_NONE  # read into memory (llama.cpp's -lm none)
        self.ptr = lib.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            raise RunError(f"{path}: llama.cpp could not load this model (run with ONEBIT_VERBOSE=1 for its log)")
        self.path = path
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.ptr))
        self.n_layer = lib.llama_model_n_layer(self.ptr)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of text with the model's own tokenizer; ValueError if it has none."""
        lib = llama()
        vocab = lib.llama_model_get_vocab(self.ptr)
        if lib.llama_vocab_type(vocab) == lib.LLAMA_VOCAB_TYPE_NONE:
            raise ValueError(f"{self.path} has no tokenizer: give token ids instead (--tokens N)")
        data = text.encode()
        n_max = len(data) + 16
        buf = (lib.llama_token * n_max)()
        n = lib.llama_tokenize(vocab, data, len(data), buf, n_max, True, False)
        if n < 0:
            raise RunError(f"llama_tokenize failed ({n})")
        return list(buf[:n])

    def close(self) -> None:
        if self.ptr:
            llama().llama_model_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def refuse_knobs(env: Mapping[str, str | None]) -> None:
    """RunError if env asks the unpatched libllama for a predictor knob: it has none, so the
    run would silently measure plain llama.cpp under that knob's name. Absent, None, ``""``
    (the default) and ``off`` pass."""
    asked = sorted(f"{k}={v}" for k, v in env.items() if v not in (None, "", "off"))
    if asked:
        raise RunError(f"the unpatched libllama has no predictor: it cannot run {', '.join(asked)}")


class Context:
    """A llama.cpp context; :meth:`decode` returns the logits of the rows asked for, as bytes."""

    def __init__(
        self, model: Model, settings: ContextSettings, env: Mapping[str, str | None], cb_eval: Any = None
    ) -> None:
        """``cb_eval``: a ``llama_cpp.ggml_backend_sched_eval_callback`` for the scheduler (int2/capture.py),
        kept referenced for the context's life; None: none."""
        lib = llama()
        params = lib.llama_context_default_params()
        if cb_eval is not None:
            params.cb_eval = cb_eval
            params.cb_eval_user_data = None
        self._cb_eval = cb_eval  # llama.cpp calls it while the context lives
        params.n_ctx = settings.n_ctx
        params.n_batch = settings.n_batch
        params.n_ubatch = settings.n_ubatch
        params.n_seq_max = settings.n_seq_max
        params.n_threads = settings.n_threads
        params.n_threads_batch = settings.n_threads
        params.flash_attn_type = 1 if settings.flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_ENABLED / DISABLED
        params.no_perf = True
        global _init_from_model
        if _patched:
            if _init_from_model is None:
                try:
                    _init_from_model = bind(lib)
                except AttributeError:  # ctypes: undefined symbol
                    raise RunError(
                        f"{lib.llama_cpp._lib._name} has no onebit_init_from_model: it is not the patched "
                        "build (LLAMA_CPP_LIB_PATH names another libllama?); run ./build.sh"
                    ) from None
            moe = moe_params(env)  # the settings go through the C API: the process environment is never touched
            self.ptr = _init_from_model(model.ptr, params, ctypes.byref(moe))
        else:
            refuse_knobs(env)
            self.ptr = lib.llama_init_from_model(model.ptr, params)  # upstream's own: no onebit symbol
        if not self.ptr:
            raise RunError(f"{model.path}: llama.cpp could not create a context (see the log above)")
        self.model = model
        self.settings = settings

    def decode(
        self, tokens: Sequence[int], pos: Sequence[int], seq: Sequence[int], want: Sequence[bool]
    ) -> list[bytes]:
        """Decode one batch; return each wanted row's logits (n_vocab float32, as bytes)."""
        lib = llama()
        n = len(tokens)
        batch = lib.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i in range(n):
                batch.token[i] = tokens[i]
                batch.pos[i] = pos[i]
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq[i]
                batch.logits[i] = 1 if want[i] else 0
            rc = lib.llama_decode(self.ptr, batch)
            if rc != 0:
                raise RunError(f"llama_decode returned {rc}")
            rows = []
            size = self.model.n_vocab * 4
            for i in range(n):
                if want[i]:
                    ptr = lib.llama_get_logits_ith(self.ptr, i)
                    rows.append(ctypes.string_at(ptr, size))
            return rows
        finally:
            lib.llama_batch_free(batch)

    def clear_memory(self) -> None:
        """Forget every sequence (KV cache and recurrent state): the next token starts at pos 0."""
        lib = llama()
        lib.llama_memory_clear(lib.llama_get_memory(self.ptr), True)

    def save_state(self) -> bytes:
        lib = llama()
        size = lib.llama_state_get_size(self.ptr)
        buf = (ctypes.c_uint8 * size)()
        written = lib.llama_state_get_data(self.ptr, buf, size)
        if written != size:
            raise RunError(f"llama_state_get_data wrote {written} of {size} bytes")
        return bytes(buf)

    def load_state(self, state: bytes) -> None:
        lib = llama()
        buf = (ctypes.c_uint8 * len(state)).from_buffer_copy(state)
        if lib.llama_state_set_data(self.ptr, buf, len(state)) != len(state):
            raise RunError("llama_state_set_data did not read the whole state")

    def close(self) -> None:
        if self.ptr:
            llama().llama_free(self.ptr)  # prints the _STATS table and closes the trace
            self.ptr = None

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
