"""What a memory cgroup's limit does to llama-completion with each keep (docs/results.md, "Keep anon and memory
it cannot give back").

llama-completion decodes in a fresh memory cgroup (onebit_predict.llama.cgroup, as onebit-bench makes them)
with route-time reads and ``--moe-prefetch-keep KEEP`` (anon: with ``--moe-prefetch pread``, readahead off),
the model dropped from the page cache first. With ``--other MIB``, a second process joins the same cgroup
``--other-at`` seconds in, takes that many MiB of anonymous memory (every page touched) and holds it
``--other-hold`` seconds: memory another program asks for while the model decodes. Every 100 ms the
cgroup's memory.stat is sampled (shmem: keep anon's memfd slots; cache: the page cache, shmem included; rss:
anonymous memory; v2's file and anon under v1's names). The stats (ONEBIT_MOE_PREDICT_STATS) are asked for,
and the log keeps their keep lines, the room rule's and the timings (with ``-v`` in ``--llama-args``: the
info lines are printed only then). Prints one line, and with ``--json FILE`` writes the outcome and the samples.

    python tools/keep_pressure.py $G/w21504-q4_k_m.gguf --keep anon --limit-mib 174 --other 25 --json out.json \\
        --llama-args '-c 1024 -b 16 -ub 16'

Exit 0 when llama-completion ran to its end, 1 when it did not (killed: the cgroup's OOM kills counted),
2 usage (not root, no memory cgroup, no build).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from onebit_predict.constants import ENV_STATS, EXIT_CHECK_FAILED, EXIT_OK, EXIT_USAGE
from onebit_predict.llama.cgroup import CgroupError, MemoryCgroup, join
from onebit_predict.llama.evict import drop_file
from onebit_predict.llama.paths import build_info

MIB = 1 << 20
SAMPLE_S = 0.1
PROMPT = Path(__file__).resolve().parent.parent / "models" / "heldout.txt"
OTHER = "import time; b = bytearray({n} << 20); b[::4096] = b'x' * len(b[::4096]); time.sleep({hold})"


def flags(keep: str) -> list[str]:
    out = ["--moe-prefetch-route", "--moe-prefetch-keep", keep, "--moe-prefetch-order", "hits"]
    return ["--moe-prefetch", "pread", "--moe-prefetch-random", *out] if keep == "anon" else out


def run(args: argparse.Namespace) -> dict:
    build = args.bin or build_info().build_dir / "bin"
    cg = MemoryCgroup(f"onebit-pressure-{os.getpid()}", args.limit_mib * MIB)
    try:
        drop_file(args.model)
        cmd = [str(build / "llama-completion"), "-m", str(args.model), "-p", PROMPT.read_text()[: args.prompt_chars],
               "-n", str(args.generate), "-t", "1", "--ignore-eos", "-no-cnv", "--temp", "0", "--no-repack",
               *args.llama_args, *flags(args.keep)]  # fmt: skip
        env = {k: v for k, v in os.environ.items() if not k.startswith("ONEBIT_")}
        env |= {ENV_STATS: "1", "LD_LIBRARY_PATH": str(build)}
        enter = lambda: join(cg.path)  # noqa: E731
        with tempfile.TemporaryFile("w+") as log:  # not a pipe: a full one would stop llama-completion
            llama = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log, env=env,
                                     preexec_fn=enter)  # fmt: skip
            other, other_rc, t0, samples = None, None, time.monotonic(), []
            while llama.poll() is None:
                t = time.monotonic() - t0
                if args.other and other is None and t >= args.other_at:
                    code = OTHER.format(n=args.other, hold=args.other_hold)
                    other = subprocess.Popen([sys.executable, "-c", code], preexec_fn=enter)
                samples.append({"t": round(t, 2), **cg.memory_mib()})
                time.sleep(SAMPLE_S)
            log.seek(0)
            stderr = log.read()
        if other is not None:
            other_rc = other.wait()
        kept = [line for line in stderr.splitlines() if any(w in line for w in ("keep ", "eval time", "prefetch room"))]
        return {"bin": str(build), "keep": args.keep, "limit_mib": args.limit_mib, "other_mib": args.other,
                "other_at_s": args.other_at, "llama_args": args.llama_args, "llama_rc": llama.returncode,
                "other_rc": other_rc, "oom_kills": cg.oom_kills(), "log": kept or stderr.splitlines()[-5:],
                "samples": samples}  # fmt: skip
    finally:
        cg.remove()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--keep", choices=("lru", "anon"), required=True)
    p.add_argument("--limit-mib", type=int, required=True, help="the cgroup's memory limit")
    p.add_argument("--other", type=int, default=0, metavar="MIB", help="a second process takes this much (0: none)")
    p.add_argument("--other-at", type=float, default=8.0, help="seconds after the start (default 8)")
    p.add_argument("--other-hold", type=float, default=8.0, help="seconds it holds it (default 8)")
    p.add_argument("--generate", type=int, default=250)
    p.add_argument("--prompt-chars", type=int, default=120, help="the held-out text's first characters")
    p.add_argument("--json", type=Path, help="write the outcome and the samples here")
    p.add_argument("--bin", type=Path, help="another build's bin/ (default: this checkout's build)")
    p.add_argument("--llama-args", type=shlex.split, default=[], help="more llama-completion arguments ('-c 1024')")
    args = p.parse_args(argv)
    try:
        out = run(args)
    except (CgroupError, OSError) as e:
        print(f"keep_pressure: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    peak = max((s["shmem"] for s in out["samples"]), default=0)
    print(f"keep {out['keep']}, other {out['other_mib']} MiB: llama-completion rc {out['llama_rc']}, the other's rc "
          f"{out['other_rc']}, OOM kills {out['oom_kills']}, shmem at most {peak} MiB")  # fmt: skip
    return EXIT_OK if out["llama_rc"] == 0 else EXIT_CHECK_FAILED


if __name__ == "__main__":
    sys.exit(main())
