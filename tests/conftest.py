"""Shared pytest fixtures and markers, one section per topic; add yours in a section of its own.

Tests that need the patched llama.cpp build carry the ``needs_build`` marker: explicitly, or
by asking for a fixture that needs it (BUILD_FIXTURES). Without the build they fail with a
message saying so; ``pytest -m "not needs_build"`` runs everything else.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import pytest

from ctest_port.cffi_policy import load_c_policy
from onebit_predict.llama.paths import NotBuiltError, build_info, llama_tree
from onebit_predict.trace import TraceHeader
from onebit_predict.trace_writer import TraceWriter

REPO = Path(__file__).resolve().parent.parent

# --- the needs_build marker ------------------------------------------------------------------

# fixtures that need the patched build (tiny_model, patched_llama) or only its source tree
# (c_policy: ONEBIT_LLAMA_TREE is enough)
BUILD_FIXTURES = {"tiny_model", "patched_llama", "pristine_dir"}
TREE_FIXTURES = {"c_policy"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if (BUILD_FIXTURES | TREE_FIXTURES) & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.needs_build)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("needs_build") is None:
        return
    tree_only = not BUILD_FIXTURES & set(getattr(item, "fixturenames", ())) and (
        TREE_FIXTURES & set(getattr(item, "fixturenames", ()))
    )
    try:
        llama_tree() if tree_only else build_info()
        return
    except NotBuiltError as e:
        missing = str(e)
    pytest.fail(
        f"{missing}\nthis test needs the patched llama.cpp build (marker needs_build): run ./build.sh, "
        "or deselect it with -m 'not needs_build'",
        pytrace=False,
    )


# --- the unpatched pin's libllama (tests/test_bench_pristine.py, tests/test_compensator_graph.py) ---

PRISTINE_BUILD_TIMEOUT_S = 1800  # a cold compile of libllama on 2 cores takes about 75 s; the first fetch more


@pytest.fixture(scope="session")
def pristine_dir() -> Path:
    """The unpatched pin's libllama dir: the one recorded, else ``./build.sh pristine`` first."""
    import subprocess

    from onebit_predict.llama.paths import pristine_lib_dir

    lib_dir = pristine_lib_dir()
    if lib_dir is None:
        p = subprocess.run(
            [str(REPO / "build.sh"), "pristine"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=PRISTINE_BUILD_TIMEOUT_S,
        )
        assert p.returncode == 0, f"./build.sh pristine failed ({p.returncode}):\n{p.stderr[-2000:]}"
        lib_dir = pristine_lib_dir()
    assert lib_dir is not None, "./build.sh pristine recorded no PRISTINE_LIB_DIR in build/current.env"
    return lib_dir


# --- the C++ environment policy through cffi (tests/test_policy_parity.py) ----------------


@pytest.fixture(scope="session")
def c_policy():
    """``(ffi, lib)`` of src/onebit-moe-policy.cpp in the patched tree (ONEBIT_LLAMA_TREE, or the
    tree build.sh recorded); the needs_build marker fails the test without one."""
    return load_c_policy(llama_tree() / "src")


# --- tiny random models written by the patched build (bit-identity, traces, commands) ----


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(arch)``: the path of a tiny random GGUF of that architecture (made once)."""
    from onebit_predict.llama.tiny import write_tiny_model

    made: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(arch: str) -> Path:
        if arch not in made:
            made[arch] = write_tiny_model(arch, root / f"{arch}.gguf")
        return made[arch]

    return get


# --- traces written by hand (trace reader, stats, replay, simulate, commands) ------------


@pytest.fixture(scope="session")
def write_trace() -> Callable[..., Path]:
    """``write_trace(path, header, rows=())``: a trace of ``rows`` (TraceWriter.add keyword dicts)."""

    def write(path: Path, header: TraceHeader, rows: Iterable[Mapping[str, object]] = ()) -> Path:
        with TraceWriter(path, header) as w:
            for row in rows:
                w.add(**row)
        return path

    return write


# --- running a command in-process ------------------------------------------------------------


@pytest.fixture
def run_cli(capsys) -> Callable[..., tuple[int, str, str]]:
    """``run_cli(main, *args)``: (exit code, stdout, stderr) of a command's ``main``; never a traceback."""

    def run(main: Callable[[Sequence[str]], int], *args: object) -> tuple[int, str, str]:
        rc = main([str(a) for a in args])
        out, err = capsys.readouterr()
        assert "Traceback" not in err
        return rc, out, err

    return run


@pytest.fixture
def no_matplotlib(monkeypatch) -> None:
    """Every import of matplotlib fails, as where the optional plot extra is not installed."""
    import builtins

    real_import = builtins.__import__

    def refuse(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("No module named 'matplotlib'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", refuse)


# --- the skips, counted by reason (the last lines of ./build.sh test) -------------------------


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped test gave (pytest.skip, skipif, importorskip), without pytest's prefix."""
    longrepr = report.longrepr
    reason = str(longrepr[2]) if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def skips_by_reason(reports: Iterable[pytest.TestReport]) -> list[tuple[int, str]]:
    """``(count, reason)`` of the skipped reports, the commonest reason first (ties by reason)."""
    counts: dict[str, int] = {}
    for report in reports:
        reason = skip_reason(report)
        counts[reason] = counts.get(reason, 0) + 1
    return sorted(((n, reason) for reason, n in counts.items()), key=lambda x: (-x[0], x[1]))


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config):
    """``skipped: N (reason)``, one line per reason, after pytest's own summary (-ra): on a machine with
    everything installed only the skips that need a CPU feature or the optional ``train`` extra (torch)
    are left, and say so."""
    yield
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.section("skipped, by reason")
    for n, reason in skips_by_reason(skipped):
        terminalreporter.write_line(f"skipped: {n} ({reason})")
