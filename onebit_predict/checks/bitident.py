"""The off-vs-predictor bit-identity check.

Runs the same tokens through fresh contexts with ``ONEBIT_MOE_PREDICT`` off, router, block and learned, and
with the prefetch consumer on (``router+advise``, ``block+read``: a mode is
``PREDICTOR[@K][+CALL][+route[+exact][+wait][+lru][+anon][+hits][+layers]]`` or
``[CALL+]route[+exact][+wait][+lru][+anon][+hits][+layers]`` (checks/modes.py), ``@K`` predicting K layers
ahead, ``CALL`` the consumer's call (advise, read, populate, pread), ``+route`` reading each layer's routed
experts at route time, ``route`` without a predictor part route time with the predictor off; after ``+route``,
in this order, ``+exact`` readahead off on the expert tensors (ONEBIT_MOE_PREFETCH_RANDOM=1), ``+wait`` the
route-time op waiting for its layer's reads (ONEBIT_MOE_PREFETCH_WAIT=1, not with advise), ``+lru`` the LRU
over whole experts (ONEBIT_MOE_PREFETCH_KEEP=lru) held to n_expert_used + 2 experts so that it evicts on a
resident model, ``+anon`` the same LRU in anonymous memory of its own (ONEBIT_MOE_PREFETCH_KEEP=anon, with
pread and ``+wait`` or ``+hits``), ``+hits`` the order of the reads and matmuls
(ONEBIT_MOE_PREFETCH_ORDER=hits), ``+layers`` a batch's whole layers read ahead
(ONEBIT_MOE_PREFETCH_LAYERS=2)), in several scenarios (multi-ubatch prefill then single-token decode; two
sequences in one batch; a state save and restore in the middle; flash attention on and off; 1 and 2 threads; a
128-token prompt in ubatches of 64, where a ubatch routes nearly every expert), and compares every logits row
as bytes, never with a tolerance. A predictor run passes only if it also predicted: its trace must hold a
PREDICTED record for every routed row of every predicted layer, each at the distance asked for, so a check
that silently predicted nothing, or predicted one layer ahead when asked for two, cannot pass; with a
consumer, the trace must also show that it ran, issued reads and had no failure; with route time, the
context's counters (onebit_moe_get_stats) must show that it routes and that its op looked at the routed
experts. Every route-time knob is proven both ways, asked for or not: the header's route, random (``+exact``)
and wait flags and its call (``route`` alone: read), the counters' ``wait`` and ``keep`` (``+lru``: 1,
``+anon``: 2, with an eviction and the capacity the check set, and with a predictor a guess the LRU's room for
guesses skipped or paged out) and ``order`` (``+hits``: 1, with expert matmuls marked and, with ``+lru``, runs
taken out of index order, with ``+anon`` runs that read the waiting mark) and ``layers`` (``+layers``: 2, and
in the big prompt's scenario ops that read ahead). A trace that was not written whole (none at all, shorter
than its header, INCOMPLETE or still OPEN: ``trace_written.written_problem``, e.g. ``--keep-traces`` on a full
disk) fails its mode with that reason, never with what its missing bytes would seem to say.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..constants import (
    DEBUG_LEAK_UNCHECKED,
    ENV_AHEAD,
    ENV_ALL,
    ENV_DEBUG_LEAK,
    ENV_LEARNED,
    ENV_MODE,
    ENV_OUT,
    ENV_PREFETCH,
    ENV_PREFETCH_DEBUG_KEEP_CAP,
    ENV_PREFETCH_KEEP,
    ENV_PREFETCH_LAYERS,
    ENV_PREFETCH_ORDER,
    ENV_PREFETCH_RANDOM,
    ENV_PREFETCH_ROOM,
    ENV_PREFETCH_ROUTE,
    ENV_PREFETCH_WAIT,
    KEEP_KERNEL,
    KEEP_NAMES,
    MODE_NAMES,
    TRACE_FLAG_PREDICTED,
)
from ..llama.moe_stats import context_stats
from ..llama.runner import Context, ContextSettings, Model, builtin_tokens, llama
from ..trace import Trace, TraceHeader
from ..trace_written import written_problem
from .modes import ROUTE, ModeSpec, mode_ahead, parse_mode

# every predictor, every consumer and a lookahead of each predictor at least once, route time
# alone, with a predictor and with each qualifier; any mode of the grammar (parse_mode) is accepted
MODES = (
    "router",
    "block",
    "router+advise",
    "block+read",
    "router@2",
    "block@3+advise",
    "learned@2",
    "route",
    "block+populate+route",
    "pread+route+exact+wait",
    "route+lru+hits+layers",
    "block+pread+route+wait+lru",
    "pread+route+wait+anon",
    "block+pread+route+anon+hits",
)
LAYERS = 2  # +layers: the whole layers a batch reads ahead (ONEBIT_MOE_PREFETCH_LAYERS)
KEEP_CAP_EXTRA = 2  # +lru, +anon: n_expert_used + this many experts held (ONEBIT_MOE_PREFETCH_DEBUG_KEEP_CAP): evicts
N_PREFILL = 24
N_DECODE = 16
N_PROMPT_BIG = 128  # the big-prompt scenario's prompt: two ubatches of 64, which route nearly every expert


@dataclass(frozen=True)
class Scenario:
    """One way of feeding the tokens; the same settings are used for every mode."""

    name: str
    settings: ContextSettings
    feed: str  # "decode", "two-seqs", "save-restore", "big-prompt" or "next-request"


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("prefill+decode", ContextSettings(n_ubatch=8, n_threads=2, flash_attn=False), "decode"),
    Scenario("prefill+decode flash-attn", ContextSettings(n_ubatch=8, n_threads=2, flash_attn=True), "decode"),
    Scenario("prefill+decode 1 thread", ContextSettings(n_ubatch=8, n_threads=1, flash_attn=False), "decode"),
    Scenario("two sequences", ContextSettings(n_ubatch=8, n_threads=2, n_seq_max=2), "two-seqs"),
    Scenario("save+restore", ContextSettings(n_ubatch=8, n_threads=2), "save-restore"),
    Scenario("prompt in ubatches of 64", ContextSettings(n_batch=N_PROMPT_BIG, n_ubatch=64, n_threads=2), "big-prompt"),
    Scenario("a server's next request", ContextSettings(n_ubatch=8, n_threads=2), "next-request"),
)


@dataclass
class RunOutput:
    """What one context produced: logits rows in order, the tokens it routed, its trace."""

    rows: list[bytes] = field(default_factory=list)
    n_routed: int = 0  # token rows decoded (every row asks for logits, so no layer is trimmed)
    stats: dict[str, int] | None = None  # the context's onebit counters as it ended (llama/moe_stats.py)
    keep_cap: int | None = None  # the experts a +lru mode's LRU was held to (run_once)


@dataclass(frozen=True)
class Mismatch:
    row: int
    vocab: int
    off: float
    other: float


@dataclass(frozen=True)
class ModeResult:
    """The verdict for one mode in one scenario."""

    scenario: str
    mode: str
    ran: str  # the mode the trace header records (block falls back to router where unsupported)
    mismatch: Mismatch | None  # None: every logits row is byte-identical to off
    predicted_rows: int
    problem: str | None  # why the run proves too little (no predictions, missing rows)

    @property
    def ok(self) -> bool:
        return self.mismatch is None and self.problem is None


def _decode(ctx: Context, out: RunOutput, tokens: Sequence[int], pos: Sequence[int], seq: Sequence[int]) -> None:
    out.rows.extend(ctx.decode(tokens, pos, seq, [True] * len(tokens)))
    out.n_routed += len(tokens)


def _feed_decode(ctx: Context, out: RunOutput, toks: list[int]) -> None:
    _decode(ctx, out, toks[:N_PREFILL], range(N_PREFILL), [0] * N_PREFILL)
    for i in range(N_DECODE):
        _decode(ctx, out, [toks[N_PREFILL + i]], [N_PREFILL + i], [0])


def _feed_big_prompt(ctx: Context, out: RunOutput, toks: list[int]) -> None:
    # a prompt's batch as prefill sees it: route time's reads (and the LRU's) for a ubatch's union of experts
    _decode(ctx, out, toks[:N_PROMPT_BIG], range(N_PROMPT_BIG), [0] * N_PROMPT_BIG)
    for i in range(N_DECODE):
        _decode(ctx, out, [toks[N_PROMPT_BIG + i]], [N_PROMPT_BIG + i], [0])


def _feed_next_request(ctx: Context, out: RunOutput, toks: list[int]) -> None:
    # a server's next request: a 2-token prompt, tokens decoded one at a time (keep anon's slots fill), then a
    # prompt whose first ubatch is larger than any before (keep anon gives everything back before it), then
    # one at a time again
    _decode(ctx, out, toks[:2], range(2), [0, 0])
    n = 2
    for _ in range(N_DECODE):
        _decode(ctx, out, [toks[n]], [n], [0])
        n += 1
    _decode(ctx, out, toks[n : n + N_PREFILL], range(n, n + N_PREFILL), [0] * N_PREFILL)
    n += N_PREFILL
    for _ in range(N_DECODE // 2):
        _decode(ctx, out, [toks[n]], [n], [0])
        n += 1


def _feed_two_seqs(ctx: Context, out: RunOutput, toks: list[int]) -> None:
    # both prompts in one batch, interleaved, then both sequences step together
    a, b = toks[:N_PREFILL], toks[N_PREFILL : 2 * N_PREFILL]
    tokens = [t for pair in zip(a, b) for t in pair]
    pos = [p for p in range(N_PREFILL) for _ in (0, 1)]
    _decode(ctx, out, tokens, pos, [0, 1] * N_PREFILL)
    for i in range(N_DECODE):
        t = 2 * N_PREFILL + 2 * i
        _decode(ctx, out, toks[t : t + 2], [N_PREFILL + i] * 2, [0, 1])


def _feed_save_restore(ctx: Context, out: RunOutput, toks: list[int]) -> None:
    half = N_DECODE // 2
    _decode(ctx, out, toks[:N_PREFILL], range(N_PREFILL), [0] * N_PREFILL)
    for i in range(half):
        _decode(ctx, out, [toks[N_PREFILL + i]], [N_PREFILL + i], [0])
    state = ctx.save_state()
    detour = RunOutput()  # tokens the restore must erase; routed (and traced) but not compared
    for i in range(4):
        _decode(ctx, detour, [toks[-1 - i]], [N_PREFILL + half + i], [0])
    out.n_routed += detour.n_routed
    ctx.load_state(state)
    for i in range(half, N_DECODE):
        _decode(ctx, out, [toks[N_PREFILL + i]], [N_PREFILL + i], [0])


FEEDS: dict[str, Callable[[Context, RunOutput, list[int]], None]] = {
    "decode": _feed_decode,
    "two-seqs": _feed_two_seqs,
    "save-restore": _feed_save_restore,
    "big-prompt": _feed_big_prompt,
    "next-request": _feed_next_request,
}


def n_expert_used(model: Path) -> int:
    """The model's experts per token (its GGUF's ``expert_used_count``)."""
    from ..grow.gguf_keys import arch_value

    return int(arch_value(model, "expert_used_count"))


def random_sidecar(model: Path, ahead: int, path: Path, seed: int) -> Path:
    """A learned-predictor sidecar for ``model`` with random weights (bit-identity does not depend
    on what the predictor predicts, only on its running), written to ``path``; it names ``model``
    (learned.model_identity), as llama.cpp requires."""
    from ..grow.gguf_keys import arch_value
    from ..learned import LearnedLayer, LearnedPredictor, model_identity, write_learned

    n_layer, n_embd, n_expert = (int(arch_value(model, k)) for k in ("block_count", "embedding_length", "expert_count"))
    rng = np.random.default_rng(seed)
    layers = {
        il: LearnedLayer(
            rng.standard_normal((n_expert, n_embd), dtype=np.float32), rng.standard_normal(n_expert, dtype=np.float32)
        )
        for il in range(ahead, n_layer)
    }
    arch, router_hash = model_identity(model)
    pred = LearnedPredictor(ahead, n_embd, n_expert, "onebit-bitident random", "chunks", 0, arch, router_hash, layers)
    write_learned(path, pred)
    return path


def run_env(
    mode: str, trace: Path | None, leak: bool, learned: Path | None = None, keep_cap: int | None = None
) -> dict[str, str | None]:
    """The predictor's whole environment for one run: every variable libllama reads is set or
    cleared here, so nothing is inherited from the caller (the off reference has none set, and
    so builds exactly the unpatched graph); ``learned``: the sidecar of a learned mode;
    ``keep_cap``: the experts a ``+lru`` mode's LRU holds (required there)."""
    spec = parse_mode(mode)
    if spec.keeps and keep_cap is None:
        raise ValueError(f"mode {mode!r}: +lru and +anon need the LRU's capacity (keep_cap)")
    env: dict[str, str | None] = dict.fromkeys(ENV_ALL)
    env[ENV_MODE] = None if spec.predictor == "off" else spec.predictor
    env[ENV_AHEAD] = str(spec.ahead) if "@" in mode else None
    env[ENV_PREFETCH] = spec.consumer
    env[ENV_PREFETCH_ROUTE] = "1" if spec.route else None
    # the room rule off with route: resident, the model fits and route would idle, reading nothing
    env[ENV_PREFETCH_ROOM] = "0" if spec.route else None
    env[ENV_PREFETCH_RANDOM] = "1" if spec.exact else None
    env[ENV_PREFETCH_WAIT] = "1" if spec.wait else None
    env[ENV_PREFETCH_KEEP] = KEEP_NAMES[spec.keep] if spec.keeps else None
    env[ENV_PREFETCH_DEBUG_KEEP_CAP] = str(keep_cap) if spec.keeps else None
    env[ENV_PREFETCH_ORDER] = "hits" if spec.hits else None
    env[ENV_PREFETCH_LAYERS] = str(LAYERS) if spec.layers else None
    env[ENV_OUT] = str(trace) if trace else None
    env[ENV_DEBUG_LEAK] = DEBUG_LEAK_UNCHECKED if leak else None
    env[ENV_LEARNED] = str(learned) if spec.predictor == "learned" and learned is not None else None
    return env


