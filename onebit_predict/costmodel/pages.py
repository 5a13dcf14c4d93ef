"""A page-granular decode-time model: demand faults as the kernel reads them, prefetches as the requests they are.

The expert model of simulate.py reads an expert as one request into a slot of its layer.
The engines this project measures do something else: llama.cpp maps the GGUF, a missing
expert page is a **major fault** that reads what the kernel's readahead decides (one page
under ``MADV_RANDOM``, as ``onebit-bench --cold`` sets it; a read-around window otherwise),
into the **page cache**, which under ``onebit-bench --memory-limit`` is one LRU for the
whole process, bounded by the memory cgroup. The prefetch consumer hands each predicted
expert's byte ranges to worker threads, which call ``madvise(MADV_WILLNEED)`` (``advise``:
one asynchronous request for the missing pages of the range, no waiting) or touch every page
(``read``: page faults, readahead included, on the worker threads). Every rule, with what it
leaves out: docs/cost-model.md, "Pages: the page-granular model".

The pieces, each small and tested on its own: where the experts are in the file
(costmodel/layout.py ``ExpertLayout``); the page cache, the drive and the kernel's fault and
readahead rules (costmodel/kernel.py); and here the events: :func:`run_config` plays one
configuration (the predictor off or on, the workers' call off, advise, read or populate, route
time on or off) over a trace's routing, the compute thread and the consumer's workers acting in
time order on one kernel. Layer l hands the consumer the prediction of layer l+K, K the trace's
lookahead (``header.ahead``, as costmodel/simulate.py): its speculative reads. The consumer's room
rule (``PageModel.prefetch_room``, ONEBIT_MOE_PREFETCH_ROOM) holds those off for the whole run when
the page cache is below R x one token's need (:meth:`ExpertLayout.token_need_bytes`). With route
time (ONEBIT_MOE_PREFETCH_ROUTE), right after layer l's router the consumer drops the speculative
ranges still queued for layers <= l and queues, ahead of every speculative one, the ranges of
layer l's selected experts that are not wholly resident (in the page cache, or under I/O: what
mincore sees); the room rule does not hold it. With its wait (ONEBIT_MOE_PREFETCH_WAIT) the compute
thread then waits for the last of those ranges before the layer's matmuls. With hits first
(ONEBIT_MOE_PREFETCH_ORDER=hits) the route-time op queues those ranges tensor by tensor and each expert
matmul takes its experts by how much of their slice is in the page cache when it starts. ``populate``
(MADV_POPULATE_READ) plays as ``read``.
costmodel/page_check.py plays the configurations of a report with it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import numpy as np

from ..constants import PREFETCH_THREADS_DEFAULT, TRACE_FLAG_DECODE, TRACE_FLAG_PREDICTED
from ..trace import Trace
from .drive_rates import DriveRates
from .engine import Engine, fitted_layout, page_drive
from .keep import ExpertLRU, keep_capacity
from .kernel import PAGE_CACHES, Kernel, KernelCounts
from .layout import PAGE_SIZE, ExpertLayout, hits_first
from .routing import Routing
from .row_config import CONSUMERS, ORACLE

# the workers' call of route-time reads when the consumer names none (C ONEBIT_PREFETCH_ROUTE_CALL: read);
# populate (MADV_POPULATE_READ faults every page of the range in, readahead included) plays as read
ROUTE_CALL = "read"
AS_CALL = {"off": "off", "advise": "advise", "read": "read", "populate": "read", "pread": "pread"}


@dataclass(frozen=True)
class PageModel:
    """Everything but the routing: the drive, the compute, the cache, the kernel's readahead."""

    bandwidth: float  # bytes per second
    latency_ms: float
    queue_depth: int
    layer_ms: float  # compute of one layer with its experts resident
    route_at: float  # share of it before the router (attention, norms, router)
    capacity_pages: int | None  # page cache for the expert pages (None: unbounded)
    window_pages: int  # a major fault's read-around (0: MADV_RANDOM)
    cold: bool = False  # every expert page evicted before each token (onebit-bench --cold)
    page_cache: str = "lru"  # lru or two-list (PAGE_CACHES)
    predictor_cost_ms: float = 0.0  # per token, spread over the layers that predict
    op_ms: float = 0.0  # the consumer's op on the compute thread, per predicted layer
    fault_ms: float = 0.0  # CPU cost of a major fault beyond the drive's latency
    workers: int = PREFETCH_THREADS_DEFAULT  # the consumer's worker threads (ONEBIT_MOE_PREFETCH_THREADS)
    drain: bool = True  # --cold read mode: each token waits for its own reads (the benchmark's DEBUG_DRAIN)
    prefill: bool = True  # replay the trace's prefill rows first, untimed (they fill the page cache)
    page_size: int = PAGE_SIZE
    max_request_bytes: int | None = None  # a drive request's largest (FUSE's max_read); None: no limit
    random_experts: bool = False  # MADV_RANDOM on the expert tensors (the consumer's random): no read-around there
    # the consumer's room rule (ONEBIT_MOE_PREFETCH_ROOM=R): it issues nothing while the page cache the
    # process can have (here capacity_pages; unbounded: never) is below R x the mapped bytes one token
    # reads (ExpertLayout.token_need_bytes); 0: no rule (the model's default: the runs measured before it)
    prefetch_room: float = 0.0
    drive_rates: DriveRates | None = None  # the drive as fio times it (its rate by request size and depth)

    def __post_init__(self) -> None:
        if not self.layer_ms >= 0:
            raise ValueError(f"layer time must be >= 0 ms, not {self.layer_ms}")
        if not 0 <= self.route_at <= 1:
            raise ValueError(f"route_at must be in [0, 1], not {self.route_at}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")
        if self.max_request_bytes is not None and self.max_request_bytes < self.page_size:
            raise ValueError(f"a request's largest size must be at least a page, not {self.max_request_bytes}")
        if not (self.prefetch_room >= 0 and math.isfinite(self.prefetch_room)):
            raise ValueError(f"prefetch room must be a finite number >= 0, not {self.prefetch_room}")

    def room_bytes(self) -> int | None:
        """The page cache the process can have (None: unbounded, no limit)."""
        return None if self.capacity_pages is None else self.capacity_pages * self.page_size

    def room_holds(self, need_bytes: int) -> bool:
        """The room rule holds the consumer off: room < prefetch_room x need (constant over a run:
        the model's room is the limit minus the process bytes, both fixed)."""
        room = self.room_bytes()
        return self.prefetch_room > 0 and room is not None and room < self.prefetch_room * need_bytes


