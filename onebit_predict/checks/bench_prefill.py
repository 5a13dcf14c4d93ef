"""Prompt processing under a real memory limit (``onebit-bench MODEL --memory-limit L --prompt-tokens N --ubatch U``).

Beside the decode rows of checks/bench_memory.py: every configuration of ``--rows`` (at every
``--read-ahead-kb`` and ``--drive``, as the decode rows) once per prompt length N of ``--prompt-tokens``
and ubatch U of ``--ubatch`` (default PREFILL_UBATCH_DEFAULT, llama.cpp's n_ubatch), each a run of its
own as a decode row's is (checks/rounds.py ``run_one``: a fresh worker in a fresh cgroup, the model
dropped from the page cache and proven evicted first), its rounds alternating. Its cgroup holds the
limit plus its anonymous memory's growth over a decode run's (:func:`memory_extra`: the compute and
work buffers, which grow with the ubatch), so that a larger ubatch does not leave the page cache less
room. The worker processes an N-token prompt in calls of U tokens (n_batch = n_ubatch = U) and decodes
nothing (checks/worker.py ``timed_prefill``); the prompt's tokens are ``--text-file``'s bytes repeated,
else the built-in stream.

A prefill row (:class:`PrefillRow`, the report's ``prefill_rows``, a list of its own so that the decode
rows and costmodel/measured.py's reading of them do not change) is named after its configuration with two
qualifiers (costmodel/row_config.py ``PrefillConfig``: ``route, prefill 512, ubatch 128``). It reports
prompt tok/s (N over the wall time of the prompt's decode calls; median, min, max over the rounds) against
"patched off" at the same limit, drive, read_ahead_kb, N and U, and per prompt token: the bytes read from
the drive and the major faults (as a decode row), where the time went (``prefill``, a
costmodel/measured.py ``DecodeSplit`` per prompt token: compute and waiting, compute labelled
``process`` with more than one thread; the read requests and their mean size; route time's expert hit
rate) and the floor a prefill reads at most once per ubatch: ``expert_bytes_per_ubatch_mib``, the
model's expert bytes times ceil(N / U), over N, in MiB, for the bytes read per token to be held against
(what stays resident between ubatches is what a prefill under the limit reads less than it).

The oracle row is left out: its recorded routing is of the decode's tokens, not of a prompt's. The
prefill runs write no trace (their rows report no recall).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from ..constants import COMPUTE_THREAD, ENV_OUT, PREFILL_UBATCH_DEFAULT
from ..costmodel.measured import RESIDENT, DecodeSplit
from ..costmodel.row_config import PrefillConfig, RowConfig
from .bench_cold import RowPlan, pct
from .rounds import BenchOptions, Config, collect, decode_split, probe_memory


@dataclass(frozen=True)
class PrefillPlan:
    """A prefill row: its configuration, and the worker's run of it."""

    config: PrefillConfig
    run: Config

    @property
    def name(self) -> str:
        return self.run.name


def ubatches(prompt_tokens: Sequence[int] | None, ubatch: Sequence[int] | None) -> list[int]:
    """--ubatch's values (PREFILL_UBATCH_DEFAULT where only --prompt-tokens is given; none without it)."""
    if not prompt_tokens:
        return []
    return list(ubatch or [PREFILL_UBATCH_DEFAULT])


def prefill_plans(plans: Sequence[RowPlan], prompt_tokens: Sequence[int], ubatch: Sequence[int]) -> list[PrefillPlan]:
    """Each decode configuration of ``plans`` but the oracle at each (N, U), as the worker runs it: the
    decode row's environment without its trace, its read_ahead_kb and drive, the prompt and ubatch."""
    out = []
    for n in prompt_tokens:
        for u in ubatch:
            for plan in plans:
                if plan.config.oracle:
                    continue  # its recorded routing is the decode's tokens'
                pc = PrefillConfig(plan.config, n, u)
                env = {k: v for k, v in plan.run.env.items() if k != ENV_OUT}
                run = Config(pc.name, env, read_ahead_kb=plan.run.read_ahead_kb, drive=plan.run.drive,
                             prompt_tokens=n, ubatch=u)  # fmt: skip
                out.append(PrefillPlan(pc, run))
    return out


