"""A server's turns under a memory limit: decode, a long prompt, decode again (docs/results.md, "A server's
next request").

llama-server runs in a fresh memory cgroup (onebit_predict.llama.cgroup, as onebit-bench makes them) with
each configuration: off, route with the LRU in the page cache (README's line), and keep anon. The model's
expert pages are proven evicted before each server starts, and read_ahead_kb is set on the model's drive
for the whole run (restored on exit). Each server answers three requests, none of its prompt cached:

1. a short prompt and ``--generate`` tokens decoded: keep anon's slots fill;
2. a ``--prompt`` token prompt and one token: its ubatches stream, what the slots held is given back;
3. another short prompt and ``--generate`` tokens: the slots fill again.

Each turn's prompt and decode tok/s are the server's own timings; after each turn the cgroup's memory.stat
is read (shmem: keep anon's memfd slots; cache: the page cache, shmem included; rss), and the KiB of the model's
mapping advised random (smaps' "rr": faults there read a page at a time); each turn's reads come from the
model's drive's /proc/diskstats line (every process's: run it alone). Rounds alternate the
configurations, each round and configuration a server of its own; ``--beside DIR`` runs another build's
(bin/) configurations in the same rounds, their rows named with ``--beside-label``; ``--json FILE`` writes
every round. The table's medians and ratios to off are over the runs that answered every turn.

    python tools/server_turns.py $G/w21504-q4_k_m.gguf --limit-mib 175 --ubatch 16 --rounds 5 --json turns.json

Exit 0 when every server answered every turn, 1 when one did not (killed: the cgroup's OOM kills counted),
2 usage (not root, no memory cgroup, no build, a read_ahead_kb that cannot be set).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from onebit_predict.constants import ENV_STATS, EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE
from onebit_predict.llama.cgroup import CgroupError, MemoryCgroup, join
from onebit_predict.llama.diskstats import model_disk, read_diskstats
from onebit_predict.llama.evict import EvictError, random_read_kib, require_evicted
from onebit_predict.llama.paths import build_info
from onebit_predict.llama.read_ahead import ReadAhead, ReadAheadError, block_device

MIB = 1 << 20
TEXT = Path(__file__).resolve().parent.parent / "models" / "heldout.txt"
SHORT_TOKENS = 16
START_S = 120.0
TURN_S = 600.0
ROUTE = ["--moe-prefetch-route", "--moe-prefetch-order", "hits"]
CONFIGS = {
    "off": [],
    "route, keep lru": [*ROUTE, "--moe-prefetch-keep", "lru"],
    "keep anon": ["--moe-prefetch", "pread", "--moe-prefetch-random", *ROUTE, "--moe-prefetch-keep", "anon"],
}
NAMES = "; ".join(CONFIGS)


class TurnError(RuntimeError):
    """A server that did not start or answer (a row that failed: exit 1)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, path: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # the server's own words on what it refused
        raise TurnError(f"{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:300]}") from None