def run_once(
    model: Model, scenario: Scenario, mode: str, trace: Path | None, leak: bool, seed: int, learned: Path | None = None
) -> RunOutput:
    """Feed the scenario's tokens through one fresh context with the given mode (``+lru``: the
    LRU held to n_expert_used + KEEP_CAP_EXTRA experts, recorded in the output's keep_cap)."""
    keep_cap = n_expert_used(model.path) + KEEP_CAP_EXTRA if parse_mode(mode).keeps else None
    env = run_env(mode, trace, leak, learned, keep_cap)
    toks = builtin_tokens(max(2 * N_PREFILL, N_PROMPT_BIG) + 2 * N_DECODE, model.n_vocab, seed)
    out = RunOutput(keep_cap=keep_cap)
    with Context(model, scenario.settings, env) as ctx:
        FEEDS[scenario.feed](ctx, out, toks)
        if mode != "off":
            out.stats = context_stats(llama(), ctx.ptr)
    return out


def route_problem(
    stats: dict[str, int] | None, spec: ModeSpec | None = None, keep_cap: int | None = None
) -> str | None:
    """Why the context's counters do not show route time at work as ``spec`` asks (None: plain
    ``route``), or None: it routes and looked at the routed experts, with no failed read; ``wait``
    1 exactly with +wait; ``keep`` 1 exactly with +lru, which must also have evicted (its
    capacity ``keep_cap`` when given) and, with a predictor, have skipped or paged out a guess."""
    spec = spec or ModeSpec("off", 1, None, route=True)
    if stats is None or not stats["route"]:
        return "ONEBIT_MOE_PREFETCH_ROUTE=1 was asked for, the context does not read at route time"
    if stats["route_bytes"] + stats["route_resident"] == 0:
        return "the route-time op looked at no routed expert"
    if stats["prefetch_failed"]:
        return f"the consumer had {stats['prefetch_failed']} failed range(s)"
    return keep_wait_problem(stats, spec, keep_cap)


