"""What both benchmarks share: a configuration, its worker process, the alternating rounds.

Each configuration of ``onebit-bench`` (checks/bench.py) and ``onebit-bench --cold``
(checks/bench_cold.py) runs in its own process (the unpatched and patched libllama cannot
share one): ``python -m onebit_predict.commands.bench --worker`` (checks/worker.py), whose
last stdout line is a JSON :class:`Sample`. :func:`collect` runs every configuration
``rounds`` times, the order alternating round by round so that drift on the machine spreads
over all of them.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("onebit_predict")

WORKER_MODULE = "onebit_predict.commands.bench"  # its --worker flag runs checks/worker.py


class WorkerError(RuntimeError):
    """A worker process failed (its exit code and the end of its stderr)."""


@dataclass(frozen=True)
class Config:
    name: str
    env: dict[str, str]
    pristine: bool = False  # run on the unpatched pin's libllama
    evict: bool = True  # --cold: evict the expert pages before every token (False: the warm reference)


@dataclass(frozen=True)
class BenchOptions:
    """How each worker runs: the rounds, the tokens, the threads, the eviction of --cold."""

    rounds: int = 5
    prompt: int = 32
    generate: int = 64
    threads: int = 2
    text_file: Path | None = None  # feed this file's bytes as token ids
    cold_method: str | None = None  # --cold: the eviction method (None: no eviction)
    memory_limit: int | None = None  # --memory-limit: each run confined to a memory cgroup of this many bytes
    warm: bool = False  # --memory-limit resident: the model file read into the page cache before each run
    extra_bufts: bool = True  # False: the plain CPU kernels (quantized AMX faults on some VMs)


@dataclass(frozen=True)
class Sample:
    tok_s: float
    compute_mib: float
    n_layer: int
    resident_after_evict: float | None = None  # --cold: the most of the expert pages resident as a token started
    read_bytes: int = 0  # bytes read from the drive while decoding (all threads)
    major_faults: int = 0  # major page faults while decoding
    seconds: float = 0.0  # the decode time


def worker_env(lib_dir: Path) -> dict[str, str]:
    """This process's environment without any onebit knob, pointed at lib_dir's libllama."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ONEBIT_MOE_PREDICT", "ONEBIT_MOE_PREFETCH"))}
    env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    return env


def worker_json(cmd_args: Sequence[str], lib_dir: Path, what: str) -> dict:
    """Run a worker with cmd_args; its last stdout line as JSON (WorkerError if it failed)."""
    cmd = [sys.executable, "-m", WORKER_MODULE, "--worker", *cmd_args]
    proc = subprocess.run(cmd, env=worker_env(lib_dir), capture_output=True, text=True)
    if proc.returncode != 0:
        raise WorkerError(f"{what} ({proc.returncode}): {proc.stderr.strip()[-400:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_one(model: Path, cfg: Config, lib_dir: Path, opts: BenchOptions) -> Sample:
    cmd = [
        str(model),
        "--env",
        json.dumps(cfg.env),
        "--prompt",
        str(opts.prompt),
        "--generate",
        str(opts.generate),
        "--threads",
        str(opts.threads),
    ]
    if opts.cold_method and cfg.evict:
        cmd += ["--cold-method", opts.cold_method]
    if opts.text_file:
        cmd += ["--text-file", str(opts.text_file)]
    if not opts.extra_bufts:
        cmd += ["--no-extra-bufts"]
    group = None
    if opts.warm:
        read_through(model)
    if opts.memory_limit is not None:
        from ..llama.cgroup import MemoryCgroup

        group = MemoryCgroup(f"onebit-bench-{os.getpid()}", opts.memory_limit)  # fresh for every run
        cmd += ["--cgroup", str(group.path)]
    try:
        out = worker_json(cmd, lib_dir, f"{cfg.name}: the worker failed")
    finally:
        if group is not None:
            group.remove()
    return Sample(
        out["tok_s"],
        out["compute_mib"],
        out["n_layer"],
        out.get("resident_after_evict"),
        out["read_bytes"],
        out["major_faults"],
        out["seconds"],
    )


def read_through(path: Path, chunk: int = 8 << 20) -> None:
    """Read a file once, so that its pages are in the page cache when a worker maps it."""
    with open(path, "rb", buffering=0) as f:
        while f.read(chunk):
            pass


def collect(
    model: Path, cfgs: Sequence[Config], lib: Path, lib_pristine: Path | None, opts: BenchOptions
) -> dict[str, list[Sample]]:
    """opts.rounds samples of every configuration, the order alternating round by round."""
    samples: dict[str, list[Sample]] = {c.name: [] for c in cfgs}
    for rnd in range(opts.rounds):
        order = list(cfgs) if rnd % 2 == 0 else list(reversed(cfgs))
        for cfg in order:
            lib_dir = lib_pristine if cfg.pristine else lib
            samples[cfg.name].append(run_one(model, cfg, lib_dir, opts))
            logger.info("round %d/%d %s: %.1f tok/s", rnd + 1, opts.rounds, cfg.name, samples[cfg.name][-1].tok_s)
    return samples