def wait_healthy(port: int, server: subprocess.Popen) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < START_S:
        if server.poll() is not None:
            raise TurnError(f"llama-server exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise TurnError(f"llama-server not ready after {START_S:.0f} s")


def cpu_s(pid: int) -> float:
    """The process's CPU seconds so far, every thread's, user and system (/proc/PID/stat's utime and stime)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prompts(port: int, n_prompt: int) -> list[list[int]]:
    """Three prompts of the held-out text's tokens, none a prefix of another: short, n_prompt, short."""
    tokens = post(port, "/tokenize", {"content": TEXT.read_text()}, 60)["tokens"]
    need = 2 * SHORT_TOKENS + n_prompt
    if len(tokens) < need:
        raise TurnError(f"{TEXT} has {len(tokens)} tokens, the turns need {need}")
    return [tokens[:SHORT_TOKENS], tokens[SHORT_TOKENS : SHORT_TOKENS + n_prompt], tokens[-SHORT_TOKENS:]]


def context_override(model: Path, ctx: int) -> list[str]:
    """llama-server holds a slot's context to the model's training context: where that is below ``ctx`` (the
    tiny grown models' 256 against a 512-token prompt), the key is overridden (it sizes no weight)."""
    import gguf

    try:
        reader = gguf.GGUFReader(model)
        arch = reader.fields["general.architecture"].contents()
        field = reader.fields.get(f"{arch}.context_length")
    except (KeyError, ValueError) as e:
        raise OSError(f"{model}: not a GGUF with an architecture ({e})") from None
    if field is None or int(field.contents()) >= ctx:
        return []
    print(f"server_turns: {arch}.context_length {field.contents()} < -c {ctx}: overridden to {ctx}", file=sys.stderr)
    return ["--override-kv", f"{arch}.context_length=int:{ctx}"]


def one_server(args: argparse.Namespace, name: str, build: Path, label: str) -> dict:
    """One configuration's server (``build``'s llama-server) in its own cgroup: its three turns' timings and
    memory, under ``label``."""
    cg = MemoryCgroup(f"onebit-turns-{os.getpid()}", args.limit_mib * MIB)
    port = free_port()
    cmd = [str(build / "llama-server"), "-m", str(args.model), "-t", "1", "-c", str(args.ctx), "-b", str(args.ubatch),
           "-ub", str(args.ubatch), "-np", "1", "--no-repack", "--host", "127.0.0.1", "--port", str(port),
           *args.llama_args, *CONFIGS[name]]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith("ONEBIT_")}
    env |= {ENV_STATS: "1", "LD_LIBRARY_PATH": str(build)}
    out: dict = {"config": label, "bin": str(build), "turns": [], "error": None}
    try:
        require_evicted(args.model, f"{name}'s server")
        with tempfile.TemporaryFile("w+") as log:  # not a pipe: a full one would stop the server
            server = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                                      preexec_fn=lambda: join(cg.path))  # fmt: skip
            try:
                wait_healthy(port, server)
                turns = prompts(port, args.prompt)
                disk = model_disk(args.model)
                for tokens, n in zip(turns, (args.generate, 1, args.generate)):
                    before, cpu0 = disk and read_diskstats(disk.names), cpu_s(server.pid)
                    body = {"prompt": tokens, "n_predict": n, "cache_prompt": False, "ignore_eos": True,
                            "temperature": 0, "top_k": 1, "seed": 0}  # fmt: skip
                    t = post(port, "/completion", body, TURN_S)["timings"]
                    after = disk and read_diskstats(disk.names)
                    read = after.minus(before) if before and after else None
                    out["turns"].append({"prompt_n": t["prompt_n"], "prompt_tok_s": t["prompt_per_second"],
                                         "predicted_n": t["predicted_n"], "decode_tok_s": t["predicted_per_second"],
                                         **{f"{k}_mib": v for k, v in cg.memory_mib().items()},
                                         "random_kib": random_read_kib(args.model, server.pid),
                                         "read_mib": read and read.sectors * 512 / MIB,
                                         "read_requests": read and read.reads,
                                         "cpu_s": round(cpu_s(server.pid) - cpu0, 3)})  # fmt: skip
            except (TurnError, urllib.error.URLError, OSError, KeyError) as e:
                out["error"] = f"{type(e).__name__}: {e}"
            finally:
                server.terminate()
                try:
                    server.wait(30)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()
            log.seek(0)
            out["log"] = [ln for ln in log.read().splitlines() if "onebit:" in ln]
        out["oom_kills"] = cg.oom_kills()
        return out
    finally:
        cg.remove()


TURN_NAMES = ("decode", "prompt", "decode after")
HEADER = (
    "| configuration | runs | decode tok/s | prompt tok/s | decode after tok/s | prompt vs off | decode after vs off "
    "| prompt requests | prompt mean KiB | shmem MiB after each turn |"
)


def turn_median(runs: list[dict], i: int, field: str) -> float:
    return statistics.median(float(r["turns"][i][field]) for r in runs)


def off_of(label: str) -> str:
    """The off row a row is compared with: its own build's ("keep anon, before" -> "off, before")."""
    for name in CONFIGS:
        if label.startswith(name + ", "):
            return "off, " + label[len(name) + 2 :]
    return "off"


