"""What ``onebit-bench --json`` measured, read for the model to be checked against (and plotted).

Two reports carry rows the page-granular model (cache/pages.py) can be played against:

- ``onebit-bench MODEL --memory-limit 50%,25% --json`` (commands/bench.py ``_memory``):
  top-level ``expert_bytes`` (all the routed experts' bytes), ``drive``
  (``bandwidth_mb_s``, ``page_read_us``), ``memory_limits`` and ``rows``, one per
  configuration and limit (checks/bench_memory.py ``MemoryRow``: ``limit_bytes``, ``name``,
  ``median_tok_s``, ``read_mib_per_token``, ``major_faults_per_token``, ...);
- ``onebit-bench MODEL --cold --json`` (``_cold``): ``cold: true``, ``drive``, ``rows``
  (checks/bench_cold.py ``ColdRow``), the first of them the model resident ("patched off,
  warm").

:func:`load_measured` reads either (ValueError, exit 2, with what is missing otherwise).
Optional fields the model uses where a report has them: ``drive.read_ahead_kb`` (the
device's readahead), ``process_bytes`` (what a run holds in its cgroup besides the model's
page cache) at the top level or in a row, ``drive_samples`` (several drive measurements:
their median bandwidth and latency are used), a row's ``env`` (the configuration's ONEBIT_*
variables, written since the consumer's room rule: the knobs the model plays the row with).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

OFF = "patched off"
WARM = "patched off, warm"
RESIDENT = 0  # a memory report's limit_bytes for its resident runs (no cgroup, the file read in first)
NO_GUARD = "no guard"


@dataclass(frozen=True)
class MeasuredRow:
    limit_bytes: int | None  # None: --cold (no limit, every expert page evicted before each token)
    name: str  # the configuration: "patched off", "router", "router + advise", ...
    tok_s: float
    min_tok_s: float | None
    max_tok_s: float | None
    ratio_to_off: float | None
    read_mib_per_token: float | None
    major_faults_per_token: float | None
    process_bytes: int | None = None
    env: dict[str, str] | None = None  # the row's ONEBIT_* knobs; None in reports written before they were

    @property
    def resident(self) -> bool:
        return self.limit_bytes == RESIDENT or self.name == WARM

    @property
    def parts(self) -> tuple[str | None, str, int | None, bool]:
        """(predictor or None, consumer, depth or None, guard off) of a name such as
        "block + advise, depth 16, no guard" (checks/bench_memory.py's names)."""
        head, *quals = [x.strip() for x in self.name.split(",")]
        pred, _, consumer = head.partition(" + ")
        depth = next((int(q.split()[1]) for q in quals if q.startswith("depth ") and q.split()[1].isdigit()), None)
        return (None if pred == OFF else pred), (consumer or "off"), depth, NO_GUARD in quals


@dataclass(frozen=True)
class Measured:
    path: Path
    kind: str  # "memory" or "cold"
    model: str
    expert_bytes: int | None  # all the routed experts' bytes of the model
    bandwidth: float | None  # bytes per second
    latency_us: float | None
    read_ahead_kb: int | None
    process_bytes: int | None
    threads: int | None
    generate: int | None
    prompt: int | None
    rows: tuple[MeasuredRow, ...]

    @property
    def warm_tok_s(self) -> float | None:
        """The resident run's decode tok/s: --cold's "patched off, warm" row, a memory report's
        "patched off" at the limit ``resident`` (RESIDENT)."""
        return next((r.tok_s for r in self.rows if r.resident and r.name in (WARM, OFF)), None)

    def timed_rows(self) -> list[MeasuredRow]:
        """The rows a model plays: every one but the resident runs."""
        return [r for r in self.rows if not r.resident]

    @property
    def has_env(self) -> bool:
        """The report records each row's knobs (written since the room rule)."""
        return any(r.env is not None for r in self.rows)

    @property
    def limits(self) -> list[int | None]:
        return list(dict.fromkeys(r.limit_bytes for r in self.timed_rows()))


def _num(d: dict, key: str) -> float | None:
    v = d.get(key)
    return None if v is None else float(v)


def load_measured(path: str | Path) -> Measured:
    """An onebit-bench --memory-limit or --cold --json report; ValueError when it is neither."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError:
        raise
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list) or not data["rows"]:
        raise ValueError(f"{path}: not an onebit-bench --json report (no rows)")
    if data.get("cold"):
        kind = "cold"
    elif "memory_limits" in data or any("limit_bytes" in r for r in data["rows"]):
        kind = "memory"
    else:
        raise ValueError(
            f"{path}: neither an onebit-bench --memory-limit report (memory_limits, rows with limit_bytes) "
            "nor a --cold one (cold: true)"
        )
    drive = data.get("drive") or {}
    samples = data.get("drive_samples") or []
    bw = [float(s["bandwidth_mb_s"]) for s in samples if s.get("bandwidth_mb_s")] or (
        [float(drive["bandwidth_mb_s"])] if drive.get("bandwidth_mb_s") else []
    )
    lat = [float(s["page_read_us"]) for s in samples if s.get("page_read_us") is not None] or (
        [float(drive["page_read_us"])] if drive.get("page_read_us") is not None else []
    )
    rows = []
    for i, r in enumerate(data["rows"]):
        env = r.get("env") if isinstance(r, dict) else None
        if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) for k in env)):
            raise ValueError(f"{path}: row {i} ({r.get('name')!r}): env is not an object of ONEBIT_* variables")
        try:
            limit = None if kind == "cold" else int(r["limit_bytes"])
            rows.append(
                MeasuredRow(
                    limit,
                    str(r["name"]),
                    float(r["median_tok_s"]),
                    _num(r, "min_tok_s"),
                    _num(r, "max_tok_s"),
                    _num(r, "ratio_to_off"),
                    _num(r, "read_mib_per_token"),
                    _num(r, "major_faults_per_token"),
                    None if r.get("process_bytes") is None else int(r["process_bytes"]),
                    None if env is None else {k: str(v) for k, v in env.items()},
                )
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: row {i} lacks a field the comparison needs ({e!r})") from None
    return Measured(
        path,
        kind,
        str(data.get("model", "?")),
        None if data.get("expert_bytes") is None else int(data["expert_bytes"]),
        statistics.median(bw) * 1e6 if bw else None,
        statistics.median(lat) if lat else None,
        None if drive.get("read_ahead_kb") is None else int(drive["read_ahead_kb"]),
        None if data.get("process_bytes") is None else int(data["process_bytes"]),
        None if data.get("threads") is None else int(data["threads"]),
        None if data.get("generate") is None else int(data["generate"]),
        None if data.get("prompt") is None else int(data["prompt"]),
        tuple(rows),
    )


def from_bench(path: Path, mode: str, n_layer: int) -> tuple[float, float | None]:
    """(layer ms, cost % of the trace's mode or None) from onebit-bench --json; ValueError if unusable."""
    try:
        rows = {r["name"]: r for r in json.loads(path.read_text())["rows"]}
        off = float(rows["patched off"]["median_tok_s"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"--bench-json {path}: not an onebit-bench --json report ({e!r})") from None
    if not off > 0:
        raise ValueError(f"--bench-json {path}: 'patched off' has {off} tok/s")
    cost = None
    if mode in rows and float(rows[mode].get("ratio_to_off", 0)) > 0:
        cost = max(0.0, (1.0 / float(rows[mode]["ratio_to_off"]) - 1.0) * 100.0)
    return 1000.0 / off / n_layer, cost