@dataclass(frozen=True)
class PageRun:
    """One configuration's simulated decode."""

    name: str
    predictor: bool
    consumer: str
    tokens: int
    total_ms: float
    counts: KernelCounts
    token_ms: tuple[float, ...]
    stall_ms: float  # compute thread waiting for pages
    evicted_pages: int
    prefetch_ranges: int
    prefill_counts: KernelCounts = field(default_factory=KernelCounts)
    page_size: int = PAGE_SIZE
    need_bytes: int = 0  # one token's mapped bytes (the room rule's need)
    room_held: bool = False  # the room rule held the consumer's speculative reads off (it issued none)
    route: bool = False  # route-time reads
    route_ranges: int = 0  # ranges the route-time ops queued (decode)
    route_missing_pages: int = 0  # pages of the routed experts not resident when routed (decode)
    stale_ranges: int = 0  # speculative ranges a route-time op dropped, still queued for its layer or before
    keep: bool = False  # route time's expert LRU (ONEBIT_MOE_PREFETCH_KEEP=lru)
    keep_capacity: int | None = None  # ... the experts it held at most (None: no limit, it never evicts)
    keep_evicted: int = 0  # ... the experts it evicted (decode)
    wait: bool = False  # the route-time op waits for its layer's reads (ONEBIT_MOE_PREFETCH_WAIT=1)
    route_wait_ms: float = 0.0  # ... the compute thread's time in those waits (decode)
    spec_skipped: int = 0  # with the LRU and a predictor: guesses not read, their room full (decode)
    spec_unused: int = 0  # ... guesses read and not routed, paged out at their layer's route (decode)
    order: bool = False  # route time's hits first (ONEBIT_MOE_PREFETCH_ORDER=hits)

    @property
    def tok_s(self) -> float | None:
        return 1000.0 * self.tokens / self.total_ms if self.total_ms > 0 else None

    def per_token(self, x: float) -> float | None:
        return x / self.tokens if self.tokens else None

    @property
    def read_bytes(self) -> int:
        return self.counts.pages_read * self.page_size


