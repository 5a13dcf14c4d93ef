"""The patched tools write out every log line before they exit (patch "common: write out the log's
queued lines at exit"). The pin's common/log.cpp queues lines for a worker thread nothing joins at
exit, so a tool that fails and returns at once lost its last lines, the ones that say why: before
the patch, llama-completion refusing a compensator sidecar with stderr to a file lost its refusal
line in 3 of 40 runs on this machine under a build's load (2 vCPUs). The test runs it 40 times, two
at a time so that the runs compete for the CPUs as under load, and requires the refusal and the
tool's own closing error line in every run."""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from onebit_predict.constants import ENV_ALL
from tests.test_llama_tools import MODEL, tool

pytestmark = pytest.mark.needs_build

RUNS = 40
MISSING = "/nonexistent/onebit-log-flush.gguf"


def _one(i: int, tmp: Path) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k not in ENV_ALL}
    err = tmp / f"{i}.err"
    with err.open("wb") as f:  # a file, not a pipe: the case that lost lines
        rc = subprocess.run(
            [str(tool("llama-completion")), "-m", str(MODEL), "-p", "hi", "-n", "2", "--moe-compensator", MISSING],
            stdout=subprocess.DEVNULL,
            stderr=f,
            env=env,
            timeout=60,
        ).returncode
    return rc, err.read_text(errors="replace")


def test_a_failing_tool_loses_no_log_line(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda i: _one(i, tmp_path), range(RUNS)))
    assert all(rc == 1 for rc, _ in runs), [rc for rc, _ in runs]
    lost_refusal = [i for i, (_, err) in enumerate(runs) if MISSING not in err]
    lost_last = [i for i, (_, err) in enumerate(runs) if "unable to create context" not in err]
    assert not lost_refusal and not lost_last, (lost_refusal, lost_last)
