"""Layers on another machine: llama.cpp's RPC backend (``ggml-rpc-server``, ``--rpc HOST:PORT``).

The servers run here, on 127.0.0.1, and the patched llama-completion sends them the bundled
model's layers. With every layer remote (``-ngl 99``), off, router and block give the same
greedy tokens; router's trace scores every predicted layer, and block predicts with router
after the placement notice. With some layers remote (``-ngl 4``, over two servers), router and
block with the advise consumer give off's tokens, and the consumer names the layers whose
experts are not in host memory. Every trace's actual routing equals that of a run without RPC
(docs/policy.md, "Block mode's graph check and placement"), every run with the plain CPU kernels.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest

from onebit_predict.constants import ENV_ALL
from onebit_predict.llama.paths import build_info
from onebit_predict.metrics.stats import compare_routing, compute_stats
from onebit_predict.trace import Trace

pytestmark = pytest.mark.needs_build

REPO = Path(__file__).resolve().parent.parent
MODEL = REPO / "models" / "qwen3moe-tiny.gguf"
PROMPT = "def copy(x):\n    cls = type(x)\n    copier = "  # the tiny model does not repeat itself on this one
N_PREDICT = 32
RUN_S = 180  # one llama-completion run, loading included (2 shared cores)
SERVER_START_S = 30  # a ggml-rpc-server listens within this, or the test fails
STOP_S = 20
RUN_TRIES = 2  # a run whose output lost its last tokens at exit is run again (docs/patches.md)
PORT_TRIES = 3  # a free port may be taken between our probe and the server's bind

# the texts the patched libllama prints (src/onebit-moe-predict.cpp, src/onebit-moe-prefetch.cpp)
BLOCK_FALLBACK = re.compile(
    r"onebit: block mode needs every layer on the CPU backend \(layer \d+ is on [^,]*RPC[^,]*, which may reorder "
    r"the graph\); predicting with router"
)
NOT_IN_HOST = re.compile(
    r"onebit: prefetch: (\d+) of (\d+) MoE layer\(s\) have expert weights not in host memory; "
    r"not prefetched there"
)


def _bin(name: str) -> Path:
    return build_info().build_dir / "bin" / name


def _clean_env() -> dict[str, str]:
    """The caller's environment without any ONEBIT_* knob or LLAMA_ARG_* flag: the runs set theirs as flags."""
    return {k: v for k, v in os.environ.items() if k not in ENV_ALL and not k.startswith("LLAMA_ARG_")}


# --- the servers --------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (/proc/net/tcp, state 0A)."""
    inodes = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except FileNotFoundError:  # it exited meanwhile
        return False
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        cols = line.split()
        if cols[1].endswith(f":{port:04X}") and cols[3] == "0A" and cols[9] in inodes:
            return True
    return False


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_S)


def _start_server(request: pytest.FixtureRequest, log: Path) -> int:
    """A ggml-rpc-server on 127.0.0.1, listening; its port. Stopped by a finalizer, by PID."""
    server = _bin("ggml-rpc-server")
    for _ in range(PORT_TRIES):
        port = _free_port()
        with log.open("ab") as out:
            proc = subprocess.Popen(
                [str(server), "--host", "127.0.0.1", "--port", str(port), "--threads", "2"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=_clean_env(),
            )
        request.addfinalizer(lambda proc=proc: _stop(proc))
        deadline = time.monotonic() + SERVER_START_S
        while proc.poll() is None and not _listening(proc.pid, port):
            assert time.monotonic() < deadline, (
                f"ggml-rpc-server did not listen in {SERVER_START_S} s:\n{log.read_text()}"
            )
            time.sleep(0.1)
        if proc.poll() is None:
            return port
    pytest.fail(f"ggml-rpc-server did not start ({PORT_TRIES} tries); its log:\n{log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def servers(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Two ggml-rpc-servers, as ``127.0.0.1:PORT`` endpoints."""
    if not _bin("ggml-rpc-server").is_file():
        pytest.skip(f"{_bin('ggml-rpc-server')} is missing: this build has no RPC server (GGML_RPC=ON, ./build.sh)")
    logs = tmp_path_factory.mktemp("rpc")
    return [f"127.0.0.1:{_start_server(request, logs / f'server{i}.log')}" for i in range(2)]


# --- the runs -----------------------------------------------------------------------------------


def _complete(trace: Path, mode: str, consumer: str = "off", rpc: str | None = None, ngl: int = 0):
    """llama-completion, greedy, N_PREDICT tokens of PROMPT: (generated bytes, stderr, the trace).

    Every run, local or remote, multiplies with the plain CPU kernels (``--no-repack``), as the RPC
    server does: on a CPU with AMX a local run put the F16 weights in the AMX buffer, whose rounding
    flipped a near-tie of the last position's routing against the remote run (layers 6 and 7)."""
    cmd = [
        str(_bin("llama-completion")), "-m", str(MODEL), "-p", PROMPT, "-n", str(N_PREDICT), "-c", "256",
        "-t", "2", "--temp", "0", "--no-warmup", "-fit", "off", "-ngl", str(ngl), "--no-repack",
        "--moe-predict", mode, "--moe-prefetch", consumer, "--moe-predict-out", str(trace),
    ]  # fmt: skip
    if rpc:
        cmd += ["--rpc", rpc]
    for attempt in range(RUN_TRIES):
        out = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=RUN_S, env=_clean_env())
        err = out.stderr.decode(errors="replace")
        assert out.returncode == 0, f"{mode}+{consumer} rpc={rpc} ngl={ngl}: rc {out.returncode}\n{err[-3000:]}"
        assert out.stdout.startswith(PROMPT.encode()), out.stdout
        # one byte per token (models/README.md); the tool ends its output with "\n\n"
        generated = out.stdout[len(PROMPT.encode()) :].removesuffix(b"\n\n")
        # the pin's logger, which also writes the tokens, may drop its last lines at exit
        # (docs/patches.md): a short output is run again, once
        if len(generated) == N_PREDICT or attempt == RUN_TRIES - 1:
            break
    assert len(generated) == N_PREDICT, (mode, consumer, generated)
    return generated, err, Trace.open(trace)


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory):
    """The same run without RPC: router's tokens and trace, the reference for the routing."""
    return _complete(tmp_path_factory.mktemp("local") / "router.bin", "router")