@dataclass(frozen=True)
class _Step:
    """One (token, layer): the experts it computes and the candidates the consumer reads for layer
    ``target``, the layer it predicts (layer + K, K the trace's lookahead)."""

    layer: int
    demand: tuple[int, ...]
    next_pred: tuple[int, ...] | None  # None: layer ``target`` is not predicted for this token
    target: int


def _steps(routing: Routing, oracle: bool = False) -> list[list[_Step]]:
    """Per decode token, per layer l with a record: the experts, and layer l+K's prediction (the
    trace's read set; with ``oracle``, layer l+K's actual experts), K the trace's lookahead."""
    ahead = routing.header.ahead
    local = {layer: routing.local_index(layer) for layer in routing.layers}
    out = []
    for k in range(routing.n_tokens):
        steps = []
        for layer, lr in routing.layers.items():
            i = int(local[layer][k])
            if i < 0:
                continue
            target = layer + ahead
            nxt = routing.layers.get(target)
            pred = None
            if nxt is not None and target in routing.predicted_layers and routing.has_predictor:
                j = int(local[target][k])
                if j >= 0:
                    ids = (nxt.actual if oracle else nxt.trace_pred)[j].tolist()
                    pred = tuple(int(e) for e in dict.fromkeys(ids) if e >= 0)
            steps.append(_Step(layer, tuple(int(e) for e in lr.actual[i].tolist()), pred, target))
        out.append(steps)
    return out


def prefill_steps(trace: Trace, oracle: bool = False) -> list[_Step]:
    """The prefill rows (not DECODE) as one step per layer l: the union of their experts and of layer
    l+K's predicted read sets (``oracle``: of its actual experts), K the trace's lookahead, as one
    ubatch computes and prefetches them."""
    h = trace.header
    actual: dict[int, set[int]] = {}
    pred: dict[int, set[int]] = {}
    for chunk in trace.iter_chunks():
        flags = chunk["flags"]
        rows = np.flatnonzero((flags & TRACE_FLAG_DECODE) == 0)
        for r in rows.tolist():
            layer = int(chunk["layer"][r])
            actual.setdefault(layer, set()).update(int(e) for e in chunk["actual_ids"][r].tolist())
            if flags[r] & TRACE_FLAG_PREDICTED:
                n = min(int(chunk["n_read"][r]), h.depth)
                ids = chunk["actual_ids"][r] if oracle else chunk["pred_ids"][r][:n]
                pred.setdefault(layer, set()).update(int(e) for e in ids.tolist() if e >= 0)
    k = h.ahead
    steps = []
    for layer in sorted(actual):
        target = tuple(sorted(pred[layer + k])) if layer + k in pred else None
        steps.append(_Step(layer, tuple(sorted(actual[layer])), target, layer + k))
    return steps


def cost_per_layer_ms(steps: Sequence[_Step], cost_ms: float) -> float:
    """The predictor's per-token cost spread over the layers of a token that predict one (layer l+K)."""
    predicting = sum(1 for s in steps if s.next_pred is not None)
    return cost_ms / predicting if predicting else 0.0


