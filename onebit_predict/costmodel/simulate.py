"""A decode-time model of a streamed expert pipeline, played on a trace's routing.

Deterministic and event-ordered; every rule is in docs/cost-model.md. In short:

- the drive: one FIFO queue. Read i, issued at a_i, enters service at
  s_i = max(a_i, c_{i-Q}) (at most Q reads in service), its data starts to flow at
  x_i = max(s_i + latency, c_{i-1}) (latencies overlap, transfers share the bandwidth one
  after another) and it completes at c_i = x_i + bytes / bandwidth;
- a layer l: it starts when the previous one ends; after ``route_at`` of its compute time
  (attention, norms, router; plus the predictor's cost on layers that predict one) its
  routing is known: at that instant R its missing experts are read on demand and the
  prediction for layer l+K is issued (K: the trace's lookahead, 1 before trace version 3;
  its prefetch reads queue behind the demand reads). The rest of its compute starts when all
  its experts are in memory (the wait is a demand stall) and ends the layer;
- the cache: onebit_predict.replay with charged prefetch (a prefetch takes a slot and a
  read); its decisions do not depend on time, so one replay serves every bandwidth. With
  ``cache.cold`` it is emptied before every token (``onebit-bench --cold``): only the same
  token's prefetch can bring a hit;
- tokens run one after another; the time of a token is the sum of its layers.

Predictors: ``none`` (demand reads only), ``previous-token`` (A of the same layer at the
previous token of the same sequence), the trace's own (``router`` or ``block``, its read
set), ``oracle`` (A itself). All are issued at the same instant and cover the same layers
(the trace's predicted layers), so they differ only in what they predict.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from .replay import KIND_PREFETCH, CacheConfig, CacheCounts, LayerReplay, replay_layer
from .routing import Routing

PRED_NONE = "none"
PRED_PREVIOUS = "previous-token"
PRED_ORACLE = "oracle"


@dataclass(frozen=True)
class DriveModel:
    bandwidth: float  # bytes per second
    latency_ms: float
    queue_depth: int

    def __post_init__(self) -> None:
        if not self.bandwidth > 0:
            raise ValueError(f"bandwidth must be positive, not {self.bandwidth}")
        if not self.latency_ms >= 0:
            raise ValueError(f"latency must be >= 0, not {self.latency_ms}")
        if self.queue_depth < 1:
            raise ValueError(f"queue depth must be at least 1, not {self.queue_depth}")


@dataclass(frozen=True)
class ComputeModel:
    layer_ms: float  # compute time of one layer for one token
    route_at: float  # fraction of it done before the router has run
    predictor_cost_pct: float = 0.0  # the trace predictor's cost, % of a token's compute

    def __post_init__(self) -> None:
        if not self.layer_ms >= 0:
            raise ValueError(f"layer time must be >= 0 ms, not {self.layer_ms}")
        if not 0 <= self.route_at <= 1:
            raise ValueError(f"route_at must be in [0, 1], not {self.route_at}")
        if not self.predictor_cost_pct >= 0:
            raise ValueError(f"predictor cost must be >= 0 %, not {self.predictor_cost_pct}")


class Drive:
    """The FIFO drive queue: ``read(issue_ms, nbytes)`` -> completion time (ms)."""

    def __init__(self, model: DriveModel) -> None:
        self.model = model
        self._bytes_per_ms = model.bandwidth / 1000.0
        self._completions: deque[float] = deque(maxlen=model.queue_depth)
        self._last = 0.0

    def read(self, issue_ms: float, nbytes: float) -> float:
        q = self._completions
        enter = max(issue_ms, q[0]) if len(q) == q.maxlen else issue_ms  # q[0] is c_{i-Q}
        flow = max(enter + self.model.latency_ms, self._last)
        done = flow + nbytes / self._bytes_per_ms
        q.append(done)
        self._last = done
        return done


@dataclass(frozen=True)
class PredictorRun:
    """One predictor at one bandwidth."""

    predictor: str
    bandwidth: float
    tokens: int
    total_ms: float
    cost_ms: float  # the predictor's compute, summed over the run
    bytes_read: float
    bytes_wasted: float  # prefetch reads the token they were issued for did not demand
    stalls: int  # (layer, token) pairs that waited for a read
    stall_ms: float
    late: int  # demanded experts that were resident but still being read
    counts: CacheCounts

    @property
    def tok_s(self) -> float | None:
        return 1000.0 * self.tokens / self.total_ms if self.total_ms > 0 else None

    def per_token(self, x: float) -> float | None:
        return x / self.tokens if self.tokens else None


@dataclass(frozen=True, eq=False)
class SimResult:
    routing: Routing
    cache: CacheConfig
    compute: ComputeModel
    latency_ms: float
    queue_depth: int
    expert_bytes: dict[int, float]
    predictors: tuple[str, ...]
    layer_counts: dict[str, dict[int, CacheCounts]]  # predictor -> layer -> counts
    runs: tuple[PredictorRun, ...]  # bandwidth-major, predictors in order
    cost_layers: dict[int, float] = field(default_factory=dict)  # layer -> predictor ms it pays

    def run(self, predictor: str, bandwidth: float) -> PredictorRun:
        return next(r for r in self.runs if r.predictor == predictor and r.bandwidth == bandwidth)

    @property
    def bandwidths(self) -> tuple[float, ...]:
        return tuple(dict.fromkeys(r.bandwidth for r in self.runs))

    def values(self, predictor: str, bandwidth: float) -> dict[str, float | int | None]:
        """One run's figures per token, its speedup over none and "spent, saved" (spent_saved)."""
        r = self.run(predictor, bandwidth)
        base = self.run(PRED_NONE, bandwidth)
        ss = spent_saved(self, r)
        return {
            "hit_rate": r.counts.hit_rate,
            "late_per_token": r.per_token(r.late),
            "tok_s": r.tok_s,
            "bytes_read_per_token": r.per_token(r.bytes_read),
            "bytes_wasted_per_token": r.per_token(r.bytes_wasted),
            "stalls_per_token": r.per_token(r.stalls),
            "stall_ms_per_token": r.per_token(r.stall_ms),
            "speedup": base.total_ms / r.total_ms if r.total_ms > 0 else None,
            "spent_pct": None if ss is None else ss[0],
            "saved_pct": None if ss is None else ss[1],
        }