def keep_wait_problem(stats: dict[str, int], spec: ModeSpec, keep_cap: int | None = None) -> str | None:
    """Why the counters' ``wait``, ``order``, ``layers`` and ``keep`` are not those ``spec`` asks for, or
    None: +hits must have marked expert matmuls and, with +lru (whose page-outs leave routed experts
    being read when their matmuls start), have taken them out of index order at least once."""
    if stats.get("wait", 0) != int(spec.wait):
        asked = "was asked for" if spec.wait else "was not asked for"
        return f"ONEBIT_MOE_PREFETCH_WAIT=1 {asked}, the context's counters show wait {stats.get('wait')}"
    if stats.get("keep", 0) != spec.keep:
        ran = KEEP_NAMES.get(stats.get("keep", 0), "?")
        asked = f"={KEEP_NAMES[spec.keep]} was asked for" if spec.keeps else f"={ran} was not asked for"
        return f"ONEBIT_MOE_PREFETCH_KEEP{asked}, the context's counters show keep {stats.get('keep')}"
    if stats.get("order", 0) != int(spec.hits):
        asked = "was asked for" if spec.hits else "was not asked for"
        return f"ONEBIT_MOE_PREFETCH_ORDER=hits {asked}, the context's counters show order {stats.get('order')}"
    if stats.get("layers", 0) != (LAYERS if spec.layers else 0):
        asked = f"={LAYERS} was asked for" if spec.layers else " was not asked for"
        return f"ONEBIT_MOE_PREFETCH_LAYERS{asked}, the context's counters show layers {stats.get('layers')}"
    if spec.hits:
        if stats["order_marked"] == 0:
            return "ONEBIT_MOE_PREFETCH_ORDER=hits ran no expert matmul marked"
        if spec.anon and stats["order_waiting"] == 0:
            # keep=anon marks its matmuls to wait for its reads: ggml-cpu counts each run that read the mark
            return "ONEBIT_MOE_PREFETCH_KEEP=anon with ORDER=hits: no expert matmul read the waiting mark (ggml-cpu's)"
    if spec.keeps:
        if keep_cap is not None and stats["keep_capacity"] != keep_cap:
            got = stats["keep_capacity"]
            return f"the LRU was held to {keep_cap} experts, the context's counters show capacity {got}"
        if stats["keep_evicted"] == 0:
            return f"ONEBIT_MOE_PREFETCH_KEEP={KEEP_NAMES[spec.keep]} evicted nothing: the LRU was never exercised"
        if spec.predictor != "off" and stats["spec_skipped"] + stats["spec_unused"] == 0:
            return "the predictor's guesses never met the LRU's room for them (none skipped, none paged out)"
    return None