class _Sim:
    """One configuration's actors: the compute thread, the consumer's workers, their two queues (the
    route-time ops' ``urgent`` one, which the workers drain first, and the speculative one)."""

    def __init__(
        self,
        kernel: Kernel,
        engine: Engine,
        layout: ExpertLayout,
        call: str,
        n_workers: int,
        speculative: bool,
        route: bool,
        held: bool = False,
    ) -> None:
        self.kernel, self.engine, self.layout, self.call = kernel, engine, layout, call
        self.speculative, self.route = speculative, route
        self.held = held  # the room rule holds the speculative reads off: their op runs, it issues nothing
        self.queue: deque[tuple[float, int, int, int]] = deque()  # (issued, first, end, layer)
        self.urgent: deque[tuple[float, int, int, int]] = deque()
        reads = route or (speculative and not held)
        self.workers = [_Worker(self) for _ in range(n_workers if call != "off" and reads else 0)]
        self.drain_waiter: _Compute | None = None
        self.ranges = self.route_ranges = self.route_missing = self.stale = 0
        self.keep: ExpertLRU | None = None  # route time's expert LRU, when played and the room bounds it
        self.keep_evicted = self.spec_skipped = self.spec_unused = 0  # the LRU's counts, decode only
        self.wait = False  # the route-time op waits for its layer's ranges (ONEBIT_MOE_PREFETCH_WAIT=1)
        self.order = False  # hits first (ONEBIT_MOE_PREFETCH_ORDER=hits): reads tensor by tensor, resident first
        self.outstanding: dict[int, int] = {}  # a layer's route-time ranges queued or being read
        self.layer_waiter: tuple[_Compute, int] | None = None  # the compute thread, waiting on that layer

    def push(self, t: float, ranges: Sequence[tuple[int, int]], layer: int, urgent: bool = False) -> None:
        """An op hands ranges of ``layer`` to the workers at t (``urgent``: a route-time op's)."""
        q = self.urgent if urgent else self.queue
        for first, end in ranges:
            q.append((t, first, end, layer))
        if urgent:
            self.route_ranges += len(ranges)
            self.outstanding[layer] = self.outstanding.get(layer, 0) + len(ranges)
        else:
            self.ranges += len(ranges)
        self.engine.wake(self.workers, t, lambda: bool(self.queue or self.urgent))

    def drop_stale(self, layer: int) -> None:
        """A route-time op at ``layer``: the speculative ranges queued for it or an earlier layer come too late."""
        kept = deque(r for r in self.queue if r[3] > layer)
        self.stale += len(self.queue) - len(kept)
        self.queue = kept

    def idle(self) -> bool:
        return not self.queue and not self.urgent and all(w.asleep for w in self.workers)

    def range_done(self, layer: int, t: float) -> None:
        """A worker finished one of ``layer``'s route-time ranges at t: the last one wakes the compute
        thread waiting on the layer."""
        self.outstanding[layer] -= 1
        if self.outstanding[layer] == 0 and self.layer_waiter is not None and self.layer_waiter[1] == layer:
            c, self.layer_waiter = self.layer_waiter[0], None
            c.t = max(c.t, t)
            self.engine.at(c.t, c.gen)

    def on_worker_idle(self, t: float) -> None:
        if self.drain_waiter is not None and self.idle():
            c, self.drain_waiter = self.drain_waiter, None
            c.t = max(c.t, t)
            self.engine.at(c.t, c.gen)