def predictor_names(routing: Routing) -> tuple[str, ...]:
    """The predictors a trace supports, in report order."""
    names = [PRED_NONE, PRED_PREVIOUS]
    if routing.has_predictor:
        names.append(routing.header.mode_name)
    return (*names, PRED_ORACLE)


def predictions(routing: Routing, predictor: str) -> dict[int, np.ndarray | None]:
    """Each layer's predicted ids for ``predictor`` (None: that layer is not predicted)."""
    out: dict[int, np.ndarray | None] = {}
    for layer, lr in routing.layers.items():
        if predictor == PRED_NONE or layer not in routing.predicted_layers:
            out[layer] = None
        elif predictor == PRED_PREVIOUS:
            out[layer] = lr.prev
        elif predictor == PRED_ORACLE:
            out[layer] = lr.actual
        elif predictor == routing.header.mode_name:
            out[layer] = lr.trace_pred
        else:
            raise ValueError(f"unknown predictor '{predictor}'")
    return out


def cost_per_layer(routing: Routing, compute: ComputeModel) -> dict[int, float]:
    """ms the trace's predictor adds to each layer that predicts the next one.

    The cost is given as a share of a token's compute (``n_layers * layer_ms``, the way
    onebit-bench measures it) and spread evenly over the layers l whose layer l+K is predicted
    (K: the trace's lookahead, ``header.ahead``).
    """
    if compute.predictor_cost_pct == 0 or not routing.has_predictor:
        return {}
    k = routing.header.ahead
    predicting = [
        layer for layer in routing.layers if layer + k in routing.predicted_layers and layer + k in routing.layers
    ]
    if not predicting:
        return {}
    per_token = compute.predictor_cost_pct / 100.0 * len(routing.layers) * compute.layer_ms
    return {layer: per_token / len(predicting) for layer in predicting}