def knob_problem(h: TraceHeader, spec: ModeSpec) -> str | None:
    """Why the header's call and route-time flags are not those ``spec`` asks for, or None: the
    call (route alone: read), route, random (+exact) and wait (+wait), each set exactly when asked."""
    if h.prefetch_name != spec.call:
        return f"ONEBIT_MOE_PREFETCH={spec.call} was asked for, the trace records {h.prefetch_name}"
    for name, got, want in (("route", h.route, spec.route), ("random (+exact)", h.random, spec.exact),
                            ("wait", h.wait, spec.wait)):  # fmt: skip
        if got != want:
            asks = "asks for" if want else "does not ask for"
            return f"the trace's {name} flag is {'set' if got else 'clear'}, the mode {asks} it"
    return None


def _ran_suffix(h: TraceHeader, spec: ModeSpec) -> str:
    """The mode's route part as the header records it (+lru: from the counters, check_model)."""
    quals = [q for q, on in (("exact", h.random), ("wait", h.wait)) if on]
    return ("+" + ROUTE if h.route else "") + "".join("+" + q for q in quals)


def first_mismatch(a: list[bytes], b: list[bytes]) -> Mismatch | None:
    """The first row/vocab index whose bytes differ (rows of float32 logits)."""
    for i, (ra, rb) in enumerate(zip(a, b)):
        if ra != rb:
            xa = np.frombuffer(ra, dtype=np.float32)
            xb = np.frombuffer(rb, dtype=np.float32)
            j = int(np.flatnonzero(xa.view(np.uint32) != xb.view(np.uint32))[0])
            return Mismatch(i, j, float(xa[j]), float(xb[j]))
    if len(a) != len(b):
        return Mismatch(min(len(a), len(b)), -1, float("nan"), float("nan"))
    return None


