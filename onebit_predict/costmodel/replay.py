"""Replay a layer's routing through an expert cache of N slots: LRU, LFRU or Belady.

The exact rules (docs/cost-model.md, "The cache") in short. Each layer has its own cache
of ``slots`` experts, empty at the first token. Tokens are replayed in decode order; at
token i the layer first receives the prediction P (the predictor's read set, best first),
then demands D = its actual experts, all of which must be resident at once for the layer
to run (so ``slots >= n_expert_used``):

- a demanded expert already resident is a hit; otherwise a miss: it is read (a demand
  read) into a free slot, or into the slot of a victim chosen by the policy among the
  residents that are not in D;
- prefetch ``none``: P is ignored;
- prefetch ``trace`` (charged): before D, every expert of P (at most ``slots`` of them,
  best first) that is not resident is read into the cache (a prefetch read), evicting
  victims chosen among the residents not in P. A resident expert of P is left as it is.
  A prefetch read is *useful* when its expert is in D of the same token, *wasted* otherwise;
- prefetch ``protect`` (free): nothing is read for P; while D's misses evict, the resident
  experts of P (all of them, however many) are spared (victims are chosen outside D and P, or outside D alone when
  nothing else is left).

With ``cold`` (as ``onebit-bench --cold``, which evicts every expert page before each
decoded token), the cache is emptied before every token: nothing survives from one token
to the next, and only the same token's charged prefetch can turn a demand into a hit.

Victims: ``lru`` the least recently used (a demand access or an insertion is a use);
``lfru`` the fewest demand uses over the layer's last ``lfru_window`` tokens, ties to the
least recently used (with a window of 1 it is LRU under prefetch ``none`` and ``protect``,
not under ``trace``: a prefetch insertion is a use for LRU, not for LFRU's window of
demands); ``belady`` (offline, optimal for demand paging) the resident whose next demand
is furthest away, never demanded again being furthest, ties to the least recently used.

Besides the counts, the replay keeps every read it made (which expert, demand or
prefetch, which token) and which read's copy served each demanded expert: the schedule
the timing model (onebit_predict.simulate) plays on a drive.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from ..constants import LFRU_WINDOW_DEFAULT, REPLAY_POLICIES, REPLAY_PREFETCH_MODES

KIND_DEMAND = 0
KIND_PREFETCH = 1


@dataclass(frozen=True)
class CacheConfig:
    """One cache: slots per layer, eviction policy, what the prediction does.

    ``cold``: the cache is emptied before every token (the policy then only chooses
    victims within a token, among that token's prefetches).
    """

    slots: int
    policy: str = "lru"
    prefetch: str = "none"
    lfru_window: int = LFRU_WINDOW_DEFAULT
    cold: bool = False

    def __post_init__(self) -> None:
        if self.slots < 1:
            raise ValueError(f"slots must be at least 1, not {self.slots}")
        if self.policy not in REPLAY_POLICIES:
            raise ValueError(f"unknown policy '{self.policy}' (one of {', '.join(REPLAY_POLICIES)})")
        if self.prefetch not in REPLAY_PREFETCH_MODES:
            raise ValueError(f"unknown prefetch mode '{self.prefetch}' (one of {', '.join(REPLAY_PREFETCH_MODES)})")
        if self.lfru_window < 1:
            raise ValueError(f"lfru_window must be at least 1, not {self.lfru_window}")


@dataclass(frozen=True)
class CacheCounts:
    """Sums over the tokens of one layer (or of several, added together)."""

    tokens: int = 0
    demand: int = 0  # demanded experts (sum of |D|)
    hits: int = 0  # of them, resident when demanded
    demand_reads: int = 0  # misses: read on demand
    prefetch_reads: int = 0
    prefetch_useful: int = 0  # prefetch reads whose expert the same token demanded

    def __add__(self, other: CacheCounts) -> CacheCounts:
        return CacheCounts(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})

    @property
    def reads(self) -> int:
        return self.demand_reads + self.prefetch_reads

    @property
    def prefetch_wasted(self) -> int:
        return self.prefetch_reads - self.prefetch_useful

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.demand if self.demand else None

    def metrics(self) -> dict[str, int | float | None]:
        per_tok = (lambda x: x / self.tokens) if self.tokens else (lambda x: None)
        return {
            "tokens": self.tokens,
            "demand": self.demand,
            "hits": self.hits,
            "hit_rate": self.hit_rate,
            "demand_reads": self.demand_reads,
            "prefetch_reads": self.prefetch_reads,
            "prefetch_useful": self.prefetch_useful,
            "prefetch_wasted": self.prefetch_wasted,
            "reads": self.reads,
            "reads_per_token": per_tok(self.reads),
        }


@dataclass(frozen=True, eq=False)
class LayerReplay:
    """A layer's counts and its read schedule.

    Row i's reads are ``load_*[start[i]:start[i+1]]``, its prefetch reads first
    (``n_prefetch[i]`` of them), then its demand reads. ``serve[i, j]`` is the read whose
    copy served ``demand[i, j]`` (an earlier one on a hit).
    """

    counts: CacheCounts
    load_expert: np.ndarray  # (n_loads,) int32
    load_kind: np.ndarray  # (n_loads,) int8: KIND_DEMAND or KIND_PREFETCH
    load_useful: np.ndarray  # (n_loads,) bool: a prefetch read of an expert the same token demanded
    start: np.ndarray  # (n + 1,) int64
    n_prefetch: np.ndarray  # (n,) int64
    serve: np.ndarray  # (n, n_used) int64
    hit: np.ndarray  # (n, n_used) bool


def _candidates(pred_row: Sequence[int], limit: int | None) -> list[int]:
    """The prediction's distinct ids, best first, -1 dropped, at most ``limit`` (None: all)."""
    out: list[int] = []
    for e in pred_row:
        if e >= 0 and e not in out:
            out.append(e)
            if len(out) == limit:
                break
    return out


def _demand_rows(demand: np.ndarray) -> dict[int, list[int]]:
    """belady: expert -> the ascending rows that demand it."""
    n, n_used = demand.shape
    occ: dict[int, list[int]] = {}
    flat_rows = np.repeat(np.arange(n), n_used)
    flat_ids = demand.reshape(-1)
    order = np.lexsort((flat_rows, flat_ids))
    ids_sorted, rows_sorted = flat_ids[order], flat_rows[order]
    bounds = np.flatnonzero(np.diff(ids_sorted)) + 1
    for ids, rows in zip(np.split(ids_sorted, bounds), np.split(rows_sorted, bounds)):
        if len(ids):
            occ[int(ids[0])] = rows.tolist()
    return occ


class _LayerCache:
    """The state of one layer's replay: its residents, the policy's bookkeeping, every read made.

    The residents are kept least recently used first (a demand hit moves one to the end, an
    insertion appends it), each with the read that brought its copy. Every policy scans
    them in this order and keeps the first best candidate: ties go to the least recent.
    """

    def __init__(self, cfg: CacheConfig, demand: np.ndarray) -> None:
        self.cfg = cfg
        self.never = len(demand) + 1  # belady: the next use of an expert never demanded again
        self.occ = _demand_rows(demand) if cfg.policy == "belady" else {}
        self.res: OrderedDict[int, int] = OrderedDict()  # resident expert -> the read of its copy
        self.nxt: dict[int, int] = {}  # belady: a resident's next demand row (kept exact: see insert)
        self.count: dict[int, int] = {}  # lfru: demand uses over the window
        self.window: deque[list[int]] = deque()  # lfru: the demands of the last lfru_window tokens
        self.load_expert: list[int] = []
        self.load_kind: list[int] = []
        self.load_useful: list[bool] = []
        self.hits = 0

    @property
    def n_reads(self) -> int:
        return len(self.load_expert)

    def next_use(self, e: int, i: int) -> int:
        """belady: the first row >= i that demands e (``never`` if none)."""
        rows = self.occ.get(e)
        if not rows:
            return self.never
        k = bisect_left(rows, i)
        return rows[k] if k < len(rows) else self.never

    def _victim_lfru(self, exclude: set[int]) -> int | None:
        best, best_key = None, 0
        for e in self.res:
            if e not in exclude:
                c = self.count.get(e, 0)
                if best is None or c < best_key:
                    best, best_key = e, c
                    if c == 0:
                        break
        return best

    def _victim_belady(self, exclude: set[int]) -> int | None:
        best, best_key = None, 0
        for e in self.res:
            if e not in exclude:
                u = self.nxt[e]
                if best is None or u > best_key:
                    best, best_key = e, u
                    if u == self.never:
                        break
        return best

    def victim(self, exclude: set[int]) -> int | None:
        """The resident to evict, outside exclude (None when every resident is excluded)."""
        if self.cfg.policy == "lru":
            return next((e for e in self.res if e not in exclude), None)
        if self.cfg.policy == "lfru":
            return self._victim_lfru(exclude)
        return self._victim_belady(exclude)

    def insert(self, e: int, kind: int, useful: bool, exclude: set[int], fallback: set[int], i: int) -> None:
        """Read e into the cache at row i, evicting a victim outside exclude (else outside fallback)."""
        if len(self.res) >= self.cfg.slots:
            v = self.victim(exclude)
            if v is None:
                v = self.victim(fallback)
            assert v is not None  # slots >= n_used and |P| <= slots guarantee one
            del self.res[v]
        self.res[e] = self.n_reads
        if self.cfg.policy == "belady":
            # a demand insertion is used now: its next use is after row i; a prefetch's may be
            # row i itself. A resident's next use changes only when it is demanded, which
            # updates it: the stored value stays exact.
            self.nxt[e] = self.next_use(e, i + 1 if kind == KIND_DEMAND else i)
        self.load_expert.append(e)
        self.load_kind.append(kind)
        self.load_useful.append(useful)

    def prefetch(self, p: list[int], d_set: set[int], i: int) -> None:
        """Charged prefetch: read every expert of P not resident, evicting outside P."""
        p_set = set(p)
        for e in p:
            if e not in self.res:
                self.insert(e, KIND_PREFETCH, e in d_set, p_set, p_set, i)

    def demand(self, d: list[int], exclude: set[int], i: int) -> list[bool]:
        """Serve row i's demand d, reading its misses (victims outside exclude, else outside d); its hits."""
        d_set = set(d)
        row_hit = []
        for e in d:
            if e in self.res:
                self.hits += 1
                row_hit.append(True)
                self.res.move_to_end(e)
                if self.cfg.policy == "belady":
                    self.nxt[e] = self.next_use(e, i + 1)
            else:
                row_hit.append(False)
                self.insert(e, KIND_DEMAND, False, exclude, d_set, i)
        return row_hit

    def count_uses(self, d: list[int]) -> None:
        """lfru: add row's demand to the window, dropping the row that leaves it."""
        self.window.append(d)
        for e in d:
            self.count[e] = self.count.get(e, 0) + 1
        if len(self.window) > self.cfg.lfru_window:
            for e in self.window.popleft():
                self.count[e] -= 1


def replay_layer(demand: np.ndarray, pred: np.ndarray | None, cfg: CacheConfig) -> LayerReplay:
    """Replay one layer: ``demand`` (n, n_used) actual ids, ``pred`` (n, w) predicted ids (-1 pad)."""
    n, n_used = demand.shape
    if cfg.slots < n_used:
        raise ValueError(
            f"slots ({cfg.slots}) must be at least n_expert_used ({n_used}): "
            "a layer needs all its experts resident at once"
        )
    use_pred = cfg.prefetch != "none" and pred is not None
    d_rows = demand.tolist()
    p_rows = pred.tolist() if use_pred else None
    cache = _LayerCache(cfg, demand)
    start = np.zeros(n + 1, dtype=np.int64)
    n_pf = np.zeros(n, dtype=np.int64)
    serve: list[list[int]] = []
    hit: list[list[bool]] = []
    for i in range(n):
        start[i] = cache.n_reads
        if cfg.cold:
            cache.res.clear()  # nothing survives from the last token (stale nxt entries are rewritten on insert)
        d = d_rows[i]
        # a charged prefetch reads at most N (it needs the slots); protection spares all of P
        p = _candidates(p_rows[i], cfg.slots if cfg.prefetch == "trace" else None) if use_pred else []
        if cfg.prefetch == "trace":
            cache.prefetch(p, set(d), i)
            n_pf[i] = cache.n_reads - start[i]
        exclude = set(d) | set(p) if cfg.prefetch == "protect" else set(d)
        hit.append(cache.demand(d, exclude, i))
        serve.append([cache.res[e] for e in d])
        if cfg.policy == "lfru":
            cache.count_uses(d)
    start[n] = cache.n_reads

    kind = np.array(cache.load_kind, dtype=np.int8)
    useful = np.array(cache.load_useful, dtype=bool)
    n_prefetch = int((kind == KIND_PREFETCH).sum())
    counts = CacheCounts(
        tokens=n,
        demand=n * n_used,
        hits=cache.hits,
        demand_reads=len(kind) - n_prefetch,
        prefetch_reads=n_prefetch,
        prefetch_useful=int(useful.sum()),
    )
    serve_a = np.array(serve, dtype=np.int64).reshape(n, n_used)
    hit_a = np.array(hit, dtype=bool).reshape(n, n_used)
    return LayerReplay(counts, np.array(cache.load_expert, dtype=np.int32), kind, useful, start, n_pf, serve_a, hit_a)


@dataclass(frozen=True, eq=False)
class ReplayResult:
    """One cache configuration replayed over the layers of a trace."""

    config: CacheConfig
    layers: dict[int, LayerReplay]

    @property
    def total(self) -> CacheCounts:
        return sum((r.counts for r in self.layers.values()), CacheCounts())


def replay(
    demand_by_layer: dict[int, np.ndarray], pred_by_layer: dict[int, np.ndarray | None], cfg: CacheConfig
) -> ReplayResult:
    """Replay every layer of ``demand_by_layer`` (its predictions in ``pred_by_layer``, None: none)."""
    return ReplayResult(
        cfg, {layer: replay_layer(d, pred_by_layer.get(layer), cfg) for layer, d in demand_by_layer.items()}
    )
