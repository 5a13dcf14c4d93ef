"""Route time's expert LRU in anonymous memory of its own (``--moe-prefetch-keep anon``) as the page model plays it.

Patch 0028's rules, to the granularity of an expert's slices (one per expert tensor of its layer):

- **What stays.** The LRU of costmodel/keep.py, sized as keep lru's (``keep_capacity``), but the
  capacity's remainder goes one expert more each to the first MoE layers (:class:`AnonLRU`). Its
  experts' slices are held in memory of the consumer's own, which the kernel never reclaims; an
  evicted one is freed at once. A batch routing more of a layer than a token does shrinks the
  capacity by that excess for the layer's share, and holds the fresh ones beyond it not at all (they
  are read and dropped). The page cache keeps the dense weights only,
  in what the limit leaves beside the LRU's bytes.
- **The reads.** Right after layer l's router, the op queues (urgent, ahead of every guess) each
  routed slice that is neither held nor on its way, in two or more chunks of whole pages of at most
  ``HOLD_CHUNK_BYTES`` (a slice under two pages in one), tensor by tensor in the matmuls' order with
  ``order hits``, else expert by expert. A worker reads a chunk with one ``pread`` (``O_DIRECT``: no
  page cache), split at the drive's largest request, and is busy until all of it is in; a slice is
  held once its last chunk is. The guesses still queued for layers <= l are dropped first; a routed
  slice a worker is reading on a guess is adopted (awaited, not read again).
- **The wait.** Without ``order hits`` the layer's matmuls wait for all its slices (keep anon implies
  the wait). With it, each expert tensor's matmul takes the held slices first, then the rest by index,
  and sleeps before each missing one until it is held; the layer's compute is shared by the slices
  as their pages are.
- **Guesses** (a predictor's, layer l+K's while layer l computes): only into the LRU's room for guesses
  (``ExpertLRU.spec_room``), one chunk a slice, queued behind the urgent ones. At the route a guess not
  routed is freed, a routed one joins the LRU.

What it leaves out: the CPU cost of ``mremap`` and of mapping the file back; the shared first and
last page of two neighbours' slices (each slice is its own page range here, so those pages are read
twice); the pages a batch leaves in the page cache and a later route copies from it. Among them the
prompt's: patch 0028 holds nothing new in a ubatch larger than any before (its room is not known while
its buffers are first touched), so the prompt's routed experts go through the page cache and the first
decoded tokens' routes copy them to memory of its own; here the prompt holds them, as those copies do.
The same stands for a batch that streams a layer (it routes more of the layer than its share and than
half its experts): patch 0028 gives back what the layer held and holds none of the batch, and the
compute thread faults the experts in; here the batch is played as any route. The prefill is untimed.
docs/cost-model.md, "keep anon".
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Generator, Iterable, Sequence
from dataclasses import dataclass, field

from ..constants import HOLD_CHUNK_BYTES
from ..trace import Trace
from .engine import Engine, fitted_layout, page_drive
from .keep import ExpertLRU, keep_capacity
from .kernel import PAGE_CACHES, Kernel, KernelCounts
from .layout import ExpertLayout
from .pages import PageModel, PageRun, _Step, _steps, cost_per_layer_ms, prefill_steps
from .routing import Routing
from .row_config import ORACLE


class AnonLRU(ExpertLRU):
    """keep lru's LRU with keep anon's shares: the capacity's remainder one more each to the first MoE
    layers; in a route of more experts than a token's, the capacity less that excess (a batch reads the
    union's experts it does not hold through the page cache, which needs the room); a batch's fresh experts
    beyond its layer's share not held (:attr:`unkept`, after each route)."""

    def __init__(self, capacity: int, layers: Sequence[int], n_expert_used: int, guesses: bool = False) -> None:
        super().__init__(capacity, len(layers), n_expert_used, guesses)
        self.n_expert_used, self.n_moe = n_expert_used, len(layers)
        self.layers = sorted(layers)
        self.excess = 0  # the route being played: its experts beyond a token's
        self.unkept: list[int] = []

    def share_of(self, layer: int) -> int:
        cap = max(0, self.capacity - self.excess)
        return max(self.n_expert_used, cap // self.n_moe + (layer in self.layers[: cap % self.n_moe]))

    def route(self, layer: int, experts: Iterable[int]) -> list[int]:
        now = list(dict.fromkeys(e for e in experts if e >= 0))
        self.excess = max(0, len(now) - self.n_expert_used)
        fresh = [e for e in now if e not in self.held.get(layer, ()) and e not in self.guessed.get(layer, ())]
        out = super().route(layer, now)
        lru, share = self.held[layer], self.share_of(layer)
        self.unkept = []
        for e in reversed(fresh):
            if len(lru) <= share:
                break
            del lru[e]
            self.unkept.append(e)
        return out


@dataclass(eq=False)
class _Slice:
    """One expert tensor's slice of one expert: its pages, the chunks of it not in yet."""

    layer: int
    expert: int
    tensor: int  # its index in the layer's expert tensors
    first: int
    end: int
    left: int  # chunks not yet in (0: held)
    guess: bool = False


@dataclass(frozen=True)
class _Chunk:
    issued: float
    slice: _Slice
    first: int
    end: int


def chunks(first: int, end: int, page_size: int, routed: bool) -> list[tuple[int, int]]:
    """A slice's pages ``[first, end)`` as the op hands them out: a routed slice of two pages or more in
    two or more chunks of whole pages of at most HOLD_CHUNK_BYTES, equal but the last; else one."""
    n = end - first
    if not routed or n < 2:
        return [(first, end)]
    parts = max(2, -(-n * page_size // HOLD_CHUNK_BYTES))
    part = -(-n // parts)
    return [(a, min(a + part, end)) for a in range(first, end, part)]


@dataclass
class _Sim:
    """The workers' queues, the slices held or on their way, and the counts of the decode."""

    engine: Engine
    kernel: Kernel
    layout: ExpertLayout
    lru: AnonLRU
    order: bool
    speculative: bool  # a predictor's guesses are read (into the LRU's room for them)
    urgent: deque[_Chunk] = field(default_factory=deque)
    queue: deque[_Chunk] = field(default_factory=deque)
    slices: dict[tuple[int, int, int], _Slice] = field(default_factory=dict)  # (layer, expert, tensor)
    workers: list[_Worker] = field(default_factory=list)
    waiter: tuple[_Compute, Callable[[], bool]] | None = None
    route_ranges: int = 0
    route_missing: int = 0
    guess_ranges: int = 0
    stale: int = 0
    evicted_pages: int = 0
    timed: bool = False

    def push(self, t: float, todo: Sequence[tuple[_Slice, bool]]) -> None:
        """Slices handed to the workers at t, each in its chunks (``urgent``: a route-time op's)."""
        for s, urgent in todo:
            for a, b in chunks(s.first, s.end, self.layout.page_size, urgent):
                (self.urgent if urgent else self.queue).append(_Chunk(t, s, a, b))
        self.engine.wake(self.workers, t, lambda: bool(self.queue or self.urgent))

    def done(self, c: _Chunk, t: float) -> None:
        """A chunk is in at t: the waiting compute thread wakes when what it waits for is held."""
        c.slice.left -= 1
        if self.waiter is not None and self.waiter[1]():
            compute, self.waiter = self.waiter[0], None
            compute.t = max(compute.t, t)
            self.engine.at(compute.t, compute.gen)

    def free(self, layer: int, experts: Iterable[int], evicted: bool) -> None:
        """The experts' slices leave memory of our own (one being read is dropped when it is in)."""
        for e in experts:
            for j in range(len(self.layout.layers[layer])):
                s = self.slices.pop((layer, e, j), None)
                if s is not None and evicted and self.timed:
                    self.evicted_pages += s.end - s.first


class _Worker:
    """A consumer worker: a chunk at a time, the urgent ones first, one pread each, busy until it is in."""

    def __init__(self, sim: _Sim) -> None:
        self.sim, self.t, self.asleep = sim, 0.0, True
        self.gen = self._body()

    def _body(self) -> Generator[float | None, None, None]:
        sim, engine, kernel = self.sim, self.sim.engine, self.sim.kernel
        drive = kernel.drive
        while True:
            if not sim.urgent and not sim.queue:
                self.asleep = True
                yield None
                continue
            if self.t > engine.next_time():  # the next chunk goes to whichever worker is free first
                yield self.t
                continue
            c = (sim.urgent or sim.queue).popleft()
            self.t = max(self.t, c.issued)
            counts = kernel.counts  # the prefill's apart from the decode's
            counts.pread_ranges += 1
            done, p = self.t, c.first
            while p < c.end:  # O_DIRECT: the drive splits the read at its largest request
                n = c.end - p if drive.max_pages is None else min(c.end - p, drive.max_pages)
                flow, page_ms = drive.request(self.t, n)
                done = max(done, flow + n * page_ms)
                counts.requests += 1
                counts.pages_read += n
                p += n
            self.t = done
            yield self.t  # in at done, in time order with the compute thread
            sim.done(c, self.t)


class _Compute:
    """The compute thread: layer after layer, token after token, the route-time op and the guesses' op."""

    def __init__(self, sim: _Sim, model: PageModel, costs: bool, tokens: list[list[_Step]], prefill: list[_Step]):
        self.sim, self.model, self.costs = sim, model, costs  # costs: the predictor's cost (not the oracle's)
        self.tokens, self.prefill = tokens, prefill
        self.t = 0.0
        self.token_ms: list[float] = []
        self.wait_ms = 0.0  # waiting for the workers' slices
        self.fault_wait_ms = 0.0  # waiting for the dense pages' faults
        self.prefill_counts = KernelCounts()
        self.prefill_lru = (0, 0, 0)  # the LRU's evicted, skipped and unused guesses at the decode's start
        self.gen = self._body()

    def _sleep(self, until: Callable[[], bool], timed: bool) -> Generator[float | None, None, None]:
        """Sleep until the workers make ``until`` true."""
        if until():
            return
        self.sim.waiter, since = (self, until), self.t
        yield None
        self.wait_ms += self.t - since if timed else 0.0

    def _dense(self, layer: int | None, ms: float, timed: bool) -> Generator[float | None, None, None]:
        """The layer's dense pages (None: the output head's) through the page cache, ``ms`` spread over them;
        a fault's wait counts as the stall's, as pages.py's compute thread counts it."""
        kernel, engine = self.sim.kernel, self.sim.engine
        pages = self.sim.layout.dense_pages(layer)
        per_page = ms / len(pages) if pages else 0.0
        self.t += 0.0 if pages else ms
        for p in pages:
            if self.t > engine.next_time():
                yield self.t
            ready = kernel.access(p, self.t)
            self.fault_wait_ms += ready - self.t if timed else 0.0
            self.t = ready + per_page

    def _route(self, step: _Step) -> list[_Slice]:
        """The route-time op: stale guesses dropped, the LRU told, the routed slices neither held nor on
        their way queued; the layer's slices, in the matmuls' order."""
        sim, layer = self.sim, step.layer
        kept = deque()
        for c in sim.queue:  # guesses for this layer or an earlier one come too late
            if c.slice.layer <= layer:
                sim.stale += sim.timed
                key = (c.slice.layer, c.slice.expert, c.slice.tensor)
                if sim.slices.get(key) is c.slice:  # not read; its siblings a worker has are
                    del sim.slices[key]
            else:
                kept.append(c)
        sim.queue = kept
        routed = list(dict.fromkeys(e for e in step.demand if e >= 0))
        unused = sim.lru.spec_unused
        out = sim.lru.route(layer, routed)
        n_unused = sim.lru.spec_unused - unused  # the guesses not routed come first
        sim.free(layer, out[:n_unused], evicted=False)
        sim.free(layer, out[n_unused:], evicted=True)
        n_tensors = len(sim.layout.layers[layer])
        experts = sorted(routed) if sim.order else routed
        mine: list[_Slice] = []
        todo: list[list[tuple[_Slice, bool]]] = [[] for _ in range(n_tensors)]
        for e in experts:
            for j, (first, end) in enumerate(sim.layout.expert_ranges(layer, e)):
                s = sim.slices.get((layer, e, j))
                if s is None:
                    s = _Slice(layer, e, j, first, end, len(chunks(first, end, sim.layout.page_size, True)))
                    if e not in sim.lru.unkept:
                        sim.slices[(layer, e, j)] = s
                    todo[j if sim.order else 0].append((s, True))
                    sim.route_ranges += sim.timed
                if s.left:
                    sim.route_missing += (end - first) * sim.timed
                mine.append(s)
        sim.push(self.t, [x for per in todo for x in per])
        return mine

    def _guesses(self, step: _Step) -> None:
        """Layer l+K's guesses, one chunk a slice, into the LRU's room for them."""
        sim, layer = self.sim, step.target
        todo = []
        for e in step.next_pred or ():
            if not sim.lru.spec_room(layer, e):
                continue
            for j, (first, end) in enumerate(sim.layout.expert_ranges(layer, e)):
                if (layer, e, j) in sim.slices:
                    continue  # held, or on its way
                s = sim.slices[(layer, e, j)] = _Slice(layer, e, j, first, end, 1, guess=True)
                todo.append((s, False))
                sim.guess_ranges += sim.timed
        sim.push(self.t, todo)

    def _matmuls(self, layer: int, mine: list[_Slice], ms: float, timed: bool) -> Generator[float | None, None, None]:
        """Hits first: tensor by tensor, the held slices first, then by index, each awaited; ``ms`` shared
        by the slices as their pages are."""
        n_tensors = len(self.sim.layout.layers[layer])
        total = sum(s.end - s.first for s in mine) or 1
        for j in range(n_tensors):
            per = sorted(mine[j::n_tensors], key=lambda s: (s.left > 0, s.expert))
            for s in per:
                yield from self._sleep(lambda s=s: s.left == 0, timed)
                self.t += ms * (s.end - s.first) / total

    def _token(self, steps: list[_Step], timed: bool) -> Generator[float | None, None, None]:
        sim, model = self.sim, self.model
        before = model.route_at * model.layer_ms
        cost = cost_per_layer_ms(steps, model.predictor_cost_ms) if self.costs else 0.0
        for step in steps:
            yield from self._dense(step.layer, before, timed)
            yield from sim.engine.op(self, model.op_ms)
            mine = self._route(step)
            if not sim.order:  # the layer's matmuls start once its slices are in
                yield from self._sleep(lambda mine=mine: all(s.left == 0 for s in mine), timed)
            if step.next_pred is not None:
                self.t += cost
            if sim.speculative and step.next_pred:
                yield from sim.engine.op(self, model.op_ms)
                self._guesses(step)
            if sim.order:
                yield from self._matmuls(step.layer, mine, model.layer_ms - before, timed)
            else:
                self.t += model.layer_ms - before
        yield from self._dense(None, 0.0, timed)

    def _body(self) -> Generator[float | None, None, None]:
        sim, kernel = self.sim, self.sim.kernel
        runs = ([(False, self.prefill)] if self.prefill else []) + [(True, s) for s in self.tokens]
        for timed, steps in runs:
            sim.timed = timed
            start = self.t
            yield from self._token(steps, timed)
            if timed:
                self.token_ms.append(self.t - start)
                continue
            # the decode starts after the prefill's reads; what it read is counted apart
            if sim.urgent or sim.queue or not all(w.asleep for w in sim.workers):
                yield from self._sleep(
                    lambda: not sim.urgent and not sim.queue and all(s.left == 0 for s in sim.slices.values()), timed
                )
            self.t = max(self.t, kernel.drive.idle_at)
            self.prefill_counts, kernel.counts = kernel.counts, KernelCounts()
            self.prefill_lru = (sim.lru.evicted, sim.lru.spec_skipped, sim.lru.spec_unused)


def run_anon(
    routing: Routing,
    layout: ExpertLayout,
    model: PageModel,
    predictor: str | bool | None,
    name: str,
    prefill: Trace | Sequence[_Step] = (),
    order: bool = False,
) -> PageRun:
    """``pread + route, keep anon`` (with ``order``: hits first) under ``model``'s limit: the predictor
    (the trace's, ``"oracle"``, or None/False: off) reads its guesses into the LRU's room for them;
    ``prefill``: the trace (its prefill rows replayed first, untimed) or those steps. The row's reads
    are the workers' preads (``counts``); ``route_wait_ms``: the compute thread's time waiting for slices,
    ``stall_ms``: that and its waits on the dense pages' faults."""
    if model.cold:
        raise ValueError("keep anon is played under a memory limit, not with --cold")
    room = model.room_bytes()
    if room is None:
        raise ValueError("keep anon is played under a memory limit (its LRU is sized to the room)")
    oracle = predictor == ORACLE
    speculative = bool(predictor)
    if isinstance(prefill, Trace):
        prefill = prefill_steps(prefill, oracle)
    layout = fitted_layout(routing, layout, model.page_size)
    n_used, layers = routing.header.n_expert_used, sorted(routing.layers)
    expert_pages = layout.expert_pages(layers[0])
    need = layout.token_need_bytes(n_used)
    guesses = speculative and not model.room_holds(need)
    cap = keep_capacity(room, need, expert_pages * layout.page_size, len(layers), n_used, guesses=guesses)
    lru = AnonLRU(cap, layers, n_used, guesses=guesses)
    # the page cache keeps what the limit leaves beside the LRU's memory: the dense weights
    cache = PAGE_CACHES[model.page_cache](max(1, (model.capacity_pages or 0) - cap * expert_pages))
    random = layout.is_expert_page() if model.random_experts else None  # exact: MADV_RANDOM on the experts
    kernel = Kernel(layout.n_pages, cache, page_drive(model), model.window_pages, model.fault_ms, random)
    engine = Engine()
    sim = _Sim(engine, kernel, layout, lru, order, guesses)
    sim.workers = [_Worker(sim) for _ in range(model.workers)]
    tokens = _steps(routing, oracle)
    compute = _Compute(sim, model, speculative and not oracle, tokens, list(prefill) if model.prefill else [])
    engine.at(0.0, compute.gen)
    engine.run()
    if len(compute.token_ms) != len(tokens):
        raise RuntimeError("the simulation stopped before the last token")
    evicted, skipped, unused = (now - then for now, then in zip((lru.evicted, lru.spec_skipped, lru.spec_unused),
                                                                compute.prefill_lru))  # fmt: skip
    return PageRun(
        name,
        speculative,
        "pread",
        len(tokens),
        sum(compute.token_ms),
        kernel.counts,
        tuple(compute.token_ms),
        compute.wait_ms + compute.fault_wait_ms,
        sim.evicted_pages,
        sim.guess_ranges,
        compute.prefill_counts,
        model.page_size,
        need,
        speculative and not guesses,
        route=True,
        route_ranges=sim.route_ranges,
        route_missing_pages=sim.route_missing,
        stale_ranges=sim.stale,
        keep=True,
        keep_capacity=cap,
        keep_evicted=evicted,
        wait=not order,
        route_wait_ms=compute.wait_ms,
        spec_skipped=skipped,
        spec_unused=unused,
        order=order,
    )