def expert_floor_mib(expert_bytes: int, prompt_tokens: int, ubatch: int) -> float:
    """MiB per prompt token if every ubatch read every expert once: expert_bytes * ceil(N / U) / N."""
    return expert_bytes * math.ceil(prompt_tokens / ubatch) / prompt_tokens / 2**20


@dataclass(frozen=True)
class PrefillRow:
    """One configuration's prompt of ``prompt_tokens`` in ubatches of ``ubatch`` at one memory limit
    (limit_bytes 0: resident); every ``*_per_token`` is per prompt token, medians over the rounds."""

    limit_bytes: int
    name: str
    prompt_tokens: int
    ubatch: int
    median_prompt_tok_s: float
    min_prompt_tok_s: float
    max_prompt_tok_s: float
    ratio_to_off: float  # against patched off at the same limit, drive, read_ahead_kb, prompt and ubatch
    read_mib_per_token: float
    major_faults_per_token: float
    expert_bytes_per_ubatch_mib: float  # the floor: expert bytes * ceil(N / U) / N, MiB per prompt token
    env: dict[str, str] = field(default_factory=dict)
    config: RowConfig = RowConfig()  # the decode row's configuration (its report's "config" object)
    prefill: DecodeSplit | None = None  # where the prompt's time went, per prompt token
    limit_extra_mib: float = 0.0  # its cgroup's MiB beyond limit_bytes: its memory's beyond a decode run's

    @property
    def prefill_config(self) -> PrefillConfig:
        return PrefillConfig(self.config, self.prompt_tokens, self.ubatch)


def memory_extra(
    model: Path, plans: Sequence[PrefillPlan], lib: Path, opts: BenchOptions
) -> dict[tuple[int, int], int]:
    """Per (N, U), the bytes of anonymous memory a run of a prompt of N in ubatches of U holds beyond a
    decode row's (at least 0): each from a worker that makes the context, computes one call and stops
    (the compute buffer, which grows with the ubatch, and the CPU backend's work buffers, which do too).

    A limit covers the whole process. A prefill run's cgroup gets these bytes on top of the limit, so that
    its page cache has the decode rows' room: the limit stays a share of the expert bytes. In the grown
    models, 64 wide with experts 21,504 and 63,488 deep, a ubatch of 512 grows it by 537 MiB at 2.7 MiB an
    expert (506 MiB of compute buffer; the experts are 347 MiB), where a real MoE's compute buffer
    (Qwen3-30B-A3B: 2048 wide, experts 768 deep) is a few per cent of its experts."""
    decode = probe_memory(model, Config("decode", {}), lib, opts)["anon_mib"]
    out = {}
    for n, u in sorted({(p.config.prompt_tokens, p.config.ubatch) for p in plans}):
        got = probe_memory(model, Config(f"prefill {n}, ubatch {u}", {}, prompt_tokens=n, ubatch=u), lib, opts)
        out[(n, u)] = max(0, round((got["anon_mib"] - decode) * 2**20))
    return out


def measure_prefill(
    model: Path, plans: Sequence[PrefillPlan], lib: Path, opts: BenchOptions, limits: Sequence[int], expert_bytes: int
) -> list[PrefillRow]:
    """Every prefill configuration at every limit (each limit's rounds alternating), in limit order; under a
    limit each run's cgroup holds its memory's growth beyond a decode run's too (:func:`memory_extra`)."""
    rows = []
    extra = memory_extra(model, plans, lib, opts) if any(limit != RESIDENT for limit in limits) else {}
    for limit in limits:
        resident = limit == RESIDENT
        run_opts = replace(opts, memory_limit=None if resident else limit, warm=resident)
        runs = [p.run if resident else replace(p.run, limit_extra=extra[p.config.prompt_tokens, p.config.ubatch])
                for p in plans]  # fmt: skip
        samples = collect(model, runs, lib, None, run_opts)
        medians = {name: statistics.median(s.tok_s for s in got) for name, got in samples.items()}
        for plan in plans:
            got, pc = samples[plan.name], plan.config
            n = pc.prompt_tokens
            toks = [s.tok_s for s in got]
            rows.append(
                PrefillRow(
                    limit,
                    plan.name,
                    n,
                    pc.ubatch,
                    medians[plan.name],
                    min(toks),
                    max(toks),
                    medians[plan.name] / medians[pc.predictor_off().name],
                    statistics.median(s.read_bytes / n for s in got) / 2**20,
                    statistics.median(s.major_faults / n for s in got),
                    expert_floor_mib(expert_bytes, n, pc.ubatch),
                    dict(plan.run.env),
                    pc.row,
                    decode_split(got, n),
                    0.0 if resident else extra[n, pc.ubatch] / 2**20,
                )
            )
    return rows