def consumer_problem(trace: Trace, consumer: str) -> str | None:
    """Why the trace does not show the consumer at work, or None."""
    h = trace.header
    if h.prefetch_name != consumer:
        return f"ONEBIT_MOE_PREFETCH={consumer} was asked for, the trace records {h.prefetch_name}"
    t = h.prefetch_totals
    if t is None:
        return "the trace holds no prefetch totals (the context was not freed cleanly)"
    if t.experts == 0:
        return "the prefetch consumer issued nothing"
    if t.failed:
        return f"the prefetch consumer had {t.failed} failed range(s) (errno, ranges: {t.errors})"
    return None


def settings_problem(h: TraceHeader, predictor: str, leak: bool, ahead: int = 1) -> str | None:
    """Why the header shows a run other than the one asked for, or None: the mode (block falls
    back to router where it cannot run), the lookahead asked for, every other knob at its
    default, and the negative control applied exactly when it was asked for."""
    if h.mode_name != predictor:
        return f"{predictor} was asked for, the trace records {h.mode_name} (see the notice above)"
    defaults = {
        "ahead": (h.ahead, ahead),
        "depth": (h.depth_requested, 0),
        "margin": (h.margin, float("inf")),
        "min": (h.min_read, min(h.n_expert_used, h.depth)),
        "no_attn": (h.no_attn, False),
        "debug_self": (h.debug_self, False),
        "layers": (sorted(h.layer_mask), list(range(ahead, h.n_layer))),
    }
    for name, (got, want) in defaults.items():
        if got != want:
            return f"the trace records {name} {got}, the check sets {want}: the run was not the one asked for"
    if h.debug_leak != leak or h.graph_check_off != leak:
        state = "applied" if h.debug_leak else "not applied"
        return f"the negative control was {'asked for' if leak else 'not asked for'} and is {state} in this run"
    return None


