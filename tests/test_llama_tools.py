"""llama.cpp's own tools, built from the patched tree, on the bundled models: a text prompt in
llama-completion, the same greedy tokens from llama-server with the predictor and the consumer
off and on (router, block), llama-bench in every mode. The tools take the knobs from the
ONEBIT_* environment (docs/policy.md); each run sets or clears every one of them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

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


def _server_tokens(mode: str | None, consumer: str | None, trace: Path | None = None) -> list[int]:
    """Greedy tokens of one completion from a llama-server started with these knobs (then stopped)."""
    port = _free_port()
    cmd = [str(tool("llama-server")), "-m", str(MODEL), "--host", "127.0.0.1", "--port", str(port), "-t", "2"]
    env = tool_env(mode, consumer, trace)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
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
        reply = _post(
            port,
            "/completion",
            {"prompt": PROMPT, "n_predict": 24, "temperature": 0, "return_tokens": True, "cache_prompt": False},
        )
        return reply["tokens"]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


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