class _Worker:
    """A consumer worker: ``advise`` issues WILLNEED for each range; ``read`` (and populate) touches its
    every page; ``pread`` reads the range through the file and waits for all of it; the route-time ops'
    ranges first."""

    def __init__(self, sim: _Sim) -> None:
        self.sim = sim
        self.t = 0.0
        self.asleep = True
        self.gen = self._body()

    def _body(self) -> Generator[float | None, None, None]:
        sim, kernel, engine = self.sim, self.sim.kernel, self.sim.engine
        while True:
            if not sim.queue and not sim.urgent:
                self.asleep = True
                sim.on_worker_idle(self.t)
                yield None
                continue
            if self.t > engine.next_time():  # the next range goes to whichever worker is free first
                yield self.t
                continue
            urgent = bool(sim.urgent)
            issued, first, end, layer = (sim.urgent or sim.queue).popleft()
            self.t = max(self.t, issued)
            if sim.call == "advise":
                if self.t > engine.next_time():
                    yield self.t
                kernel.willneed(first, end, self.t)
            elif sim.call == "pread":  # the whole range in as few requests as the drive takes, then the next
                if self.t > engine.next_time():
                    yield self.t
                self.t = kernel.pread(first, end, self.t)
            else:
                for p in range(first, end):
                    if self.t > engine.next_time():
                        yield self.t
                    self.t = kernel.access(p, self.t)
            if urgent:
                sim.range_done(layer, self.t)


