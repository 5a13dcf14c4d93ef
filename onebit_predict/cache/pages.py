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

The pieces, each small and tested on its own:

- :class:`ExpertLayout`: where each expert's bytes are in the file (the GGUF's tensors, or
  a synthetic layout from one expert size), as page ranges in the order the layer reads
  them (``up``, ``gate``, ``down``: llama.cpp's build_moe_ffn; experts in ascending id, as
  ggml's mul_mat_id walks them);
- :class:`PageCache`: the resident pages, least recently used first, each with the time
  its read completes; a capacity in pages (None: unbounded) evicts from the LRU end;
- :class:`PageDrive`: the drive of simulate.py (FIFO, ``queue_depth`` requests in service,
  latencies overlap, transfers share the bandwidth one after another), where a request is
  a run of contiguous pages and each page of it is complete as its bytes have flowed;
- :class:`Kernel`: a page access (a hit, a wait for a read in flight, or a major fault with
  its read-around window and the readahead marker that pulls the next window), a
  ``WILLNEED`` range, the counts;
- :func:`run_config`: one configuration (the predictor off or on, the consumer off, advise
  or read) over a trace's routing, played as events: the compute thread and the consumer's
  workers act in time order on one kernel; the consumer's room rule
  (``PageModel.prefetch_room``, ONEBIT_MOE_PREFETCH_ROOM) holds it off for the whole run when
  the page cache is below R x one token's need (:meth:`ExpertLayout.token_need_bytes`).
"""

from __future__ import annotations

import heapq
import math
import os
import re
from collections import OrderedDict, deque
from collections.abc import Generator, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from ..constants import TRACE_FLAG_DECODE, TRACE_FLAG_PREDICTED
from ..trace import Trace
from .expert_bytes import EXPERT_TENSOR, ModelError
from .routing import Routing

PAGE_SIZE = 4096
CONSUMERS = ("off", "advise", "read")
ORACLE = "oracle"
# the order in which a layer's routed-expert computation reads its tensors (llama.cpp
# build_moe_ffn: up, then gate, then down; a merged gate_up first)
ACCESS_ORDER = {"gate_up": 0, "up": 1, "gate": 2, "down": 3}
DENSE_TENSOR = re.compile(r"^blk\.(\d+)\.")  # a layer's tensor that is not a routed expert's
HEAD_TENSORS = ("output.", "output_norm.")  # read once per token after the last layer
# llama.cpp opens the GGUF with posix_fadvise(POSIX_FADV_SEQUENTIAL), which doubles the
# file's readahead (file->f_ra.ra_pages = 2 * the device's read_ahead_kb); its mapping
# shares that state, so a fault's read-around window is twice read_ahead_kb
LLAMA_FADV_SEQUENTIAL_FACTOR = 2


# --- where the experts are in the file ------------------------------------------------------


@dataclass(frozen=True)
class ExpertTensor:
    """One routed-expert tensor of a layer: expert e's slice is ``[offset + e * slice_bytes, +slice_bytes)``."""

    name: str
    offset: int
    slice_bytes: int


@dataclass(frozen=True)
class ExpertLayout:
    """Every layer's expert tensors in the order the layer reads them; the file's size."""

    file_bytes: int
    layers: dict[int, tuple[ExpertTensor, ...]]
    n_expert: int
    source: str  # "gguf PATH" or "synthetic"
    page_size: int = PAGE_SIZE
    # the dense tensors (attention, norms, router, shared experts) each layer reads before its
    # routed experts, and what a token reads after the last layer (output norm and head), as
    # byte ranges (offset, size); empty in a synthetic layout
    dense: dict[int, tuple[tuple[int, int], ...]] = field(default_factory=dict)
    head: tuple[tuple[int, int], ...] = ()

    @property
    def n_pages(self) -> int:
        return -(-self.file_bytes // self.page_size)

    def expert_ranges(self, layer: int, expert: int) -> list[tuple[int, int]]:
        """The page ranges ``[first, end)`` of one expert's slices, in read order."""
        out = []
        for t in self.layers[layer]:
            a = t.offset + expert * t.slice_bytes
            out.append((a // self.page_size, -(-(a + t.slice_bytes) // self.page_size)))
        return out

    def demand_pages(self, layer: int, experts: Iterable[int]) -> list[int]:
        """The pages a layer touches for these experts: tensor by tensor, experts ascending, each page once."""
        ids = sorted(set(int(e) for e in experts if e >= 0))
        seen: set[int] = set()
        out: list[int] = []
        for t in self.layers[layer]:
            for e in ids:
                a = t.offset + e * t.slice_bytes
                for p in range(a // self.page_size, -(-(a + t.slice_bytes) // self.page_size)):
                    if p not in seen:
                        seen.add(p)
                        out.append(p)
        return out

    def dense_pages(self, layer: int | None) -> list[int]:
        """The dense pages a layer reads before its router (None: the output head's, after the last layer)."""
        ranges = self.head if layer is None else self.dense.get(layer, ())
        ps = self.page_size
        return list(dict.fromkeys(p for a, n in ranges for p in range(a // ps, -(-(a + n) // ps))))

    def is_expert_page(self) -> np.ndarray:
        """``(n_pages,)`` bool: the pages that hold routed-expert bytes (what ``--cold`` evicts)."""
        out = np.zeros(self.n_pages, dtype=bool)
        for ts in self.layers.values():
            for t in ts:
                a = t.offset
                out[a // self.page_size : -(-(a + t.slice_bytes * self.n_expert) // self.page_size)] = True
        return out

    def expert_bytes(self) -> dict[int, int]:
        return {layer: sum(t.slice_bytes for t in ts) for layer, ts in self.layers.items()}

    def token_need_bytes(self, n_expert_used: int) -> int:
        """The mapped bytes one token reads, as the consumer's room rule counts them: every dense
        tensor (token_embd left out; none in a synthetic layout) and, of each layer's routed-expert
        tensors, n_expert_used / n_expert of their bytes."""
        if not 0 < n_expert_used <= self.n_expert:
            raise ValueError(f"n_expert_used must be in [1, {self.n_expert}], not {n_expert_used}")
        dense = sum(n for ranges in self.dense.values() for _, n in ranges) + sum(n for _, n in self.head)
        experts = sum(t.slice_bytes for ts in self.layers.values() for t in ts) * n_expert_used
        return dense + experts


def _order_key(name: str) -> tuple[int, str]:
    m = EXPERT_TENSOR.match(name)
    assert m is not None
    return ACCESS_ORDER[m.group(2)], m.group(3) or ""


def layout_from_gguf(path: str | Path) -> tuple[ExpertLayout, int]:
    """The real layout of a GGUF's routed experts, and its expert count (ModelError if it has none)."""
    import gguf  # noqa: PLC0415 - a dependency, imported where needed

    path = Path(path)
    try:
        reader = gguf.GGUFReader(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot read it as a GGUF: {e}") from None
    layers: dict[int, list[ExpertTensor]] = {}
    dense: dict[int, list[tuple[int, int]]] = {}
    head: list[tuple[int, int]] = []
    counts = set()
    for t in reader.tensors:
        m = EXPERT_TENSOR.match(t.name)
        if not m:
            span = (int(t.data_offset), int(t.n_bytes))
            block = DENSE_TENSOR.match(t.name)
            if block:
                dense.setdefault(int(block.group(1)), []).append(span)
            elif t.name.startswith(HEAD_TENSORS):
                head.append(span)  # token_embd is left out: a token reads one row of it
            continue
        shape = [int(x) for x in np.asarray(t.shape).tolist()]
        n_expert = shape[-1]
        counts.add(n_expert)
        nbytes = int(t.n_bytes)
        if nbytes % n_expert:
            raise ModelError(f"{path}: {t.name} is {nbytes} bytes, not a multiple of its {n_expert} experts")
        layers.setdefault(int(m.group(1)), []).append(ExpertTensor(t.name, int(t.data_offset), nbytes // n_expert))
    if not layers:
        raise ModelError(f"{path}: no routed-expert tensors (blk.N.ffn_*_exps): not a MoE model")
    if len(counts) > 1:
        raise ModelError(f"{path}: expert tensors disagree on the number of experts ({sorted(counts)})")
    ordered = {layer: tuple(sorted(ts, key=lambda t: _order_key(t.name))) for layer, ts in sorted(layers.items())}
    dense_sorted = {layer: tuple(sorted(r)) for layer, r in dense.items()}
    n_expert = counts.pop()
    layout = ExpertLayout(
        os.path.getsize(path), ordered, n_expert, f"gguf {path}", PAGE_SIZE, dense_sorted, tuple(sorted(head))
    )
    return layout, n_expert


def synthetic_layout(expert_bytes: dict[int, float], n_expert: int) -> ExpertLayout:
    """A GGUF-like layout from one size per layer: layer after layer, each ``down``, ``gate``, ``up``
    (the order llama.cpp's writer puts them in, by name), each ``n_expert`` slices of a third of
    an expert, contiguous from offset 0 (non-expert tensors, small, are left out)."""
    layers: dict[int, tuple[ExpertTensor, ...]] = {}
    offset = 0
    for layer in sorted(expert_bytes):
        size = int(round(expert_bytes[layer]))
        third = size // 3
        parts = {"down": size - 2 * third, "gate": third, "up": third}
        placed = []
        for kind in ("down", "gate", "up"):
            placed.append(ExpertTensor(f"blk.{layer}.ffn_{kind}_exps.weight", offset, parts[kind]))
            offset += parts[kind] * n_expert
        layers[layer] = tuple(sorted(placed, key=lambda t: _order_key(t.name)))
    return ExpertLayout(offset, layers, n_expert, "synthetic")


def device_read_ahead_kb(path: str | Path) -> int | None:
    """read_ahead_kb of the block device holding ``path`` on this machine (None when unknown)."""
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    base = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}")
    for queue in (base / "queue", base / ".." / "queue", base / "bdi"):
        f = queue / "read_ahead_kb"
        try:
            return int(f.read_text().strip())
        except (OSError, ValueError):
            continue
    return None


# --- the page cache, the drive, the kernel's fault and readahead rules -------------------------


class PageCache:
    """Resident pages, least recently used first, each with the completion time of its read.

    ``capacity`` pages (None: unbounded); adding a page beyond it evicts the least recently
    used page (its readahead marker goes with it). A use (:meth:`use`) makes a page the most
    recent; readahead adds pages as the most recent and does not touch resident ones.
    """

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"page cache capacity must be at least one page, not {capacity}")
        self.capacity = capacity
        self.lru: OrderedDict[int, float] = OrderedDict()  # page -> the time its read completes
        self.marker: set[int] = set()
        self.evicted = 0

    def __contains__(self, page: int) -> bool:
        return page in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    def ready(self, page: int) -> float:
        return self.lru[page]

    def use(self, page: int) -> None:
        self.lru.move_to_end(page)

    def add(self, page: int, ready: float) -> None:
        self.lru[page] = ready
        if self.capacity is not None:
            while len(self.lru) > self.capacity:
                victim, _ = self.lru.popitem(last=False)
                self.marker.discard(victim)
                self.evicted += 1

    def pages(self) -> Iterable[int]:
        return self.lru.keys()

    def discard(self, page: int) -> None:
        self.lru.pop(page, None)
        self.marker.discard(page)

    def clear(self) -> None:
        self.lru.clear()
        self.marker.clear()


class TwoListCache:
    """The kernel's two lists for file pages (no MGLRU), as far as this workload needs them.

    A page read in goes to the head of the **inactive** list, or of the **active** list when
    it is a refault whose distance (pages evicted or activated since its eviction) is at
    most the active list's length (workingset_refault). A use sets the page's accessed bit
    (its PTE's young bit: mapped pages do not move on a use). To make room, reclaim looks at
    the inactive list's tail: a page used since the last look is kept and marked referenced
    (back to the inactive head), activated if it was already marked; a page not used is
    evicted (its shadow remembers the age). Whenever the inactive list is shorter than the
    active one (inactive_ratio 1 below 1 GiB), the active tail is deactivated to the
    inactive head first, its accessed bit cleared.
    """

    def __init__(self, capacity: int | None) -> None:
        if capacity is not None and capacity < 1:
            raise ValueError(f"page cache capacity must be at least one page, not {capacity}")
        self.capacity = capacity
        self.inactive: OrderedDict[int, float] = OrderedDict()  # tail first
        self.active: OrderedDict[int, float] = OrderedDict()
        self.young: set[int] = set()
        self.referenced: set[int] = set()
        self.shadow: dict[int, int] = {}
        self.age = 0
        self.marker: set[int] = set()
        self.evicted = 0
        self.activated = 0

    def __contains__(self, page: int) -> bool:
        return page in self.inactive or page in self.active

    def __len__(self) -> int:
        return len(self.inactive) + len(self.active)

    def ready(self, page: int) -> float:
        got = self.inactive.get(page)
        return self.active[page] if got is None else got

    def use(self, page: int) -> None:
        self.young.add(page)

    def add(self, page: int, ready: float) -> None:
        active, inactive = self.active, self.inactive
        evicted_at = self.shadow.pop(page, None)
        if evicted_at is not None and self.age - evicted_at <= len(active):
            active[page] = ready
            self.age += 1
            self.activated += 1
        else:
            inactive[page] = ready
        cap = self.capacity
        if cap is None or len(inactive) + len(active) <= cap:
            return
        young, referenced = self.young, self.referenced
        while True:  # reclaim one page
            if len(inactive) < len(active):
                p, r = active.popitem(last=False)
                young.discard(p)
                inactive[p] = r
                continue
            p, r = inactive.popitem(last=False)
            if p in young:
                young.discard(p)
                if p in referenced:
                    referenced.discard(p)
                    active[p] = r
                    self.age += 1
                    self.activated += 1
                else:
                    referenced.add(p)
                    inactive[p] = r
                continue
            referenced.discard(p)
            self.marker.discard(p)
            self.shadow[p] = self.age
            self.age += 1
            self.evicted += 1
            return

    def pages(self) -> Iterable[int]:
        return [*self.inactive.keys(), *self.active.keys()]

    def discard(self, page: int) -> None:
        self.inactive.pop(page, None)
        self.active.pop(page, None)
        self.young.discard(page)
        self.referenced.discard(page)
        self.marker.discard(page)

    def clear(self) -> None:
        self.inactive.clear()
        self.active.clear()
        self.young.clear()
        self.referenced.clear()
        self.marker.clear()


PAGE_CACHES = {"lru": PageCache, "two-list": TwoListCache}


class PageDrive:
    """simulate.py's FIFO drive, a request being a run of pages that complete as their bytes flow.

    Request i (issued at a_i) enters service at s_i = max(a_i, c_{i-Q}), its data flows from
    x_i = max(s_i + latency, c_{i-1}), its k-th page (from 0) is complete at
    x_i + (k + 1) * page / bandwidth, the request at c_i = x_i + n * page / bandwidth.
    """

    def __init__(self, bandwidth: float, latency_ms: float, queue_depth: int, page_size: int = PAGE_SIZE) -> None:
        if not bandwidth > 0:
            raise ValueError(f"bandwidth must be positive, not {bandwidth}")
        if not latency_ms >= 0:
            raise ValueError(f"latency must be >= 0, not {latency_ms}")
        if queue_depth < 1:
            raise ValueError(f"queue depth must be at least 1, not {queue_depth}")
        self.page_ms = page_size / (bandwidth / 1000.0)
        self.latency_ms = latency_ms
        self._completions: deque[float] = deque(maxlen=queue_depth)
        self._last = 0.0
        self.requests = 0
        self.pages = 0

    def request(self, issue_ms: float, n_pages: int) -> float:
        """Issue a request of n_pages; the time its data starts to flow (page k done at + (k+1) * page_ms)."""
        q = self._completions
        enter = max(issue_ms, q[0]) if len(q) == q.maxlen else issue_ms
        flow = max(enter + self.latency_ms, self._last)
        done = flow + n_pages * self.page_ms
        q.append(done)
        self._last = done
        self.requests += 1
        self.pages += n_pages
        return flow

    @property
    def idle_at(self) -> float:
        return self._last


def next_ra_size(cur: int, max_pages: int) -> int:
    """The kernel's get_next_ra_size: x4 while small, x2 up to half the maximum, then the maximum."""
    if cur < max_pages // 16:
        return 4 * cur
    if cur <= max_pages // 2:
        return 2 * cur
    return max_pages


@dataclass
class KernelCounts:
    major_faults: int = 0  # accesses to a page not in the page cache
    waits: int = 0  # accesses to a page in the cache whose read had not completed
    async_readaheads: int = 0  # readahead windows pulled by the marker
    willneed_ranges: int = 0
    pages_read: int = 0
    requests: int = 0


class Kernel:
    """What the kernel does for a mapped file, to the granularity of pages.

    ``window`` pages: the read-around of a major fault (0: ``MADV_RANDOM``, the fault reads
    its own page). A fault on page p reads the missing pages of
    ``[max(0, p - window / 2), + window)`` and marks the page ``window / 4`` before that
    window's end; an access to a marked page (the readahead marker) reads the next window
    (``next_ra_size``) after the one the file's readahead state last read, or, when the marker
    is not where that state expects it, from the first missing page after it. ``willneed``
    reads the missing pages of a range (``force_page_cache_ra``: no window, no marker). Each
    run of missing pages is one drive request; pages enter the cache at the request's issue.
    """

    def __init__(
        self, n_pages: int, cache: PageCache | TwoListCache, drive: PageDrive, window: int, fault_ms: float = 0.0
    ) -> None:
        if window < 0:
            raise ValueError(f"readahead window must be >= 0 pages, not {window}")
        self.n_pages = n_pages
        self.cache = cache
        self.drive = drive
        self.window = window
        self.fault_ms = fault_ms
        self.counts = KernelCounts()
        self.ra_start = self.ra_size = self.ra_async = 0  # the file's readahead state (struct file_ra_state)

    def read(self, first: int, n: int, t: float, mark: int | None = None) -> None:
        """Read the missing pages of ``[first, first + n)`` (clipped to the file), issued at t."""
        end = min(first + n, self.n_pages)
        cache, page_ms = self.cache, self.drive.page_ms
        p = max(first, 0)
        while p < end:
            if p in cache:
                p += 1
                continue
            run_end = p + 1
            while run_end < end and run_end not in cache:
                run_end += 1
            flow = self.drive.request(t, run_end - p)
            self.counts.requests += 1
            self.counts.pages_read += run_end - p
            for k in range(run_end - p):
                cache.add(p + k, flow + (k + 1) * page_ms)
            if mark is not None and p <= mark < run_end and mark in cache:
                cache.marker.add(mark)
            p = run_end

    def access(self, page: int, t: float) -> float:
        """A thread reads ``page`` at t: the time it can go on (>= t)."""
        cache = self.cache
        if page in cache:
            cache.use(page)
            if page in cache.marker:
                cache.marker.discard(page)
                self._async(page, t)
            ready = cache.ready(page)
            if ready > t:
                self.counts.waits += 1
                return ready
            return t
        self.counts.major_faults += 1
        t += self.fault_ms
        if self.window == 0:
            self.read(page, 1, t)
        else:
            w = self.window
            self.ra_start, self.ra_size, self.ra_async = max(0, page - w // 2), w, w // 4
            self.read(self.ra_start, w, t, mark=self.ra_start + w - w // 4)
        if page not in cache:  # a capacity below the window evicted it at once: read it alone
            self.read(page, 1, t)
        cache.use(page)
        return max(t, cache.ready(page))

    def _async(self, page: int, t: float) -> None:
        w = self.window
        if w == 0:
            return
        self.counts.async_readaheads += 1
        if page == self.ra_start + self.ra_size - self.ra_async:
            self.ra_start += self.ra_size
            self.ra_size = next_ra_size(self.ra_size, w)
        else:  # a marker without the state that set it (another window was read since)
            start = next((p for p in range(page + 1, min(page + 1 + w, self.n_pages)) if p not in self.cache), None)
            if start is None:
                return
            self.ra_start = start
            self.ra_size = next_ra_size(start - page + w, w)
        self.ra_async = self.ra_size
        self.read(self.ra_start, self.ra_size, t, mark=self.ra_start)

    def evict(self, which: np.ndarray) -> None:
        """Drop the resident pages ``which[page]`` says to (``--cold``: the expert pages), unaccounted."""
        for page in [p for p in list(self.cache.pages()) if which[p]]:
            self.cache.discard(page)

    def willneed(self, first: int, end: int, t: float) -> None:
        self.counts.willneed_ranges += 1
        self.read(first, end - first, t)


# --- the events: the compute thread and the consumer's workers on one kernel --------------------


class _Engine:
    """Actors (generators yielding the time of their next action, or None to sleep) run in time order."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Generator]] = []
        self._n = 0

    def at(self, t: float, actor: Generator) -> None:
        heapq.heappush(self._heap, (t, self._n, actor))
        self._n += 1

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else math.inf

    def run(self) -> None:
        while self._heap:
            _, _, actor = heapq.heappop(self._heap)
            try:
                t = next(actor)
            except StopIteration:
                continue
            if t is not None:
                self.at(t, actor)


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
    workers: int = 2  # the consumer's worker threads (ONEBIT_MOE_PREFETCH_THREADS)
    drain: bool = True  # --cold read mode: each token waits for its own reads (the benchmark's DEBUG_DRAIN)
    prefill: bool = True  # replay the trace's prefill rows first, untimed (they fill the page cache)
    page_size: int = PAGE_SIZE
    # the consumer's room rule (ONEBIT_MOE_PREFETCH_ROOM=R): it issues nothing while the page cache the
    # process can have (here capacity_pages; unbounded: never) is below R x the mapped bytes one token
    # reads (ExpertLayout.token_need_bytes); 0: no rule (the model's default: the runs measured before it)
    prefetch_room: float = 0.0

    def __post_init__(self) -> None:
        if not self.layer_ms >= 0:
            raise ValueError(f"layer time must be >= 0 ms, not {self.layer_ms}")
        if not 0 <= self.route_at <= 1:
            raise ValueError(f"route_at must be in [0, 1], not {self.route_at}")
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, not {self.workers}")
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
    room_held: bool = False  # the room rule held the consumer off (it issued nothing)

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
    """One (token, layer): the experts it computes and the candidates the consumer reads for the next layer."""

    layer: int
    demand: tuple[int, ...]
    next_pred: tuple[int, ...] | None  # None: the next layer is not predicted for this token


def _steps(routing: Routing, oracle: bool = False) -> list[list[_Step]]:
    """Per decode token, per layer with a record: the experts, and the next layer's prediction
    (the trace's read set; with ``oracle``, the next layer's actual experts)."""
    local = {layer: routing.local_index(layer) for layer in routing.layers}
    out = []
    for k in range(routing.n_tokens):
        steps = []
        for layer, lr in routing.layers.items():
            i = int(local[layer][k])
            if i < 0:
                continue
            nxt = routing.layers.get(layer + 1)
            pred = None
            if nxt is not None and layer + 1 in routing.predicted_layers and routing.has_predictor:
                j = int(local[layer + 1][k])
                if j >= 0:
                    ids = (nxt.actual if oracle else nxt.trace_pred)[j].tolist()
                    pred = tuple(int(e) for e in dict.fromkeys(ids) if e >= 0)
            steps.append(_Step(layer, tuple(int(e) for e in lr.actual[i].tolist()), pred))
        out.append(steps)
    return out


def prefill_steps(trace: Trace, oracle: bool = False) -> list[_Step]:
    """The prefill rows (not DECODE) as one step per layer: the union of their experts and of the
    next layer's predicted read sets (``oracle``: of its actual experts), as one ubatch computes
    and prefetches them."""
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
    return [
        _Step(layer, tuple(sorted(actual[layer])), tuple(sorted(pred[layer + 1])) if layer + 1 in pred else None)
        for layer in sorted(actual)
    ]


def cost_per_layer_ms(steps: Sequence[_Step], cost_ms: float) -> float:
    """The predictor's per-token cost spread over the layers of a token that predict the next one."""
    predicting = sum(1 for s in steps if s.next_pred is not None)
    return cost_ms / predicting if predicting else 0.0


class _Sim:
    """One configuration's actors: the compute thread, the consumer's workers, their queue."""

    def __init__(
        self, kernel: Kernel, engine: _Engine, layout: ExpertLayout, consumer: str, n_workers: int, held: bool = False
    ) -> None:
        self.kernel, self.engine, self.layout, self.consumer = kernel, engine, layout, consumer
        self.held = held  # the room rule holds the consumer off: its op runs, it issues nothing
        self.queue: deque[tuple[float, int, int]] = deque()
        self.workers = [_Worker(self) for _ in range(n_workers if consumer != "off" and not held else 0)]
        self.drain_waiter: _Compute | None = None
        self.ranges = 0

    def push(self, t: float, ranges: Sequence[tuple[int, int]]) -> None:
        """The consumer's op hands ranges to the workers at t."""
        for first, end in ranges:
            self.queue.append((t, first, end))
        self.ranges += len(ranges)
        for w in self.workers:
            if not self.queue:
                break
            if w.asleep:
                w.asleep = False
                w.t = max(w.t, t)
                self.engine.at(w.t, w.gen)

    def idle(self) -> bool:
        return not self.queue and all(w.asleep for w in self.workers)

    def on_worker_idle(self, t: float) -> None:
        if self.drain_waiter is not None and self.idle():
            c, self.drain_waiter = self.drain_waiter, None
            c.t = max(c.t, t)
            self.engine.at(c.t, c.gen)


class _Worker:
    """A consumer worker: ``advise`` issues WILLNEED for each range; ``read`` touches its every page."""

    def __init__(self, sim: _Sim) -> None:
        self.sim = sim
        self.t = 0.0
        self.asleep = True
        self.gen = self._body()

    def _body(self) -> Generator[float | None, None, None]:
        sim, kernel, engine = self.sim, self.sim.kernel, self.sim.engine
        while True:
            while not sim.queue:
                self.asleep = True
                sim.on_worker_idle(self.t)
                yield None
            issued, first, end = sim.queue.popleft()
            self.t = max(self.t, issued)
            if sim.consumer == "advise":
                if self.t > engine.next_time():
                    yield self.t
                kernel.willneed(first, end, self.t)
                continue
            for p in range(first, end):
                if self.t > engine.next_time():
                    yield self.t
                self.t = kernel.access(p, self.t)


class _Compute:
    """The compute thread: layer after layer, token after token; it runs the consumer's op."""

    def __init__(self, sim: _Sim, model: PageModel, predictor: bool, tokens: list[list[_Step]], prefill: list[_Step]):
        self.sim, self.model, self.predictor = sim, model, predictor
        self.tokens, self.prefill = tokens, prefill
        self.t = 0.0
        self.token_ms: list[float] = []
        self.stall_ms = 0.0
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

    def _ranges(self, step: _Step) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        for e in step.next_pred or ():
            out.extend(self.sim.layout.expert_ranges(step.layer + 1, e))
        return out

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
            if step.next_pred is not None:
                self.t += cost
            if sim.consumer != "off" and step.next_pred:
                if self.t > sim.engine.next_time():
                    yield self.t
                self.t += model.op_ms
                if not sim.held:
                    sim.push(self.t, self._ranges(step))
            yield from self._touch(self._demand(step), model.layer_ms - before, timed)
        yield from self._touch(self._dense(None), 0.0, timed)

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
            if sim.consumer == "read" and (not timed or (model.cold and model.drain)) and not sim.idle():
                sim.drain_waiter = self  # the workers wake it when they are done
                yield None
            if timed:
                self.token_ms.append(self.t - start)
                continue
            # the decode starts after the prefill's reads; what it read is counted apart
            self.t = max(self.t, kernel.drive.idle_at)
            self.prefill_counts, kernel.counts = kernel.counts, KernelCounts()
            self.prefill_evicted, sim.ranges = kernel.cache.evicted, 0


def run_config(
    routing: Routing,
    layout: ExpertLayout,
    model: PageModel,
    predictor: str | bool | None,
    consumer: str,
    name: str,
    prefill: Trace | Sequence[_Step] = (),
) -> PageRun:
    """One configuration: the predictor (the trace's, ``"oracle"``: the actual routing of the next
    layer, predicted at no cost; None or False: off), the consumer off, advise or read;
    ``prefill``: the trace (its prefill rows are replayed first, untimed) or those steps. A consumer
    the room rule holds off (``model.prefetch_room``) issues nothing: ``room_held`` in the result."""
    if consumer not in CONSUMERS:
        raise ValueError(f"unknown consumer '{consumer}' (one of {', '.join(CONSUMERS)})")
    if consumer != "off" and not predictor:
        raise ValueError("a consumer needs the predictor")
    oracle = predictor == ORACLE
    if isinstance(prefill, Trace):
        prefill = prefill_steps(prefill, oracle)
    missing = sorted(set(routing.layers) - set(layout.layers))
    if missing:
        raise ValueError(f"no expert tensors for layers {missing} in the layout ({layout.source})")
    if layout.page_size != model.page_size:
        layout = replace(layout, page_size=model.page_size)
    cache = PAGE_CACHES[model.page_cache](model.capacity_pages)
    drive = PageDrive(model.bandwidth, model.latency_ms, model.queue_depth, model.page_size)
    kernel = Kernel(layout.n_pages, cache, drive, model.window_pages, model.fault_ms)
    engine = _Engine()
    need = layout.token_need_bytes(routing.header.n_expert_used)
    held = consumer != "off" and model.room_holds(need)
    sim = _Sim(kernel, engine, layout, consumer, model.workers, held)
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
    )