def prediction_problem(
    path: Path, n_routed: int, consumer: str | None = None, ahead: int = 1
) -> tuple[int, str | None, str]:
    """(PREDICTED records, why the trace proves too little or None, the mode it ran) for a
    run of n_routed rows.

    Every predicted layer that routes (a MoE layer) must hold exactly n_routed records, all
    PREDICTED at distance ``ahead``; at least one such layer must exist. With a consumer,
    consumer_problem too.
    """
    trace = Trace.open(path)
    n_layer = trace.header.n_layer
    records = np.zeros(n_layer, dtype=np.int64)
    predicted = np.zeros(n_layer, dtype=np.int64)
    for chunk in trace.iter_chunks():
        records += np.bincount(chunk["layer"], minlength=n_layer)[:n_layer]
        hit = ((chunk["flags"] & TRACE_FLAG_PREDICTED) != 0) & (chunk["distance"] == ahead)
        predicted += np.bincount(chunk["layer"][hit], minlength=n_layer)[:n_layer]
    layers = [il for il in sorted(trace.header.layer_mask) if il < n_layer and records[il] > 0]
    total = int(predicted.sum())
    ran = MODE_NAMES.get(trace.header.mode, "?") + (f"@{trace.header.ahead}" if trace.header.ahead != 1 else "")
    if consumer is not None:
        ran += "+" + trace.header.prefetch_name
        problem = consumer_problem(trace, consumer)
        if problem is not None:
            return total, problem, ran
    if not layers:
        return total, "the trace holds no record of a predicted layer: nothing was predicted", ran
    for il in layers:
        if records[il] != n_routed or predicted[il] != n_routed:
            return (
                total,
                (
                    f"layer {il}: {predicted[il]} predicted {ahead} layer(s) ahead of {records[il]} records, "
                    f"{n_routed} rows were routed"
                ),
                ran,
            )
    return total, None, ran


def run_problem(
    path: Path, n_routed: int, mode: str, leak: bool, stats: dict[str, int] | None = None
) -> tuple[int, str | None, str]:
    """prediction_problem, after the header has shown that the run was the one asked for
    (settings_problem, and knob_problem: the call and route time's flags): a mode that did not
    run as asked, or a control that was not applied, fails with the reason. A trace not written
    whole fails first, with written_problem's reason. The mode it ran ends in ``+lru``, ``+hits`` and
    ``+layers`` where the context's counters ``stats`` (when given) show the LRU, the order and the layers
    ahead on: the header records none of them."""
    written = written_problem(path)
    if written is not None:
        return 0, written, mode
    spec = parse_mode(mode)
    header = Trace.open(path).header
    keep = KEEP_NAMES.get(stats.get("keep", KEEP_KERNEL), "?") if stats else "kernel"
    counted = ("" if keep == "kernel" else f"+{keep}") + "".join(
        f"+{q}" for q, key in (("hits", "order"), ("layers", "layers")) if stats and stats.get(key)
    )
    if spec.predictor == "off":  # route time alone: nothing predicted, the predictor off as asked
        ran = MODE_NAMES.get(header.mode, "?")
        if ran != "off":
            return 0, f"the predictor off was asked for, the trace records {ran}", ROUTE
        # route alone records route time's own call (read): named only where the mode named one, or it differs
        named = spec.consumer is not None or header.prefetch_name != spec.call
        ran = (header.prefetch_name + "+" if named else "") + (_ran_suffix(header, spec) + counted).lstrip("+")
        return 0, knob_problem(header, spec), ran or "off"
    predicted, problem, ran = prediction_problem(path, n_routed, spec.consumer, spec.ahead)
    settings = settings_problem(header, spec.predictor, leak, spec.ahead)
    return predicted, settings or knob_problem(header, spec) or problem, ran + _ran_suffix(header, spec) + counted


