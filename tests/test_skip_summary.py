"""What ``./build.sh test`` says about the tests it did not run: tests/conftest.py's terminal summary
counts the skips by reason ("skipped: N (reason)"), and the test extra brings matplotlib, so that the
plots are tested and the only skips left on a fully set-up machine are those that need a CPU feature
or the optional ``train`` extra (torch), each saying so.

The summary is checked on a pytest run of its own in a temporary directory, with a copy of
tests/conftest.py and a test file that skips in each of the three ways the suite does.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

SKIPPING = """
import pytest

@pytest.mark.parametrize("n", range(3))
def test_skipped_in_the_body(n):
    pytest.skip("needs an AVX-512 CPU (this one has none)")

@pytest.mark.skipif(True, reason="needs an AVX-512 CPU (this one has none)")
def test_skipped_by_marker():
    pass

def test_needs_torch():
    pytest.importorskip("onebit_no_such_module", reason="needs torch (the optional 'train' extra)")

def test_runs():
    pass
"""


def run_pytest(where: Path, tests: str) -> subprocess.CompletedProcess:
    """pytest on ``tests`` (a test file's text) beside a copy of tests/conftest.py, in ``where``."""
    shutil.copyfile(REPO / "tests" / "conftest.py", where / "conftest.py")
    (where / "test_skipping.py").write_text(tests)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(where), str(where)],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_summary_counts_the_skips_by_reason(tmp_path):
    p = run_pytest(tmp_path, SKIPPING)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [line for line in p.stdout.splitlines() if line.startswith("skipped: ")]
    assert lines == [
        "skipped: 4 (needs an AVX-512 CPU (this one has none))",
        "skipped: 1 (needs torch (the optional 'train' extra))",
    ], p.stdout
    assert re.search(r"^=+ skipped, by reason =+$", p.stdout, re.MULTILINE), p.stdout


def test_no_skip_no_summary(tmp_path):
    p = run_pytest(tmp_path, "def test_runs():\n    pass\n")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "skipped" not in p.stdout, p.stdout


def _optional_dependencies() -> dict[str, list[str]]:
    import tomllib  # Python >= 3.11; on 3.10 the pyproject is read as text below

    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def test_the_test_extra_brings_matplotlib():
    try:
        extras = _optional_dependencies()
    except ModuleNotFoundError:  # Python 3.10: the extras' lines, as written
        text = (REPO / "pyproject.toml").read_text()
        extras = {
            m.group(1): re.findall(r'"([^"]+)"', m.group(2))
            for m in re.finditer(r"^(\w+) = \[([^\]]*)\]", text, re.MULTILINE)
        }
    names = {name: [re.split(r"[<>=!~\[ ]", r, maxsplit=1)[0] for r in reqs] for name, reqs in extras.items()}
    assert "matplotlib" in names["test"], f"the test extra {extras['test']} has no matplotlib: the plot tests skip"
    assert "matplotlib" in names["plot"], "the plot extra must stay (pip install 'onebit-predict[plot]')"
