"""The page models' clock, and what every page-model run sets up the same way.

:class:`Engine` runs actors (the compute thread, the consumer's workers: generators yielding the
time of their next action, or None to sleep) in time order; :meth:`Engine.wake` wakes the sleeping
workers when work is queued, :meth:`Engine.op` runs an op on the compute thread in its turn.
:func:`fitted_layout` and :func:`page_drive` are the layout and the drive a run plays on.
costmodel/pages.py (the page cache's configurations) and costmodel/anon.py (keep anon) build on them.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Generator, Iterable
from dataclasses import replace
from typing import Protocol

from .drive_rates import DriveRates
from .kernel import PageDrive
from .layout import ExpertLayout
from .routing import Routing


class Clocked(Protocol):
    """An actor's own time (the compute thread's, a worker's)."""

    t: float


class Sleeper(Clocked, Protocol):
    """A worker the engine can wake: its time, whether it sleeps, its generator."""

    asleep: bool
    gen: Generator


class DriveSpec(Protocol):
    """The drive's part of a page model (pages.py ``PageModel``)."""

    bandwidth: float
    latency_ms: float
    queue_depth: int
    page_size: int
    max_request_bytes: int | None
    drive_rates: DriveRates | None


class Engine:
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

    def op(self, actor: Clocked, ms: float) -> Generator[float, None, None]:
        """An op of ``ms`` on ``actor`` (the compute thread: the consumer's route-time or guesses' op):
        it waits its turn in time order behind what the engine has before it, then takes its time."""
        if actor.t > self.next_time():
            yield actor.t
        actor.t += ms

    def wake(self, workers: Iterable[Sleeper], t: float, queued: Callable[[], bool]) -> None:
        """Work was queued at t: the sleeping workers wake (each at t or its own later time) while
        ``queued()`` says some is left for them."""
        for w in workers:
            if not queued():
                break
            if w.asleep:
                w.asleep = False
                w.t = max(w.t, t)
                self.at(w.t, w.gen)


def fitted_layout(routing: Routing, layout: ExpertLayout, page_size: int) -> ExpertLayout:
    """The layout at the model's page size; ValueError when it lacks a layer the trace routes."""
    missing = sorted(set(routing.layers) - set(layout.layers))
    if missing:
        raise ValueError(f"no expert tensors for layers {missing} in the layout ({layout.source})")
    return layout if layout.page_size == page_size else replace(layout, page_size=page_size)


def page_drive(model: DriveSpec) -> PageDrive:
    """The model's drive: its bandwidth, latency and depth (or its rates), requests up to its largest."""
    max_pages = None if model.max_request_bytes is None else model.max_request_bytes // model.page_size
    return PageDrive(
        model.bandwidth, model.latency_ms, model.queue_depth, model.page_size, max_pages, model.drive_rates
    )