def reordered_problem(mode: str, n_reordered: int) -> str | None:
    """+lru+hits over a model's scenarios: the LRU pages experts out, so a routed one is read while its
    layer's matmuls start, and ggml-cpu must have taken a resident one before it at least once
    (``n_reordered``, the counters' order_reordered summed over the scenarios). Counted over them, not
    per run: in one scenario every read can come in before its matmuls (a tiny model on a fast disk)."""
    spec = parse_mode(mode)
    if spec.lru and spec.hits and n_reordered == 0:
        return (
            "ONEBIT_MOE_PREFETCH_ORDER=hits never took the experts out of index order in any scenario"
            " (ggml-cpu's mark unread?)"
        )
    return None


def check_model(
    model: Model,
    scenarios: Sequence[Scenario] = SCENARIOS,
    modes: Sequence[str] = MODES,
    leak: bool = False,
    seed: int = 0,
    trace_dir: Path | None = None,
) -> list[ModeResult]:
    """Run every scenario off and with each mode; compare bytes and verify predictions were made."""
    results = []
    reordered: dict[str, int] = {}  # +lru+hits: runs out of index order, over the scenarios (reordered_problem)
    with tempfile.TemporaryDirectory(prefix="onebit-bitident-") as tmp:
        traces = trace_dir or Path(tmp)
        sidecars = {
            mode: random_sidecar(model.path, mode_ahead(mode), Path(tmp) / f"learned-{mode}.gguf", seed)
            for mode in modes
            if parse_mode(mode).predictor == "learned"
        }
        for sc in scenarios:
            ref = run_once(model, sc, "off", None, False, seed)
            for mode in modes:
                path = traces / f"{sc.name.replace(' ', '_').replace('+', '_')}-{mode}.bin"
                leaky = leak and mode == "block"
                out = run_once(model, sc, mode, path, leaky, seed, sidecars.get(mode))
                predicted, problem, ran = run_problem(path, out.n_routed, mode, leaky, out.stats)
                spec = parse_mode(mode)
                if problem is None and spec.route:
                    problem = route_problem(out.stats, spec, out.keep_cap)
                elif problem is None and out.stats is not None:
                    problem = keep_wait_problem(out.stats, spec)
                if problem is None and spec.layers and sc.feed == "big-prompt" and out.stats["layers_ops"] == 0:
                    # ubatches of 64 route nearly every expert: a batch there must have read ahead
                    problem = "ONEBIT_MOE_PREFETCH_LAYERS: no batch read a layer ahead in ubatches of 64"
                if problem is None and spec.anon and sc.feed == "big-prompt" and out.stats["keep_streamed"] == 0:
                    # ubatches of 64 route more of a layer than the LRU's share of 6 experts: keep anon streams it
                    problem = "ONEBIT_MOE_PREFETCH_KEEP=anon: no batch streamed a layer in ubatches of 64"
                if problem is None and spec.anon and sc.feed == "next-request" and out.stats["keep_given_back"] == 0:
                    # the decode held experts, and the prompt's first ubatch is larger than any before
                    problem = "ONEBIT_MOE_PREFETCH_KEEP=anon: nothing given back before a ubatch larger than any before"
                mismatch = first_mismatch(ref.rows, out.rows)
                results.append(ModeResult(sc.name, mode, ran, mismatch, predicted, problem))
                reordered[mode] = reordered.get(mode, 0) + (out.stats or {}).get("order_reordered", 0)
    for mode in modes:
        problem = reordered_problem(mode, reordered.get(mode, 0))
        last = max((i for i, r in enumerate(results) if r.mode == mode), default=None)
        if problem is not None and last is not None and results[last].problem is None:
            results[last] = replace(results[last], problem=problem)
    return results
