"""llama.cpp's own tools, built from the patched tree, on the bundled models: a text prompt in
llama-completion, the same greedy tokens from llama-server with the predictor and the consumer
off and on (router, block), llama-bench in every mode. The tools take the knobs from the
ONEBIT_* environment (docs/policy.md); each run sets or clears every one of them."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import pytest

from onebit_predict.constants import ENV_ALL, ENV_MODE, ENV_OUT, ENV_PREFETCH
from onebit_predict.llama.paths import build_info
from onebit_predict.trace import Trace

pytestmark = pytest.mark.needs_build

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "qwen3moe-tiny.gguf"
PROMPT = "def main():"
SERVER_START_S = 60  # the server answers /health within this, or the test fails
REQUEST_S = 60


def tool(name: str) -> Path:
    path = build_info().build_dir / "bin" / name
    assert path.is_file(), f"{path} is missing: ./build.sh builds llama.cpp's tools"
    return path


def tool_env(mode: str | None, consumer: str | None = None, trace: Path | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_ALL}
    if mode:
        env[ENV_MODE] = mode
    if consumer:
        env[ENV_PREFETCH] = consumer
    if trace:
        env[ENV_OUT] = str(trace)
    return env


def test_completion_answers_a_text_prompt():
    out = subprocess.run(
        [str(tool("llama-completion")), "-m", str(MODEL), "-p", PROMPT, "-n", "16", "-t", "2", "--temp", "0"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=REQUEST_S,
        env=tool_env("block", "advise"),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith(PROMPT) and len(out.stdout) > len(PROMPT)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(port: int, path: str, body: dict) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=REQUEST_S) as r:
        return json.loads(r.read())


@contextmanager
def _server(args: list[str], env: dict[str, str], log: IO[str] | None = None) -> Iterator[int]:
    """A llama-server on 127.0.0.1 at a free port with these arguments, answering /health; its port.
    Stopped (SIGTERM, then SIGKILL) on the way out, so its contexts are freed and traces closed. Its
    output goes to ``log`` where one is given."""
    port = _free_port()
    cmd = [str(tool("llama-server")), "-m", str(MODEL), "--host", "127.0.0.1", "--port", str(port), "-t", "2", *args]
    out = subprocess.DEVNULL if log is None else log
    proc = subprocess.Popen(cmd, stdout=out, stderr=out, env=env)
    try:
        deadline = time.monotonic() + SERVER_START_S
        while True:
            assert proc.poll() is None, f"llama-server exited with {proc.returncode}"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"llama-server did not answer within {SERVER_START_S} s"
            time.sleep(0.2)
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def _server_tokens(mode: str | None, consumer: str | None, trace: Path | None = None) -> list[int]:
    """Greedy tokens of one completion from a llama-server started with these knobs (then stopped)."""
    body = {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "return_tokens": True, "cache_prompt": False}
    with _server([], tool_env(mode, consumer, trace)) as port:
        return _post(port, "/completion", body)["tokens"]


def test_server_returns_the_same_tokens_with_the_predictor_on(tmp_path):
    off = _server_tokens(None, None)
    assert len(off) == 24
    for mode, consumer in (("router", None), ("block", None), ("router", "advise"), ("block", "read")):
        trace = tmp_path / f"{mode}-{consumer}.bin"
        assert _server_tokens(mode, consumer, trace) == off, (mode, consumer)
        # the server really ran as asked: its trace records the mode, the consumer and the tokens
        t = Trace.open(trace)
        assert (t.header.mode_name, t.header.prefetch_name) == (mode, consumer or "off")
        assert t.n_records > 0


@pytest.mark.parametrize("mode", ["off", "router", "block"])
def test_bench_runs_in_every_mode(mode):
    out = subprocess.run(
        [str(tool("llama-bench")), "-m", str(MODEL), "-p", "16", "-n", "8", "-r", "1", "-t", "2", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=REQUEST_S,
        env=tool_env(mode),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)
    assert {(r["n_prompt"], r["n_gen"]) for r in rows} == {(16, 0), (0, 8)}
    assert all(r["avg_ts"] > 0 for r in rows)


# --- the flags of llama.cpp's common parser and llama-bench's comma lists -----------------------

FLAGS = (
    "--moe-predict",
    "--moe-predict-depth",
    "--moe-predict-margin",
    "--moe-predict-min",
    "--moe-predict-layers",
    "--moe-predict-no-attn",
    "--moe-predict-out",
    "--moe-predict-stats",
    "--moe-prefetch",
    "--moe-prefetch-max-bytes",
    "--moe-prefetch-threads",
)


@pytest.mark.parametrize("name", ["llama-cli", "llama-completion", "llama-server"])
def test_help_lists_every_flag_with_its_variable(name):
    out = subprocess.run([str(tool(name)), "--help"], capture_output=True, text=True, timeout=REQUEST_S)
    text = out.stdout + out.stderr
    for flag in FLAGS:
        assert flag + " " in text or flag + "\n" in text, flag
        assert "LLAMA_ARG_" + flag[2:].upper().replace("-", "_") in text, flag


def _completion(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    cmd = [str(tool("llama-completion")), "-m", str(MODEL), "-p", PROMPT, "-n", "8", "-t", "2", "--temp", "0", *args]
    return subprocess.run(
        cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=REQUEST_S, env=env or tool_env(None)
    )


@pytest.mark.parametrize(
    ("flag", "value", "words"),
    [
        ("--moe-predict", "blok", "is not one of off|router|block|learned"),
        ("--moe-predict-depth", "x", "is not a non-negative integer"),
        ("--moe-predict-margin", "-1", "is not a finite non-negative number"),
        ("--moe-prefetch", "always", "is not one of off|advise|read|populate"),
        ("--moe-prefetch-max-bytes", "12q", "is not a byte count"),
        ("--moe-prefetch-threads", "99", "exceeds 16"),
        ("--moe-prefetch-keep", "lfu", "is not one of kernel|lru"),
        ("--moe-prefetch-order", "hot", "is not one of index|hits"),
        ("--moe-prefetch-layers", "9", "exceeds 8"),
    ],
)
def test_a_bad_flag_value_is_an_argument_error(flag, value, words):
    out = _completion(flag, value)
    assert out.returncode == 1
    assert f"invalid value for {flag}: '{value}'" in out.stderr and words in out.stderr


def test_the_recommended_flags_run_in_any_order():
    """README's flags, route given last: the knobs that need route-time reads are judged by their grammar
    (they failed as an argument error before, route not yet seen); without route the context warns and
    ignores them, and the run goes on."""
    rest = ["--moe-prefetch-keep", "lru", "--moe-prefetch-order", "hits", "--moe-prefetch-layers", "2"]
    out = _completion("-v", *rest, "--moe-prefetch-route")  # -v: the context's info lines
    assert out.returncode == 0, out.stderr[-2000:]
    assert "reads at route time" in out.stderr and "a batch reads 2 whole layer(s) ahead" in out.stderr
    out = _completion("--moe-prefetch-keep", "lru")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ONEBIT_MOE_PREFETCH_KEEP=lru needs route-time reads (ONEBIT_MOE_PREFETCH_ROUTE=1); ignored" in out.stderr


def test_keep_anon_runs_from_the_flags_in_any_order():
    """--moe-prefetch-keep anon needs the pread call: judged with pread (it was an argument error with any
    call before 2026-12-06, so no tool could ask for it); the context holds its experts in memfd slots
    (its stats line says so); without pread it warns, is lru, and the run goes on."""
    anon = ["--moe-prefetch-keep", "anon", "--moe-prefetch-order", "hits"]
    out = _completion("-v", "--moe-predict-stats", *anon, "--moe-prefetch-route", "--moe-prefetch", "pread")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "onebit: keep anon: holds at most" in out.stderr and "(memfd slots," in out.stderr
    out = _completion(*anon, "--moe-prefetch-route")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ONEBIT_MOE_PREFETCH_KEEP=anon reads with pread (ONEBIT_MOE_PREFETCH=pread); using lru" in out.stderr


HELD = re.compile(
    r"onebit: keep anon: holds at most \d+ experts of [\d.]+ MiB; evicted \d+; ([\d.]+) MiB in memory of its own now"
)
STREAMED = re.compile(r"onebit: keep anon: batch ops whose layer streamed .*\) (\d+)$", re.MULTILINE)


def _anon_prompt_args(prompt: str) -> list[str]:
    """llama-completion's arguments for keep anon's prompt tests: the prompt only (-n 1 decodes nothing), its
    stats line printed, the room rule off (room 0: route reads without a memory limit)."""
    anon = ["--moe-prefetch", "pread", "--moe-prefetch-route", "--moe-prefetch-keep", "anon"]
    return [*anon, "--moe-prefetch-room", "0", "-v", "--moe-predict-stats", "-p", prompt, "-n", "1", "-c", "256"]


ANON_PROMPT = "def main():\n    total = sum(range(10)) + len('onebit')\n    return total\n" * 3


def _held_mib(stderr: str) -> float:
    """keep anon's memory of its own at the context's end (its stats line)."""
    m = HELD.search(stderr)
    assert m, stderr[-2000:]
    return float(m.group(1))


GIVEN_BACK = re.compile(r"onebit: keep anon: ubatches larger than any before, all given back .*\) (\d+)$", re.MULTILINE)


def test_keep_anon_gives_everything_back_before_a_ubatch_larger_than_any_before(tmp_path):
    """A server whose first prompt was short decodes with keep anon's slots filled to the room measured then,
    which counts the buffers a larger ubatch will touch as free; the cgroup cannot reclaim the slots, and
    llama-server was OOM-killed at its first ubatch of 128 (5 of 5 at 50 % of the grown 2.7 MiB model:
    docs/results.md, "A server's next request"). So before a ubatch larger than any before keep anon gives
    everything back. The capacity fixed at 40 of the tiny model's 128 experts, the room rule off: a 4-token
    prompt and 24 tokens decoded fill the slots, and a 40-token prompt in ubatches of 16 gives them back once
    (its first ubatch). The old build has no such line."""
    anon = ["--moe-prefetch", "pread", "--moe-prefetch-route", "--moe-prefetch-keep", "anon", "--moe-prefetch-room",
            "0", "-v", "--moe-predict-stats", "-b", "16", "-ub", "16", "-c", "256", "-np", "1"]  # fmt: skip
    env = tool_env(None) | {"ONEBIT_MOE_PREFETCH_DEBUG_KEEP_CAP": "40"}
    log = tmp_path / "server.log"
    with open(log, "w") as f, _server(anon, env, f) as port:
        tokens = _post(port, "/tokenize", {"content": ANON_PROMPT})["tokens"]
        assert len(tokens) >= 44
        once = {"temperature": 0, "cache_prompt": False, "ignore_eos": True}
        _post(port, "/completion", {"prompt": tokens[:4], "n_predict": 24, **once})
        _post(port, "/completion", {"prompt": tokens[4:44], "n_predict": 1, **once})
    text = log.read_text()
    m = GIVEN_BACK.search(text)
    assert m, text[-2000:]
    assert int(m.group(1)) == 1  # counted only where something was held


def test_keep_anon_holds_nothing_new_in_a_ubatch_larger_than_any_before():
    """A ubatch larger than any before touches its compute and work buffers for the first time as its layers
    run, so the room measured meanwhile is too large, and keep anon's memory, which the kernel cannot
    reclaim, must not grow into it: llama-completion's prompt in one ubatch (its default -b) was OOM-killed
    so at 50 % of the grown 2.7 MiB model's expert bytes (docs/results.md, "keep anon and memory it cannot
    give back"). A prompt in one ubatch (-n 1: it decodes nothing) now holds nothing; the same prompt in
    ubatches of 8 holds what the ubatches after the first routed. The room rule is off (room 0), so route
    reads without a memory limit."""
    args = _anon_prompt_args(ANON_PROMPT)
    one = _completion(*args)
    assert one.returncode == 0, one.stderr[-2000:]
    assert _held_mib(one.stderr) == 0.0
    split = _completion(*args, "-b", "8", "-ub", "8")
    assert split.returncode == 0, split.stderr[-2000:]
    assert _held_mib(split.stderr) > 0.0


def test_keep_anon_gives_a_batch_the_page_cache_its_union_needs():
    """keep anon's capacity leaves the page cache a token's routed experts; a batch's layer routes more, read
    through the page cache where they are not held, so in such a ubatch the layer's share is the capacity
    less that excess: held at the full capacity, a prompt in ubatches of 16 at 50 % of the grown 2.7 MiB
    model had those reads reclaimed before its matmuls ran, 0.185x of off (docs/results.md, "keep anon's
    prompt"). The same 207-token prompt, the capacity fixed at 120 of the tiny model's 128 experts: token by
    token it holds the full capacity, in ubatches of 16 (the last one 15) less. The old build held 4.2 MiB
    both ways."""
    args = _anon_prompt_args(ANON_PROMPT[:207])
    env = tool_env(None) | {"ONEBIT_MOE_PREFETCH_DEBUG_KEEP_CAP": "120"}
    tokens = _completion(*args, "-b", "1", "-ub", "1", env=env)
    assert tokens.returncode == 0, tokens.stderr[-2000:]
    batch = _completion(*args, "-b", "16", "-ub", "16", env=env)
    assert batch.returncode == 0, batch.stderr[-2000:]
    assert _held_mib(batch.stderr) <= _held_mib(tokens.stderr) - 0.2


def _streamed(stderr: str) -> int:
    """keep anon's batch ops whose layer streamed (its stats line)."""
    m = STREAMED.search(stderr)
    assert m, stderr[-2000:]
    return int(m.group(1))


def test_keep_anon_streams_a_batch_that_routes_more_than_it_holds():
    """A batch whose layer routes more than the layer's share of keep anon's LRU and more than half its experts
    streams the layer: what the LRU held there is given back, nothing of the batch is held or read, and the
    compute thread faults the experts in with readahead. Held through such batches, the slots crowded out the
    page cache the prompt streams through: 0.638x of off in ubatches of 16 at 50 % of the grown 2.7 MiB model
    (docs/results.md, "keep anon's prompt streams"). The capacity fixed at 40 of the tiny model's 128 experts
    (5 a layer of 16): token by token it holds 1.4 MiB at the prompt's end and streams nothing; in ubatches of
    16, 91 of the 104 ops stream (the others route at most 8 of 16) and it holds 0.2 MiB (the old build 1.2)."""
    args = _anon_prompt_args(ANON_PROMPT[:207])
    env = tool_env(None) | {"ONEBIT_MOE_PREFETCH_DEBUG_KEEP_CAP": "40"}
    tokens = _completion(*args, "-b", "1", "-ub", "1", env=env)
    assert tokens.returncode == 0, tokens.stderr[-2000:]
    assert _streamed(tokens.stderr) == 0 and _held_mib(tokens.stderr) > 0.0
    batch = _completion(*args, "-b", "16", "-ub", "16", env=env)
    assert batch.returncode == 0, batch.stderr[-2000:]
    assert _streamed(batch.stderr) > 0
    assert _held_mib(batch.stderr) <= _held_mib(tokens.stderr) / 3


def test_flags_reach_the_context_and_win_over_the_environment(tmp_path):
    trace = tmp_path / "t.bin"
    env = tool_env("router") | {"ONEBIT_MOE_PREDICT_DEPTH": "2"}  # the flags below must win
    out = _completion(
        "--moe-predict", "block", "--moe-prefetch", "read", "--moe-predict-depth", "3", "--moe-predict-out", str(trace),
        env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    h = Trace.open(trace).header
    assert (h.mode_name, h.prefetch_name, h.depth_requested) == ("block", "read", 3)
    assert (h.speculative, h.route, h.random, h.prefetch_threads) == (True, False, False, 8)  # 8: the default
    # the flag's variable, LLAMA_ARG_MOE_PREDICT, as llama.cpp's parser gives every flag
    out = _completion("--moe-predict-out", str(trace), env=tool_env(None) | {"LLAMA_ARG_MOE_PREDICT": "router"})
    assert out.returncode == 0 and Trace.open(trace).header.mode_name == "router"


def test_bench_takes_comma_lists(tmp_path):
    cmd = [str(tool("llama-bench")), "-m", str(MODEL), "-p", "16", "-n", "8", "-r", "1", "-t", "2"]
    lists = ["--moe-predict", "off,router,block", "--moe-prefetch", "off,advise"]
    out = subprocess.run(cmd + lists + ["-o", "json"], capture_output=True, text=True, timeout=REQUEST_S)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {(r["moe_predict"], r["moe_prefetch"], r["n_gen"] > 0) for r in json.loads(out.stdout)}
    # every pair with a predictor, a prompt row and a generation row each; off x advise is not a row
    want = {("off", "off"), ("router", "off"), ("router", "advise"), ("block", "off"), ("block", "advise")}
    assert rows == {(p, c, g) for p, c in want for g in (False, True)}
    md = subprocess.run(cmd + lists + ["-o", "md"], capture_output=True, text=True, timeout=REQUEST_S).stdout
    assert "moe_predict" in md and "moe_prefetch" in md
    bad = subprocess.run(cmd + ["--moe-predict", "off,blok"], capture_output=True, text=True, timeout=REQUEST_S)
    assert bad.returncode != 0 and "invalid value 'blok' for --moe-predict" in bad.stderr


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=REQUEST_S) as r:
        lines = r.read().decode().splitlines()
    return {k.removeprefix("llamacpp:"): float(v) for k, v in (ln.split() for ln in lines if not ln.startswith("#"))}


def test_server_takes_the_flags_and_reports_in_metrics(tmp_path):
    trace = tmp_path / "server.bin"
    flags = ["--moe-predict", "block", "--moe-prefetch", "advise", "--moe-predict-out", str(trace), "--metrics"]
    with _server(flags, tool_env(None)) as port:
        reply = _post(port, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0})
        m = _metrics(port)
    assert reply["tokens_predicted"] == 8
    h = Trace.open(trace).header
    assert (h.mode_name, h.prefetch_name) == ("block", "advise")
    # /metrics: the predictor's read recall and the consumer's counters, as the native table counts them
    assert (m["onebit_moe_predict_mode"], m["onebit_moe_prefetch_mode"]) == (2, 1)
    assert m["onebit_moe_predicted_tokens_total"] > 0 and m["onebit_moe_prefetch_experts_total"] > 0
    recall = m["onebit_moe_read_hits_total"] / m["onebit_moe_actual_experts_total"]
    assert m["onebit_moe_read_recall"] == pytest.approx(recall)
    assert m["onebit_moe_prefetch_failed_total"] == 0