class _Compute:
    """The compute thread: layer after layer, token after token; it runs the consumer's op."""

    def __init__(self, sim: _Sim, model: PageModel, predictor: bool, tokens: list[list[_Step]], prefill: list[_Step]):
        self.sim, self.model, self.predictor = sim, model, predictor
        self.tokens, self.prefill = tokens, prefill
        self.t = 0.0
        self.token_ms: list[float] = []
        self.stall_ms = 0.0
        self.route_wait_ms = 0.0
        self.prefill_counts = KernelCounts()
        self.prefill_evicted = 0
        self.expert_page = sim.layout.is_expert_page() if model.cold else None
        self.gen = self._body()
        self._pages: dict[tuple[int, tuple[int, ...]], list[int]] = {}

    def _demand(self, step: _Step) -> list[int]:
        key = (step.layer, step.demand)
        if key not in self._pages:
            self._pages[key] = self.sim.layout.demand_pages(step.layer, step.demand)
        return self._pages[key]

    def _dense(self, layer: int | None) -> list[int]:
        key = (-1 if layer is None else layer, ())
        if key not in self._pages:
            self._pages[key] = self.sim.layout.dense_pages(layer)
        return self._pages[key]

    def _ranges(self, step: _Step, timed: bool) -> list[tuple[int, int]]:
        """The predicted experts' ranges; with the LRU only those its room for guesses takes."""
        out: list[tuple[int, int]] = []
        keep = self.sim.keep
        skipped = 0 if keep is None else keep.spec_skipped
        for e in step.next_pred or ():
            if keep is None or keep.spec_room(step.target, e):
                out.extend(self.sim.layout.expert_ranges(step.target, e))
        if keep is not None and timed:
            self.sim.spec_skipped += keep.spec_skipped - skipped
        return out

    def _route(self, step: _Step, timed: bool) -> None:
        """The route-time op of a layer: the stale speculative ranges dropped, then its selected experts'
        ranges that are not wholly resident (mincore: pages under I/O count as resident) queued urgent."""
        sim, cache = self.sim, self.sim.kernel.cache
        sim.drop_stale(step.layer)
        out = []
        if sim.order:  # tensor by tensor, as the matmuls use them, each tensor's experts by index
            ranges = [(a, b) for per in sim.layout.tensor_ranges(step.layer, step.demand) for _, a, b in per]
        else:  # expert by expert
            experts = dict.fromkeys(e for e in step.demand if e >= 0)
            ranges = [r for e in experts for r in sim.layout.expert_ranges(step.layer, e)]
        for first, end in ranges:
            missing = sum(1 for p in range(first, end) if p not in cache)
            if missing:
                out.append((first, end))
                sim.route_missing += missing if timed else 0
        sim.push(self.t, out, step.layer, urgent=True)
        if sim.keep is not None:
            evicted, unused = sim.keep.evicted, sim.keep.spec_unused
            out_experts = sim.keep.route(step.layer, step.demand)
            if timed:
                sim.keep_evicted += sim.keep.evicted - evicted
                sim.spec_unused += sim.keep.spec_unused - unused
            for e in out_experts:
                for first, end in sim.layout.expert_ranges(step.layer, e):
                    for p in range(first, end):
                        cache.discard(p)

    def _touch(self, pages: list[int], ms: float, timed: bool) -> Generator[float | None, None, None]:
        """Read ``pages`` in order, ``ms`` of compute spread over them (all of it when there are none)."""
        kernel, engine = self.sim.kernel, self.sim.engine
        if not pages:
            self.t += ms
            return
        per_page = ms / len(pages)
        for p in pages:
            if self.t > engine.next_time():
                yield self.t
            ready = kernel.access(p, self.t)
            if ready > self.t and timed:
                self.stall_ms += ready - self.t
            self.t = ready + per_page

    def _token(self, steps: list[_Step], timed: bool) -> Generator[float | None, None, None]:
        """One token (or the prefill's ubatch): every layer, then the output head."""
        sim, model = self.sim, self.model
        before = model.route_at * model.layer_ms
        cost = cost_per_layer_ms(steps, model.predictor_cost_ms) if self.predictor else 0.0
        for step in steps:
            yield from self._touch(self._dense(step.layer), before, timed)  # attention, norms, router
            if sim.route:  # right after the router: the layer's own experts, ahead of every speculative read
                yield from sim.engine.op(self, model.op_ms)
                self._route(step, timed)
                if sim.wait and sim.outstanding.get(step.layer):
                    # the matmuls start once the layer's reads are in (the workers wake it)
                    sim.layer_waiter, since = (self, step.layer), self.t
                    yield None
                    self.route_wait_ms += self.t - since if timed else 0.0
            if step.next_pred is not None:
                self.t += cost
            if sim.speculative and step.next_pred:
                yield from sim.engine.op(self, model.op_ms)
                if not sim.held:
                    sim.push(self.t, self._ranges(step, timed), step.target)
            if sim.order:
                yield from self._hits_first(step, model.layer_ms - before, timed)
            else:
                yield from self._touch(self._demand(step), model.layer_ms - before, timed)
        yield from self._touch(self._dense(None), 0.0, timed)

    def _hits_first(self, step: _Step, ms: float, timed: bool) -> Generator[float | None, None, None]:
        """A layer's expert matmuls with hits first (patch 0026): tensor by tensor, each one's experts as
        layout.py ``hits_first`` ranks them when its matmul starts; ``ms`` shared as the tensors' pages are."""
        per_tensor = self.sim.layout.tensor_ranges(step.layer, step.demand)
        total = sum(b - a for per in per_tensor for _, a, b in per) or 1
        seen: set[int] = set()
        for per in per_tensor:
            ranked = hits_first(per, self.sim.kernel.cache)
            pages = [p for _, a, b in ranked for p in range(a, b) if not (p in seen or seen.add(p))]
            yield from self._touch(pages, ms * sum(b - a for _, a, b in per) / total, timed)

    def _body(self) -> Generator[float | None, None, None]:
        sim, model, kernel, engine = self.sim, self.model, self.sim.kernel, self.sim.engine
        runs = ([(False, self.prefill)] if self.prefill else []) + [(True, s) for s in self.tokens]
        for timed, steps in runs:
            if model.cold:  # the benchmark lets reads in flight land, then evicts every expert page: untimed
                if engine.next_time() <= self.t:
                    yield self.t  # the workers' pending requests first
                self.t = max(self.t, kernel.drive.idle_at)
                kernel.evict(self.expert_page)
            start = self.t
            yield from self._token(steps, timed)
            if sim.call == "read" and (not timed or (model.cold and model.drain)) and not sim.idle():
                sim.drain_waiter = self  # the workers wake it when they are done
                yield None
            if timed:
                self.token_ms.append(self.t - start)
                continue
            # the decode starts after the prefill's reads; what it read is counted apart
            self.t = max(self.t, kernel.drive.idle_at)
            self.prefill_counts, kernel.counts = kernel.counts, KernelCounts()
            self.prefill_evicted, sim.ranges, sim.route_ranges, sim.stale = kernel.cache.evicted, 0, 0, 0