def summary(rounds: list[list[dict]], names: list[str]) -> list[str]:
    """A markdown table: each row's medians over its complete runs (each turn's tok/s; the prompt's read
    requests, their mean size; shmem after each turn), and its ratios to its own build's off where it ran."""
    complete = {n: [r for rnd in rounds for r in rnd if r["config"] == n and not r["error"]] for n in names}
    lines = [HEADER, "|---|" + "---:|" * 9]
    for name, runs in complete.items():
        off = complete.get(off_of(name)) or []
        if not runs:
            lines.append(f"| {name} | 0 |" + " - |" * 8)
            continue
        tok = [turn_median(runs, 0, "decode_tok_s"), turn_median(runs, 1, "prompt_tok_s"),
               turn_median(runs, 2, "decode_tok_s")]  # fmt: skip
        ratio = [
            f"{tok[1] / turn_median(off, 1, 'prompt_tok_s'):.3f}" if off else "-",
            f"{tok[2] / turn_median(off, 2, 'decode_tok_s'):.3f}" if off else "-",
        ]
        reads = [r["turns"][1] for r in runs if r["turns"][1]["read_requests"]]
        requests = statistics.median(t["read_requests"] for t in reads) if reads else None
        mean_kib = statistics.median(t["read_mib"] * 1024 / t["read_requests"] for t in reads) if reads else None
        shmem = "/".join(f"{turn_median(runs, i, 'shmem_mib'):.0f}" for i in range(len(TURN_NAMES)))
        lines.append(
            f"| {name} | {len(runs)} | {tok[0]:.2f} | {tok[1]:.2f} | {tok[2]:.2f} | {ratio[0]} | {ratio[1]} | "
            f"{'-' if requests is None else f'{requests:.0f}'} | {'-' if mean_kib is None else f'{mean_kib:.0f}'} | "
            f"{shmem} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--limit-mib", type=int, required=True, help="the cgroup's memory limit")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--generate", type=int, default=64, help="tokens decoded in turns 1 and 3 (default 64)")
    p.add_argument("--prompt", type=int, default=512, help="turn 2's prompt tokens (default 512)")
    p.add_argument("--ubatch", type=int, default=128, help="-b and -ub (default 128)")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--read-ahead-kb", type=int, default=128, help="set on the model's drive (default 128)")
    p.add_argument("--configs", default=";".join(CONFIGS), help=f"a subset of, with ; between: {NAMES}")
    p.add_argument("--json", type=Path, help="write every round here")
    p.add_argument("--bin", type=Path, help="another build's bin/ (default: this checkout's build)")
    p.add_argument("--beside", type=Path, help="a second build's bin/, its rows in the same rounds (an A/B)")
    p.add_argument("--beside-label", default="beside", help="what its rows' names end with (default: beside)")
    p.add_argument("--llama-args", type=shlex.split, default=[], help="more llama-server arguments")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.configs.split(";") if n.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad or not names or args.rounds < 1:
        p.error(f"--configs takes {NAMES} (not {'; '.join(bad)})" if bad else "nothing to run")
    rounds: list[list[dict]] = []
    try:
        args.llama_args += context_override(args.model, args.ctx)
        build = args.bin or build_info().build_dir / "bin"
        runs = [(n, build, n) for n in names]
        if args.beside:  # another build's rows in the same rounds, alternated with this one's
            runs += [(n, args.beside, f"{n}, {args.beside_label}") for n in names]
        for b in {r[1] for r in runs}:
            if not (b / "llama-server").is_file():
                raise OSError(f"{b} has no llama-server (run ./build.sh first, or name a build's bin/)")
        with ReadAhead(block_device(args.model).read_ahead_file) as ra:
            ra.set(args.read_ahead_kb)
            for i in range(args.rounds):
                order = runs if i % 2 == 0 else runs[::-1]
                rounds.append([one_server(args, n, b, label) for n, b, label in order])
                for r in rounds[-1]:
                    print(f"round {i + 1}, {r['config']}: {r['error'] or 'ok'}", file=sys.stderr)
    except (CgroupError, ReadAheadError, EvictError, OSError) as e:
        print(f"server_turns: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        report = {"model": str(args.model), "limit_mib": args.limit_mib, "read_ahead_kb": args.read_ahead_kb,
                  "llama_args": args.llama_args,
                  "ubatch": args.ubatch, "prompt": args.prompt, "generate": args.generate,
                  "configs": {n: CONFIGS[n] for n in names}, "rows": [r[2] for r in runs],
                  "rounds": rounds}  # fmt: skip
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join(summary(rounds, [r[2] for r in runs])))
    return EXIT_OK if all(not r["error"] for rnd in rounds for r in rnd) else EXIT_CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())
