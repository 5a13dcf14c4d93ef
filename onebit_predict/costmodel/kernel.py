"""The kernel's side of a mapped file, to the granularity of pages: the page cache, the drive, the
readahead (the page model's rules, docs/cost-model.md, "Pages: the page-granular model").

- :class:`PageCache`: the resident pages, least recently used first, each with the time its
  read completes; a capacity in pages (None: unbounded) evicts from the LRU end;
- :class:`TwoListCache`: the kernel's inactive and active lists (no MGLRU), the default;
- :class:`PageDrive`: the drive of costmodel/simulate.py (FIFO, ``queue_depth`` requests in service,
  latencies overlap, transfers share the bandwidth one after another), where a request is a run
  of contiguous pages (at most ``max_pages``: FUSE's max_read on an emulated drive) and each page
  of it is complete as its bytes have flowed;
- :class:`Kernel`: a page access (a hit, a wait for a read in flight, or a major fault with its
  read-around window and the readahead marker that pulls the next window), a ``WILLNEED``
  range, the counts.

The read-around window is the device's ``read_ahead_kb`` (llama/drive.py ``device_read_ahead_kb``
reads it on this machine) times LLAMA_FADV_SEQUENTIAL_FACTOR.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from .drive_rates import DriveRates
from .layout import PAGE_SIZE

# llama.cpp opens the GGUF with posix_fadvise(POSIX_FADV_SEQUENTIAL), which doubles the
# file's readahead (file->f_ra.ra_pages = 2 * the device's read_ahead_kb); its mapping
# shares that state, so a fault's read-around window is twice read_ahead_kb
LLAMA_FADV_SEQUENTIAL_FACTOR = 2


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
    x_i + (k + 1) * page / bandwidth, the request at c_i = x_i + n * page / bandwidth. With ``rates``
    (the drive as fio times it: drive_rates.py) a request's bandwidth is the rate at its size and at
    the requests in flight when it enters (itself included), and the latency is in that rate.
    """

    def __init__(
        self,
        bandwidth: float,
        latency_ms: float,
        queue_depth: int,
        page_size: int = PAGE_SIZE,
        max_pages: int | None = None,
        rates: DriveRates | None = None,
    ) -> None:
        if not bandwidth > 0:
            raise ValueError(f"bandwidth must be positive, not {bandwidth}")
        if not latency_ms >= 0:
            raise ValueError(f"latency must be >= 0, not {latency_ms}")
        if queue_depth < 1:
            raise ValueError(f"queue depth must be at least 1, not {queue_depth}")
        if max_pages is not None and max_pages < 1:
            raise ValueError(f"a request's largest size must be at least one page, not {max_pages}")
        self.max_pages = max_pages  # the largest request (None: a run of any length is one request)
        self.page_ms = page_size / (bandwidth / 1000.0)
        self.latency_ms = 0.0 if rates is not None else latency_ms
        self.page_size = page_size
        self.rates = rates
        self._completions: deque[float] = deque(maxlen=queue_depth)
        self._last = 0.0
        self.requests = 0
        self.pages = 0

    def request(self, issue_ms: float, n_pages: int) -> tuple[float, float]:
        """Issue a request of n_pages: the time its data starts to flow and a page's time in it (page k
        done at flow + (k+1) * page_ms)."""
        q = self._completions
        enter = max(issue_ms, q[0]) if len(q) == q.maxlen else issue_ms
        page_ms = self.page_ms
        if self.rates is not None:
            in_flight = 1 + sum(1 for c in q if c > enter)
            page_ms = self.page_size / (self.rates.rate(n_pages * self.page_size, in_flight) / 1000.0)
        flow = max(enter + self.latency_ms, self._last)
        done = flow + n_pages * page_ms
        q.append(done)
        self._last = done
        self.requests += 1
        self.pages += n_pages
        return flow, page_ms

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
    pread_ranges: int = 0
    pages_read: int = 0
    requests: int = 0


class Kernel:
    """What the kernel does for a mapped file, to the granularity of pages.

    ``window`` pages: the read-around of a major fault (0: ``MADV_RANDOM``, the fault reads
    its own page); ``random[page]`` true: that page's mapping is ``MADV_RANDOM`` (the consumer's
    ``random`` on the expert tensors): a fault there reads its own page and a marker there pulls
    nothing. A fault on page p reads the missing pages of
    ``[max(0, p - window / 2), + window)`` and marks the page ``window / 4`` before that
    window's end; an access to a marked page (the readahead marker) reads the next window
    (``next_ra_size``) after the one the file's readahead state last read, or, when the marker
    is not where that state expects it, from the first missing page after it. ``willneed``
    reads the missing pages of a range (``force_page_cache_ra``: no window, no marker). Each
    run of missing pages is one drive request (split at the drive's ``max_pages``); pages enter the
    cache at the request's issue.
    """

    def __init__(
        self,
        n_pages: int,
        cache: PageCache | TwoListCache,
        drive: PageDrive,
        window: int,
        fault_ms: float = 0.0,
        random: np.ndarray | None = None,
    ) -> None:
        if window < 0:
            raise ValueError(f"readahead window must be >= 0 pages, not {window}")
        self.n_pages = n_pages
        self.cache = cache
        self.drive = drive
        self.window = window
        self.fault_ms = fault_ms
        self.random = random
        self.counts = KernelCounts()
        self.ra_start = self.ra_size = self.ra_async = 0  # the file's readahead state (struct file_ra_state)

    def read(self, first: int, n: int, t: float, mark: int | None = None, whole: bool = False) -> float:
        """Read the missing pages of ``[first, first + n)`` (clipped to the file), issued at t; ``whole``:
        each request's pages are ready when all of it is (a pread's bio), not as its bytes flow. The
        time the last page read is ready (t: none read)."""
        end = min(first + n, self.n_pages)
        cache = self.cache
        p = max(first, 0)
        last = t
        while p < end:
            if p in cache:
                p += 1
                continue
            run_end = p + 1
            cap = end if self.drive.max_pages is None else min(end, p + self.drive.max_pages)
            while run_end < cap and run_end not in cache:
                run_end += 1
            flow, page_ms = self.drive.request(t, run_end - p)
            self.counts.requests += 1
            self.counts.pages_read += run_end - p
            n_run = run_end - p
            for k in range(n_run):
                cache.add(p + k, flow + (n_run if whole else k + 1) * page_ms)
            last = max(last, flow + n_run * page_ms)
            if mark is not None and p <= mark < run_end and mark in cache:
                cache.marker.add(mark)
            p = run_end
        return last

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
        if self.window == 0 or (self.random is not None and self.random[page]):
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
        if w == 0 or (self.random is not None and self.random[page]):
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

    def pread(self, first: int, end: int, t: float) -> float:
        """A ``pread`` of pages ``[first, end)`` through the file at t (the consumer opened it
        POSIX_FADV_RANDOM: no readahead, no window): the missing pages in requests up to the drive's
        largest, each ready when all of it is; the time the whole range is in (pages already under
        I/O included)."""
        self.counts.pread_ranges += 1
        done = self.read(first, end - first, t, whole=True)
        for p in range(first, min(end, self.n_pages)):
            if p in self.cache:
                done = max(done, self.cache.ready(p))
        return done