def run_config(
    routing: Routing,
    layout: ExpertLayout,
    model: PageModel,
    predictor: str | bool | None,
    consumer: str,
    name: str,
    prefill: Trace | Sequence[_Step] = (),
    route: bool = False,
    keep: bool = False,
    wait: bool = False,
    order: bool = False,
) -> PageRun:
    """One configuration: the predictor (the trace's, ``"oracle"``: the actual routing of the next
    layer, predicted at no cost; None or False: off), the workers' call (off, advise, read or
    populate: with the predictor, its speculative reads), ``route``: route-time reads (with the call,
    or ROUTE_CALL when it is off), ``keep``: with route time, its expert LRU (costmodel/keep.py; a
    predictor's guesses with it only into its room for guesses), ``wait``: with route time, the op waits for its layer's
    reads before the matmuls (not with advise), ``order``: with route time, hits first (its reads
    tensor by tensor, each matmul's resident experts first: :meth:`_Compute._hits_first`);
    ``prefill``: the trace (its prefill rows are replayed first, untimed) or those steps. Speculative
    reads the room rule holds off (``model.prefetch_room``) issue nothing: ``room_held`` in the result."""
    if consumer not in CONSUMERS:
        raise ValueError(f"unknown consumer '{consumer}' (one of {', '.join(CONSUMERS)})")
    if consumer != "off" and not predictor and not route:
        raise ValueError("a consumer needs the predictor or route time")
    if keep and not route:
        raise ValueError("the expert LRU is played with route time")
    if wait and (not route or consumer == "advise"):
        raise ValueError("the wait is played with route time, and not with advise (nothing to wait for)")
    if order and not route:
        raise ValueError("hits first is played with route time")
    oracle = predictor == ORACLE
    speculative = bool(predictor) and consumer != "off"
    call = AS_CALL[consumer] if consumer != "off" or not route else ROUTE_CALL
    if isinstance(prefill, Trace):
        prefill = prefill_steps(prefill, oracle)
    layout = fitted_layout(routing, layout, model.page_size)
    cache = PAGE_CACHES[model.page_cache](model.capacity_pages)
    drive = page_drive(model)
    random = layout.is_expert_page() if model.random_experts else None
    kernel = Kernel(layout.n_pages, cache, drive, model.window_pages, model.fault_ms, random)
    engine = Engine()
    need = layout.token_need_bytes(routing.header.n_expert_used)
    held = speculative and model.room_holds(need)
    sim = _Sim(kernel, engine, layout, call, model.workers, speculative, route, held)
    sim.wait, sim.order = wait, order
    room = model.room_bytes()
    if keep and room is not None:
        n_used, first = routing.header.n_expert_used, min(routing.layers)
        expert = layout.expert_pages(first) * layout.page_size
        n_moe = len(routing.layers)
        cap = keep_capacity(room, need, expert, n_moe, n_used, guesses=speculative)
        sim.keep = ExpertLRU(cap, n_moe, n_used, guesses=speculative)
    tokens = _steps(routing, oracle)
    compute = _Compute(sim, model, bool(predictor) and not oracle, tokens, list(prefill) if model.prefill else [])
    engine.at(0.0, compute.gen)
    engine.run()
    if len(compute.token_ms) != len(tokens):
        raise RuntimeError("the simulation stopped before the last token")
    return PageRun(
        name,
        bool(predictor),
        consumer,
        len(tokens),
        sum(compute.token_ms),
        kernel.counts,
        tuple(compute.token_ms),
        compute.stall_ms,
        cache.evicted - compute.prefill_evicted,
        sim.ranges,
        compute.prefill_counts,
        model.page_size,
        need,
        held,
        route,
        sim.route_ranges,
        sim.route_missing,
        sim.stale,
        keep,
        None if sim.keep is None else sim.keep.capacity,
        sim.keep_evicted,
        wait,
        compute.route_wait_ms,
        sim.spec_skipped,
        sim.spec_unused,
        order,
    )
