"""A synthetic P/A trace shaped like a llama-server run, of any size, for benchmarks and tests.

The header is a Qwen3-30B-A3B-sized run (n_layer 48, n_expert 128, n_expert_used 8, depth 16,
mode router, no margin gate, min_read 8, layers 1..47 predicted); the records are whole
ubatches ("steps") of a llama-server-like :class:`Schedule`: ``n_slots`` sequence slots (seq
ids 0..n_slots-1, reused when a sequence ends and a new prompt starts at pos 0), each prompt
prefilled in one ubatch together with the other slots' decode rows, every MoE layer
layer-major per step, the last layer only for output rows (decode rows and each prompt's last
row). DECODE on decode rows; PREDICTED on layers >= 1, one layer ahead; actual ids distinct per
row (a window of 8 in a per-layer permutation of the 128 experts, drifting from token to token
so that the previous-token baseline is ~40%); predicted ids distinct, near the actual window
(most rows hit most experts), logits strictly descending; n_read is the margin gate
recomputed from the logits (no gate: depth).

The layout is the package's own (``TraceHeader``'s dtype, written by ``TraceWriter``); the
contents come from a seeded numpy RNG, generated and written in chunks of ``WRITE_CHUNK``
records (~14 MiB), so a trace of any size is written in bounded memory. The same seed, size
and schedule give the same bytes; the file holds whole steps and is at most the size asked.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .constants import MODE_ROUTER, TRACE_FLAG_DECODE, TRACE_FLAG_PREDICTED, TRACE_HEADER_SIZE
from .policy import n_read_rows
from .trace import TraceHeader, record_size
from .trace_writer import TraceWriter

N_LAYER, N_EXPERT, N_USED, DEPTH = 48, 128, 8, 16
MARGIN = math.inf  # no gate: n_read = depth on every predicted row
DRIFT = 10  # the actual window moves by -DRIFT..DRIFT from one token to the next (per layer)
PRED_OFFSETS = np.array([0, 1, 2, 3, 4, 5, 6, 7, -1, 8, -2, 9, -3, 10, -4, 11])  # rank -> window slot
PRED_SHIFT = np.arange(-8, 9)  # how far the predicted window sits from the actual one
PRED_SHIFT_P = np.exp(-np.abs(PRED_SHIFT) / 2.0) / np.exp(-np.abs(PRED_SHIFT) / 2.0).sum()
PRED_MISS = 0.03  # rows whose prediction is somewhere else entirely
WRITE_CHUNK = 1 << 16  # records generated and written at once (~14 MiB)
assert len(PRED_OFFSETS) == DEPTH and len(set(PRED_OFFSETS.tolist())) == DEPTH


@dataclass(frozen=True)
class Schedule:
    """How the synthetic server runs: its slots and the lengths of prompts and generations."""

    n_slots: int = 4  # sequences decoding concurrently (llama-server slots; seq_id = slot)
    prompt: tuple[int, int] = (16, 129)  # prompt length range [lo, hi); lo >= 2, or a 1-token prompt is DECODE
    generate: tuple[int, int] = (200, 2001)  # tokens generated per sequence [lo, hi)

    def __post_init__(self) -> None:
        if self.n_slots < 1:
            raise ValueError(f"n_slots must be >= 1, not {self.n_slots}")
        if not 2 <= self.prompt[0] < self.prompt[1]:
            raise ValueError(f"prompt must be a range [lo, hi) with 2 <= lo < hi, not {self.prompt}")
        if not 1 <= self.generate[0] < self.generate[1]:
            raise ValueError(f"generate must be a range [lo, hi) with 1 <= lo < hi, not {self.generate}")


SERVER = Schedule()  # the default: 4 slots, prompts of 16..128 tokens, 200..2000 generated


def synth_header(seed: int) -> TraceHeader:
    """The header of every synthetic trace of ``seed`` (its model string names the seed)."""
    return TraceHeader.build(
        n_layer=N_LAYER,
        n_expert=N_EXPERT,
        n_expert_used=N_USED,
        depth=DEPTH,
        mode=MODE_ROUTER,
        margin=MARGIN,
        arch="qwen3moe",
        model=f"onebit bench_stats synthetic trace (seed {seed})",
    )


@dataclass
class Step:
    """One ubatch: its rows in ubatch order."""

    seq_id: np.ndarray  # i4 per row
    pos: np.ndarray  # i4 per row
    decode: np.ndarray  # bool per row: the row's sequence has exactly one token in the ubatch
    output: np.ndarray  # bool per row: the row produces logits (has a record on the last layer)
    prompt_slots: list[int] = field(default_factory=list)  # slots starting a new prompt here

    @property
    def n_records(self) -> int:
        return len(self.pos) * (N_LAYER - 1) + int(self.output.sum())


def iter_steps(seed: int, schedule: Schedule = SERVER) -> Iterator[Step]:
    """The schedule (no content): endless ubatches of ``schedule.n_slots`` sequences, like llama-server.

    A slot prefills its prompt in one ubatch (rows pos 0..P-1, not DECODE, only the last one
    an output), then decodes one token per ubatch (DECODE, output) for a random length, then
    starts a new prompt under the same seq_id. Decode rows come first in slot order, then
    the prompts, so row order is not sequence order.
    """
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[0])
    n_slots = schedule.n_slots
    pos = [0] * n_slots
    left = [0] * n_slots  # decode tokens still to generate; 0: the slot starts a new prompt
    while True:
        seq, p, dec, out = [], [], [], []
        prompts = [s for s in range(n_slots) if left[s] == 0]  # a sequence is never in both lists
        for s in range(n_slots):
            if left[s] > 0:
                seq.append(s), p.append(pos[s]), dec.append(True), out.append(True)
                pos[s] += 1
                left[s] -= 1
        for s in prompts:
            n = int(rng.integers(*schedule.prompt))
            seq += [s] * n
            p += range(n)
            dec += [False] * n
            out += [False] * (n - 1) + [True]
            pos[s], left[s] = n, int(rng.integers(*schedule.generate))
        yield Step(np.array(seq, np.int32), np.array(p, np.int32), np.array(dec), np.array(out), prompts)


def plan(size_bytes: int, seed: int, schedule: Schedule = SERVER) -> tuple[int, int]:
    """(steps, records) of the trace: whole steps while the file stays within ``size_bytes``."""
    budget = (size_bytes - TRACE_HEADER_SIZE) // record_size(N_USED, DEPTH)
    steps = records = 0
    for st in iter_steps(seed, schedule):
        if records + st.n_records > budget:
            return steps, records
        steps, records = steps + 1, records + st.n_records
    raise AssertionError("iter_steps is endless")


def expected_size(size_bytes: int, seed: int, schedule: Schedule = SERVER) -> int:
    """The size of the file :func:`write_trace` writes for these arguments."""
    return TRACE_HEADER_SIZE + plan(size_bytes, seed, schedule)[1] * record_size(N_USED, DEPTH)


class _Content:
    """The record contents, from a second RNG stream: per-layer expert permutations and, per
    (slot, layer), the offset of the actual window, drifting from token to token."""

    def __init__(self, seed: int, header: TraceHeader, n_slots: int) -> None:
        self.h = header
        self.rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(2)[1])
        self.perm = np.stack([self.rng.permutation(N_EXPERT) for _ in range(N_LAYER)]).astype(np.int32)
        self.n_slots = n_slots
        self.offset = np.zeros((n_slots, N_LAYER), np.int64)
        self.predicted = np.zeros(N_LAYER, bool)
        self.predicted[sorted(header.layer_mask)] = True

    def step_meta(self, step_no: int, st: Step) -> dict[str, np.ndarray]:
        """Per record of one step, layer-major: seq_id, pos, layer, decode, window offset."""
        rng = self.rng
        win = np.empty((len(st.pos), N_LAYER), np.int64)  # window offset of each (row, layer)
        for s in range(self.n_slots):
            rows = np.flatnonzero(st.seq_id == s)
            if not len(rows):
                continue
            drift = rng.integers(-DRIFT, DRIFT + 1, size=(len(rows), N_LAYER))
            if s in st.prompt_slots:  # a new sequence: a fresh start, then drift along the prompt
                drift[0] = rng.integers(0, N_EXPERT, size=N_LAYER) - self.offset[s]
            win[rows] = self.offset[s] + np.cumsum(drift, axis=0)
            self.offset[s] = win[rows[-1]] % N_EXPERT
        n_rows = len(st.pos)
        layer = np.repeat(np.arange(N_LAYER, dtype=np.int64), n_rows)
        row = np.tile(np.arange(n_rows), N_LAYER)
        keep = (layer < N_LAYER - 1) | st.output[row]
        layer, row = layer[keep], row[keep]
        return {
            "step": np.full(len(row), step_no, np.int64),
            "seq_id": st.seq_id[row],
            "pos": st.pos[row],
            "layer": layer,
            "decode": st.decode[row],
            "win": win[row, layer] % N_EXPERT,
        }

    def records(self, meta: dict[str, np.ndarray]) -> np.ndarray:
        """The records of ``meta`` (concatenated step_meta), in the header's dtype."""
        h, rng = self.h, self.rng
        n, layer, win = len(meta["layer"]), meta["layer"], meta["win"]
        rec = np.zeros(n, dtype=h.dtype)
        for name in ("step", "seq_id", "pos", "layer"):
            rec[name] = meta[name]
        # actual: the window of N_USED slots at `win` in the layer's permutation, rotated (graph order)
        rot = rng.integers(0, N_USED, size=n)
        slots = (win[:, None] + (np.arange(N_USED)[None, :] + rot[:, None]) % N_USED) % N_EXPERT
        rec["actual_ids"] = self.perm[layer[:, None], slots]
        w = -np.sort(-rng.exponential(size=(n, N_USED)), axis=1)  # descending, normalised
        rec["actual_w"] = w / w.sum(axis=1, keepdims=True)
        # prediction: DEPTH distinct slots around a window shifted from the actual one
        pred = self.predicted[layer]
        m = int(pred.sum())
        shift = rng.choice(PRED_SHIFT, size=m, p=PRED_SHIFT_P) + np.where(rng.random(m) < PRED_MISS, N_EXPERT // 2, 0)
        pslots = (win[pred][:, None] + shift[:, None] + PRED_OFFSETS[None, :]) % N_EXPERT
        gaps = 0.01 + rng.exponential(0.25, size=(m, DEPTH - 1))  # >= 0.01: strictly descending in binary32
        logits = rng.normal(2.0, 1.0, size=(m, 1)) - np.concatenate([np.zeros((m, 1)), np.cumsum(gaps, axis=1)], axis=1)
        logits = logits.astype(np.float32)
        assert (np.diff(logits, axis=1) < 0).all()
        rec["pred_ids"] = -1
        rec["pred_logits"] = np.nan
        rec["pred_ids"][pred] = self.perm[layer[pred][:, None], pslots]
        rec["pred_logits"][pred] = logits
        rec["n_read"][pred] = n_read_rows(logits, h.margin, h.min_read)
        rec["flags"] = np.where(meta["decode"], TRACE_FLAG_DECODE, 0) | np.where(pred, TRACE_FLAG_PREDICTED, 0)
        rec["distance"] = np.where(pred, 1, 0)  # every prediction one layer ahead
        return rec


def write_trace(path: str | Path, size_bytes: int, seed: int = 0, schedule: Schedule = SERVER) -> tuple[int, int]:
    """Write the synthetic trace (at most ``size_bytes``) to ``path``; return (steps, records).

    Whole or absent (``TraceWriter``): an error leaves ``path`` as it was.
    """
    header = synth_header(seed)
    n_steps, n_records = plan(size_bytes, seed, schedule)
    content = _Content(seed, header, schedule.n_slots)
    pending: list[dict[str, np.ndarray]] = []
    n_pending = written = 0

    def flush(writer: TraceWriter) -> int:
        meta = {k: np.concatenate([m[k] for m in pending]) for k in pending[0]}
        pending.clear()
        writer.write(content.records(meta))
        return len(meta["layer"])

    with TraceWriter(path, header) as writer:
        for step_no, st in zip(range(n_steps), iter_steps(seed, schedule)):
            pending.append(content.step_meta(step_no, st))
            n_pending += len(pending[-1]["layer"])
            if n_pending >= WRITE_CHUNK:
                written += flush(writer)
                n_pending = 0
        if pending:
            written += flush(writer)
    assert written == n_records
    return n_steps, n_records
