"""The expert LRU of ``ONEBIT_MOE_PREFETCH_KEEP=lru`` as the page model plays it.

Patch 0025's keep_lru, rule for rule: one LRU per MoE layer over whole experts; at a layer's route
its routed experts become the most recent, and while the layer holds more than its share the least
recent expert not routed now is evicted (a worker pages its slices out). The capacity is the room
(the page cache the process can have) less the mapped bytes a token reads besides its routed
experts, less one layer's routed experts of slack, less the guesses' room (n_expert_used experts,
with a predictor), in experts of one layer's page-rounded expert size, at least n_expert_used; the
share is that over the MoE layers, at least n_expert_used. With a predictor its guesses are read
only into a room of their own (:meth:`ExpertLRU.spec_room`, spec_room): n_expert_used places over
all layers, one per guessed expert the LRU does not hold, until its layer routes; no place free, the
guess is not read (``spec_skipped``); at the route a guess that was not routed is paged out
(``spec_unused``), a routed one joins the LRU. What the model leaves out: the page-out is immediate
at the route (the C queues it for the workers, after the route-time reads).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


def keep_capacity(room_bytes: int, need_bytes: int, expert_bytes: int, n_moe_layers: int, n_expert_used: int,
                  guesses: bool = False) -> int:  # fmt: skip
    """The experts the LRU holds at most (measure_room's keep_cap)."""
    if expert_bytes <= 0:
        raise ValueError(f"an expert's size must be > 0 bytes, not {expert_bytes}")
    other = max(need_bytes - n_moe_layers * n_expert_used * expert_bytes, 0)
    spare = n_expert_used if guesses else 0
    return max(n_expert_used, (room_bytes - other) // expert_bytes - n_expert_used - spare)


class ExpertLRU:
    """Per layer, the experts held, least recent first; :meth:`route` returns what to page out."""

    def __init__(self, capacity: int, n_moe_layers: int, n_expert_used: int, guesses: bool = False) -> None:
        if n_moe_layers < 1:
            raise ValueError("the LRU needs at least one MoE layer")
        self.capacity = capacity
        self.share = max(n_expert_used, capacity // n_moe_layers)
        self.held: dict[int, OrderedDict[int, None]] = {}
        self.evicted = 0
        self.spec_cap = n_expert_used if guesses else 0  # the guesses' places, over all layers
        self.guessed: dict[int, set[int]] = {}  # per layer, the guessed experts holding a place
        self.spec_skipped = self.spec_unused = 0

    def share_of(self, layer: int) -> int:
        """The experts ``layer`` holds at most: the capacity over the MoE layers, at least n_expert_used."""
        return self.share

    def spec_room(self, layer: int, e: int) -> bool:
        """A guess at ``layer``'s expert ``e`` may be read: the LRU holds it (nothing to read), it holds a
        place already, or a place is free (it takes it); else counted as skipped."""
        if not self.spec_cap or e in self.held.get(layer, ()):
            return True
        mine = self.guessed.setdefault(layer, set())
        if e in mine:
            return True
        if sum(len(g) for g in self.guessed.values()) >= self.spec_cap:
            self.spec_skipped += 1
            return False
        mine.add(e)
        return True

    def route(self, layer: int, experts: Iterable[int]) -> list[int]:
        """The layer routed ``experts``: they become its most recent; what to page out: its guesses not
        routed, then the experts it evicts, oldest first."""
        lru = self.held.setdefault(layer, OrderedDict())
        now = list(dict.fromkeys(e for e in experts if e >= 0))
        routed = set(now)
        unused = sorted(self.guessed.pop(layer, set()) - routed)  # the layer's guesses leave their room
        self.spec_unused += len(unused)
        for e in now:
            lru[e] = None
            lru.move_to_end(e)
        out = []
        share = self.share_of(layer)
        for e in list(lru):
            if len(lru) <= share:
                break
            if e not in routed:
                del lru[e]
                out.append(e)
        self.evicted += len(out)
        return unused + out