def prefill_report(rows: Sequence[PrefillRow], prompt_tokens: Sequence[int], ubatch: Sequence[int]) -> dict[str, Any]:
    """The report's fields of the prefill rows (none without --prompt-tokens: the report as before)."""
    if not prompt_tokens:
        return {}
    return {"prompt_tokens": list(prompt_tokens), "ubatch": list(ubatch), "prefill_rows": [asdict(r) for r in rows]}


PREFILL_COLUMNS = (
    "limit MiB", "configuration", "prompt tok/s (median)", "min", "max", "vs patched off", "MiB read/token",
    "floor MiB/token", "read / floor", "major faults/token", "compute ms/token", "wait ms/token", "requests/token",
    "mean KiB", "expert hit %",
)  # fmt: skip
PREFILL_NOTE = (
    "Prompt processing: each row a prompt of N tokens (prefill N) in calls of U (ubatch U, n_batch = n_ubatch), "
    "from the model evicted, in its own run; vs patched off at the same limit, drive, readahead, N and U. Limit "
    "MiB: the limit, + the MiB its cgroup holds beyond it, the run's memory's growth over a decode run's (so "
    "that the page cache has the decode rows' room). Per "
    "prompt token: MiB read from the drive; floor, the expert bytes read once per ubatch (expert bytes x "
    "ceil(N / U) / N); compute and wait ms as the decode table's (process: every thread's CPU, no wait "
    "separable); the read requests the drive served and their mean size; expert hit (route-time rows)."
)


def markdown_prefill(rows: Sequence[PrefillRow]) -> str:
    """The prefill table, to go under the decode one ("" without prefill rows)."""
    if not rows:
        return ""
    lines = ["| " + " | ".join(PREFILL_COLUMNS) + " |", "|---:|---|" + "---:|" * (len(PREFILL_COLUMNS) - 2)]
    for r in rows:
        limit = f"{r.limit_bytes / 2**20:.0f}" + (f" + {r.limit_extra_mib:.0f}" if r.limit_extra_mib >= 0.5 else "")
        cells = [
            "resident" if r.limit_bytes == RESIDENT else limit,
            r.name,
            f"{r.median_prompt_tok_s:.1f}",
            f"{r.min_prompt_tok_s:.1f}",
            f"{r.max_prompt_tok_s:.1f}",
            f"{r.ratio_to_off:.3f}",
            f"{r.read_mib_per_token:.3f}",
            f"{r.expert_bytes_per_ubatch_mib:.3f}",
            f"{r.read_mib_per_token / r.expert_bytes_per_ubatch_mib:.2f}" if r.expert_bytes_per_ubatch_mib else "-",
            f"{r.major_faults_per_token:.2f}",
            *_split_cells(r.prefill),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", PREFILL_NOTE])


def _split_cells(d: DecodeSplit | None) -> list[str]:
    """compute, wait, requests, mean KiB, expert hit ("-" where a row has no figure)."""
    if d is None:
        return ["-"] * 5
    compute = f"{d.compute_ms:.3f}" + ("" if d.compute_basis == COMPUTE_THREAD else f" ({d.compute_basis})")
    return [
        compute,
        "-" if d.wait_ms is None else f"{d.wait_ms:.3f}",
        "-" if d.requests is None else f"{d.requests:.3f}",
        "-" if d.request_kib_mean is None else f"{d.request_kib_mean:.0f}",
        pct(d.expert_hit),
    ]