def time_run(
    routing: Routing,
    replays: dict[int, LayerReplay],
    expert_bytes: dict[int, float],
    drive_model: DriveModel,
    compute: ComputeModel,
    cost_layers: dict[int, float],
    predictor: str,
) -> PredictorRun:
    """Play a replay's read schedule on the drive, token by token, layer by layer; layer l's
    routing instant issues the prefetch of layer l+K (K: the trace's lookahead, for every
    predictor alike)."""
    layers = sorted(replays)
    ahead = routing.header.ahead
    # plain Python lists: this loop touches a few items per (token, layer), where numpy's
    # per-call overhead would dominate
    local = {layer: routing.local_index(layer).tolist() for layer in layers}
    starts = {layer: r.start.tolist() for layer, r in replays.items()}
    n_pf = {layer: r.n_prefetch.tolist() for layer, r in replays.items()}
    serve = {layer: r.serve.tolist() for layer, r in replays.items()}
    hit = {layer: r.hit.tolist() for layer, r in replays.items()}
    done = {layer: [0.0] * len(r.load_expert) for layer, r in replays.items()}
    pf_issued = {layer: [False] * r.counts.tokens for layer, r in replays.items()}
    drive = Drive(drive_model)
    before = compute.route_at * compute.layer_ms
    after = compute.layer_ms - before

    def issue_prefetch(layer: int, i: int, at: float) -> None:
        d, nbytes, s0 = done[layer], expert_bytes[layer], starts[layer][i]
        for x in range(s0, s0 + n_pf[layer][i]):
            d[x] = drive.read(at, nbytes)
        pf_issued[layer][i] = True

    t = cost_ms = stall_ms = 0.0
    stalls = late = 0
    for k in range(routing.n_tokens):
        for layer in layers:
            i = local[layer][k]
            if i < 0:
                continue
            if not pf_issued[layer][i]:  # no earlier layer ran this token: issue at the layer's start
                issue_prefetch(layer, i, t)
            cost = cost_layers.get(layer, 0.0)
            cost_ms += cost
            routed = t + before + cost
            d, nbytes = done[layer], expert_bytes[layer]
            for x in range(starts[layer][i] + n_pf[layer][i], starts[layer][i + 1]):
                d[x] = drive.read(routed, nbytes)
            nxt = layer + ahead
            if nxt in replays:
                j = local[nxt][k]
                if j >= 0:
                    issue_prefetch(nxt, j, routed)
            ready = routed
            for x, was_hit in zip(serve[layer][i], hit[layer][i]):
                c = d[x]
                if c > routed:
                    late += was_hit
                    if c > ready:
                        ready = c
            if ready > routed:
                stalls += 1
                stall_ms += ready - routed
            t = ready + after
    read = wasted = 0.0
    for layer, r in replays.items():
        read += len(r.load_kind) * expert_bytes[layer]
        wasted += int(np.count_nonzero((r.load_kind == KIND_PREFETCH) & ~r.load_useful)) * expert_bytes[layer]
    counts = sum((r.counts for r in replays.values()), CacheCounts())
    return PredictorRun(
        predictor, drive_model.bandwidth, routing.n_tokens, t, cost_ms, read, wasted, stalls, stall_ms, late, counts
    )


def simulate(
    routing: Routing,
    expert_bytes: dict[int, float],
    cache: CacheConfig,
    compute: ComputeModel,
    bandwidths: list[float],
    latency_ms: float,
    queue_depth: int,
    predictors: tuple[str, ...] | None = None,
) -> SimResult:
    """Every predictor at every bandwidth; ``cache.prefetch`` is set per predictor (charged).

    ``cache.cold`` (kept for every predictor) empties every layer's cache before each token.
    """
    missing = sorted(set(routing.layers) - set(expert_bytes))
    if missing:
        raise ValueError(f"no expert bytes for layers {missing} (the model has no expert tensors there)")
    drives = [DriveModel(bw, latency_ms, queue_depth) for bw in bandwidths]
    names = predictor_names(routing) if predictors is None else predictors
    cost_layers = cost_per_layer(routing, compute)
    layer_counts: dict[str, dict[int, CacheCounts]] = {}
    replays: dict[str, dict[int, LayerReplay]] = {}
    for name in names:
        cfg = replace(cache, prefetch="none" if name == PRED_NONE else "trace")
        pred = predictions(routing, name)
        replays[name] = {layer: replay_layer(lr.actual, pred[layer], cfg) for layer, lr in routing.layers.items()}
        layer_counts[name] = {layer: r.counts for layer, r in replays[name].items()}
    runs = []
    for dm in drives:
        for name in names:
            costs = cost_layers if name == routing.header.mode_name and routing.has_predictor else {}
            runs.append(time_run(routing, replays[name], expert_bytes, dm, compute, costs, name))
    return SimResult(
        routing,
        cache,
        compute,
        latency_ms,
        queue_depth,
        expert_bytes,
        tuple(names),
        layer_counts,
        tuple(runs),
        cost_layers,
    )


def spent_saved(result: SimResult, run: PredictorRun) -> tuple[float, float] | None:
    """("spent", "saved") in % of the no-prediction run's time at the same bandwidth.

    spent: the predictor's compute; saved: the net reduction of the run's time (the cost
    already paid). None when the no-prediction run took no time.
    """
    base = result.run(PRED_NONE, run.bandwidth)
    if base.total_ms <= 0:
        return None
    return 100.0 * run.cost_ms / base.total_ms, 100.0 * (base.total_ms - run.total_ms) / base.total_ms