def test_server_metrics_without_the_predictor_have_no_onebit_lines():
    with _server(["--metrics"], tool_env(None)) as port:
        _post(port, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0})
        m = _metrics(port)
    assert "tokens_predicted_total" in m and not any(k.startswith("onebit_") for k in m)


def test_server_metrics_with_route_alone_show_route_and_nothing_else():
    """Route alone (no predictor, no speculative reads): the modes, the route counters and the failed
    ranges, and no predictor or speculative line (they would read 0 and say nothing)."""
    # the room rule off: the model fits here, and route would idle (nothing to count)
    with _server(["--metrics", "--moe-prefetch-route", "--moe-prefetch-room", "0"], tool_env(None)) as port:
        _post(port, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0})
        m = _metrics(port)
    assert (m["onebit_moe_predict_mode"], m["onebit_moe_prefetch_mode"]) == (0, 2)
    # every routed expert is either read or found resident: the two add up to the routed bytes
    assert m["onebit_moe_route_bytes_total"] + m["onebit_moe_route_resident_bytes_total"] > 0
    assert m["onebit_moe_route_experts_total"] >= 0 and m["onebit_moe_route_stale_total"] == 0
    assert m["onebit_moe_prefetch_failed_total"] == 0
    shown = {k for k in m if k.startswith("onebit_")}
    hidden = {"onebit_moe_predicted_tokens_total", "onebit_moe_read_recall", "onebit_moe_prefetch_experts_total"}
    assert not shown & hidden, shown


def test_server_metrics_with_a_trace_alone_have_no_onebit_lines(tmp_path):
    """A trace without a predictor or a consumer predicts and reads nothing: no onebit_ line."""
    with _server(["--metrics", "--moe-predict-out", str(tmp_path / "t.bin")], tool_env(None)) as port:
        _post(port, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0})
        m = _metrics(port)
    assert "tokens_predicted_total" in m and not any(k.startswith("onebit_") for k in m)