def _scores_every_layer(t: Trace) -> None:
    h = t.header
    st = compute_stats(t)
    assert not st.issues, st.issues
    assert h.layer_mask == frozenset(range(1, h.n_layer)), sorted(h.layer_mask)
    for layer in sorted(h.layer_mask):
        m = st.layers[layer].metrics()
        assert m["tokens"] > 0 and m["read_recall"] is not None, (layer, m)


def _routes_as(t: Trace, ref: Trace) -> None:
    assert t.n_records == ref.n_records > 0
    assert compare_routing(ref, t) == [], f"{t.path}: actual routing differs from the run without RPC"


def test_every_layer_remote_gives_off_tokens_and_block_falls_back(servers, local, tmp_path):
    rpc = servers[0]
    runs = {mode: _complete(tmp_path / f"{mode}.bin", mode, rpc=rpc, ngl=99) for mode in ("off", "router", "block")}
    off_tokens = runs["off"][0]
    assert off_tokens == local[0], "the tokens with every layer remote differ from those without RPC"
    for mode, (tokens, err, trace) in runs.items():
        assert tokens == off_tokens, mode
        _routes_as(trace, local[2])
        assert trace.header.prefetch_name == "off"
        # block's placement rule: a layer on the RPC device refuses block, which predicts with router
        assert bool(BLOCK_FALLBACK.search(err)) == (mode == "block"), err[-3000:]
    assert [runs[m][2].header.mode_name for m in ("off", "router", "block")] == ["off", "router", "router"]
    _scores_every_layer(runs["router"][2])
    _scores_every_layer(runs["block"][2])


def test_some_layers_remote_consumer_skips_them(servers, local, tmp_path):
    rpc = ",".join(servers)  # the remote layers spread over two servers
    off_tokens, _, off_trace = _complete(tmp_path / "off.bin", "off", rpc=rpc, ngl=4)
    assert off_tokens == local[0]
    _routes_as(off_trace, local[2])
    for mode in ("router", "block"):
        tokens, err, trace = _complete(tmp_path / f"{mode}-advise.bin", mode, "advise", rpc=rpc, ngl=4)
        assert tokens == off_tokens, mode
        _routes_as(trace, local[2])
        _scores_every_layer(trace)
        h = trace.header
        assert (h.mode_name, h.prefetch_name) == ("router", "advise"), (mode, h.mode_name, h.prefetch_name)
        assert bool(BLOCK_FALLBACK.search(err)) == (mode == "block"), err[-3000:]
        # the consumer skips the remote layers with a notice and prefetches the others
        notice = NOT_IN_HOST.search(err)
        assert notice, err[-3000:]
        skipped, predicted = map(int, notice.groups())
        assert predicted == len(h.layer_mask) and 0 < skipped < predicted, notice.group(0)
        totals = h.prefetch_totals
        assert totals is not None and totals.failed == 0, totals
        assert totals.ranges + totals.resident_ranges > 0, totals


def test_policy_doc_names_the_notices():
    text = " ".join((REPO / "docs" / "policy.md").read_text().split())  # the notices wrap there
    # the texts the runs above match, as docs/policy.md quotes them
    assert BLOCK_FALLBACK.search(text) and NOT_IN_HOST.search(text)
