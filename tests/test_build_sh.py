"""build.sh for real, without compiling anything and without the network.

Each test runs build.sh (the checkout's own, or a copy of the checkout in tmp_path when the
test edits patches/) against a cache of its own (ONEBIT_CACHE=tmp_path/...), seeded from the
real cache: the pinned sdist is hard-linked into it and the pristine llama.cpp tree is cloned
into it, so no test downloads or unpacks the sdist. What is covered: the command line and its
exit codes, a missing or malformed patches/PIN or patches/series, the sdist's sha256 check,
the lint of patches/series (tools/series.py, unit-tested in test_series.py, run by
build.sh), the ruff step of check, a patch that does not apply (check and build), a clean
check, rebase --tree (clean, conflicting, dirty tree), export --from regenerating patches/
byte for byte, and the build's system-packages step (build.sh sourced, its functions called with
stand-ins for id, dpkg-query, pkg-config and apt-get on a PATH of their own: apt-get never runs).

The session fixture ``seed`` fills the real cache ($ONEBIT_CACHE, else ~/.cache/onebit-predict)
once when it lacks the sdist or the pristine tree (pip download, then ``./build.sh rebase --to``
the pinned version, which unpacks it); otherwise it only reads it. A ``build`` run gets a
failing ``cmake`` first on its PATH, so a regression that got past the apply step could never
start a llama.cpp build. A copied checkout gets a stand-in ``.venv``: marked up to date for
build.sh, with a ``ruff`` that records its arguments, so ``check`` installs nothing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
COPIED = (
    "build.sh",
    "patches",
    "ctest_port",
    "pyproject.toml",
    "README.md",
    "tools/series.py",  # build.sh runs it, and nothing else of the checkout's Python
)
TIMEOUT_S = 300
PRISTINE_TAG = "onebit-pristine"


def read_pin(repo: Path) -> dict[str, str]:
    pin: dict[str, str] = {}
    for line in (repo / "patches" / "PIN").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            pin.setdefault(key.strip(), value.strip())
    return pin


PIN = read_pin(REPO_ROOT)
VERSION = PIN["version"]
SHA256 = PIN["sha256"]
SDIST_NAME = f"llama_cpp_python-{VERSION}.tar.gz"


# --- helpers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    rc: int
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return f"exit {self.rc}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


def run_build_sh(
    repo: Path,
    cache: Path,
    *args: str,
    tmpdir: Path | None = None,
    no_cmake: bool = False,
    extra_env: dict[str, str] | None = None,
) -> Run:
    """``repo/build.sh ARGS`` with ONEBIT_CACHE=cache (TMPDIR=tmpdir when given), never running apt-get
    (ONEBIT_NO_APT=1 unless extra_env says otherwise)."""
    env = dict(os.environ, ONEBIT_CACHE=str(cache), ONEBIT_NO_APT="1")
    env.update(extra_env or {})
    env.pop("VIRTUAL_ENV", None)  # build.sh would install into the caller's venv
    if tmpdir is not None:
        tmpdir.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmpdir)
    if no_cmake:
        env["PATH"] = f"{_cmake_stub(cache.parent)}{os.pathsep}{env.get('PATH', '')}"
    p = subprocess.run(
        [str(repo / "build.sh"), *args], cwd=repo, env=env, capture_output=True, text=True, timeout=TIMEOUT_S
    )
    return Run(p.returncode, p.stdout, p.stderr)


def _cmake_stub(where: Path) -> Path:
    bin_dir = where / "no-cmake-bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "cmake"
    stub.write_text("#!/bin/sh\necho 'test_build_sh: cmake must not run in these tests' >&2\nexit 97\n")
    stub.chmod(0o755)
    return bin_dir


def git(cwd: Path, *args: str) -> str:
    p = subprocess.run(
        [
            "git",
            "-c",
            "user.name=onebit-test",
            "-c",
            "user.email=test@onebit.invalid",
            "-c",
            "commit.gpgsign=false",
            "-c",
            "advice.detachedHead=false",
            *args,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert p.returncode == 0, f"git {' '.join(args)} in {cwd}: exit {p.returncode}\n{p.stderr}"
    return p.stdout


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def series(repo: Path) -> list[str]:
    names = (line.split("#", 1)[0].strip() for line in (repo / "patches" / "series").read_text().splitlines())
    return [n for n in names if n]


def copy_repo(dest: Path) -> Path:
    dest.mkdir(parents=True)
    for name in COPIED:
        src = REPO_ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    stub_venv(dest)
    return dest


RUFF_STUB = """#!/bin/sh
# test_build_sh: stands in for ruff; records its arguments, fails where told to
venv=$(dirname "$0")/..
printf '%s\\n' "$*" >>"$venv/ruff-calls"
if [ -f "$venv/ruff-fails-$1" ]; then
    echo "stub ruff: $1 found problems"
    exit 1
fi
exit 0
"""


def stub_venv(repo: Path) -> Path:
    """repo/.venv as build.sh's setup_python leaves it for this pin and pyproject.toml (its
    stamp), holding only a stand-in ruff."""
    venv = repo / ".venv"
    (venv / "bin").mkdir(parents=True)
    pyproject = hashlib.sha256((repo / "pyproject.toml").read_bytes()).hexdigest()[:16]
    (venv / ".onebit-stamp").write_text(f"{VERSION} {pyproject}")
    ruff = venv / "bin" / "ruff"
    ruff.write_text(RUFF_STUB)
    ruff.chmod(0o755)
    return venv


def ruff_calls(repo: Path) -> list[str]:
    calls = repo / ".venv" / "ruff-calls"
    return calls.read_text().splitlines() if calls.exists() else []


def link_or_copy(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def clone_pristine(pristine: Path, dest: Path, branch: str | None = None) -> Path:
    """A local clone of the pristine tree, with the onebit-pristine tag and no remote."""
    git(dest.parent, "clone", "-q", str(pristine), str(dest))
    if not git(dest, "tag", "-l", PRISTINE_TAG).strip():
        git(dest, "fetch", "-q", "--tags", "origin")
    assert git(dest, "tag", "-l", PRISTINE_TAG).strip() == PRISTINE_TAG
    git(dest, "remote", "remove", "origin")
    if branch:
        git(dest, "checkout", "-q", "-b", branch)
    return dest


def leftovers(cache: Path, tmpdir: Path) -> list[str]:
    """What a failed run must not leave: half-made trees in the cache, anything in TMPDIR."""
    found = [str(p) for p in cache.glob("src/*/*") if p.name.endswith(".tmp") or p.name.startswith("work-")]
    found += [str(p) for p in cache.glob("sdist/.fetch.*")]
    if tmpdir.exists():
        found += [str(p) for p in tmpdir.iterdir()]
    return sorted(set(found))


def first_upstream_hunk(patch: Path) -> tuple[str, str, str, list[str]]:
    """(path, context line before, context line after, added lines) of the first hunk that
    inserts lines into a file which exists upstream."""
    lines = patch.read_text().splitlines()
    path, new_file = "", False
    for i, line in enumerate(lines):
        if line.startswith("diff --git "):
            path, new_file = line.split(" b/", 1)[1], False
        elif line.startswith("new file mode") or line.startswith("index 0000000"):
            new_file = True
        elif line.startswith("@@") and path and not new_file:
            j = i + 1
            while lines[j].startswith(" "):
                j += 1
            k = j
            while lines[k].startswith("+"):
                k += 1
            if j > i + 1 and k > j and lines[k].startswith(" "):
                return path, lines[j - 1][1:], lines[k][1:], [a[1:] for a in lines[j:k]]
    raise AssertionError(f"{patch.name}: no hunk inserting between two context lines of an upstream file")


def inserts_upstream(patch: Path) -> bool:
    try:
        first_upstream_hunk(patch)
    except AssertionError:
        return False
    return True


def corrupt_first_context_line(patch: Path) -> str:
    """Break the first context line of the patch's first hunk; returns the original line."""
    lines = patch.read_text().splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("@@"))
    i = next(i for i in range(start + 1, len(lines)) if lines[i].startswith(" ") and lines[i].strip())
    original = lines[i]
    lines[i] = original.rstrip("\n") + " /* not upstream */\n"
    patch.write_text("".join(lines))
    return original.rstrip("\n")


# --- fixtures ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seed:
    sdist: Path
    pristine: Path


def _real_cache() -> Path:
    return Path(os.environ.get("ONEBIT_CACHE") or Path.home() / ".cache" / "onebit-predict")


@pytest.fixture(scope="session")
def seed(tmp_path_factory: pytest.TempPathFactory) -> Seed:
    """The real cache's sdist and pristine tree, made once there if missing."""
    cache = _real_cache()
    sdist = cache / "sdist" / SDIST_NAME
    pristine = cache / "src" / VERSION / "pristine"
    scratch = tmp_path_factory.mktemp("seed")
    if not sdist.is_file():
        download = scratch / "download"
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--no-binary",
                ":all:",
                "-d",
                str(download),
                f"{PIN['package']}=={VERSION}",
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        got = download / SDIST_NAME
        assert p.returncode == 0 and got.is_file(), f"pip download failed:\n{p.stdout}\n{p.stderr}"
        assert sha256_of(got) == SHA256, f"PyPI served {SDIST_NAME} with another sha256 than patches/PIN"
        sdist.parent.mkdir(parents=True, exist_ok=True)
        part = sdist.with_name(f".{SDIST_NAME}.{os.getpid()}.part")
        shutil.copyfile(got, part)
        os.replace(part, sdist)
    if not (pristine / ".onebit-ok").is_file():
        # rebase --to the pin fetches nothing now (the sdist is there) and unpacks the pristine
        # tree before it applies the series; its work tree is removed again
        rebased = cache / "rebase" / VERSION
        existed = rebased.exists()
        r = run_build_sh(REPO_ROOT, cache, "rebase", "--to", VERSION, tmpdir=scratch / "tmp")
        if not existed:
            shutil.rmtree(rebased, ignore_errors=True)
        assert (pristine / ".onebit-ok").is_file(), f"./build.sh rebase --to {VERSION} did not make {pristine}:\n{r}"
    return Seed(sdist, pristine)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the checkout's build.sh, patches/ and what else build.sh reads."""
    return copy_repo(tmp_path / "repo")


@pytest.fixture
def sdist_cache(tmp_path: Path, seed: Seed) -> Path:
    """A cache of this test's own holding the pinned sdist only."""
    cache = tmp_path / "cache"
    link_or_copy(seed.sdist, cache / "sdist" / SDIST_NAME)
    return cache


@pytest.fixture
def cache(sdist_cache: Path, seed: Seed) -> Path:
    """A cache of this test's own with the sdist and the pristine tree, as build.sh leaves them."""
    pristine = sdist_cache / "src" / VERSION / "pristine"
    pristine.parent.mkdir(parents=True)
    clone_pristine(seed.pristine, pristine)
    (pristine / ".onebit-ok").touch()
    return sdist_cache


@pytest.fixture
def tmp_dir(tmp_path: Path) -> Path:
    """TMPDIR for build.sh, to see what it leaves behind."""
    return tmp_path / "tmp"


# --- 1. the command line ----------------------------------------------------------------------


def test_help_lists_the_subcommands(tmp_path: Path) -> None:
    for args in (["help"], ["--help"], ["-h"]):
        r = run_build_sh(REPO_ROOT, tmp_path / "cache", *args)
        assert r.rc == 0, r
        assert r.stdout.startswith("usage: ./build.sh"), r
        for sub in (
            "build",
            "test",
            "check",
            "rebase --to VERSION",
            "rebase --tree DIR",
            "export [--from DIR]",
            "pristine",
            "help",
        ):
            assert f"\n  {sub}" in r.stdout or f"| {sub} " in r.stdout, f"{sub!r} missing\n{r}"
    assert not (tmp_path / "cache").exists(), "help touched the cache"


USAGE_ERRORS = [
    (["frobnicate"], "unknown subcommand 'frobnicate'"),
    (["rebase"], "rebase needs --to VERSION or --tree DIR"),
    (["rebase", "--to"], "--to needs a VERSION"),
    (["rebase", "--tree"], "--tree needs a DIR"),
    (["rebase", "--tree", "/nonexistent/onebit"], "--tree '/nonexistent/onebit' is not a directory"),
    (["rebase", "--to", "1.2.3", "--tree", "/tmp"], "rebase takes --to or --tree, not both"),
    (["rebase", "--to", "latest"], "--to 'latest' is not a version number"),
    (["rebase", "--frob"], "rebase: unknown option '--frob'"),
    (["export", "--from"], "--from needs a DIR"),
    (["export", "--from", "/nonexistent/onebit"], "no work tree at '/nonexistent/onebit'"),
    (["build", "extra-arg"], "build takes no arguments"),
    (["check", "extra-arg"], "check takes no arguments"),
    (["test", "extra-arg"], "test takes no arguments"),
    (["pristine", "extra-arg"], "pristine takes no arguments"),
]


@pytest.mark.parametrize(("args", "message"), USAGE_ERRORS, ids=[" ".join(a) for a, _ in USAGE_ERRORS])
def test_usage_errors_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    r = run_build_sh(REPO_ROOT, tmp_path / "cache", *args)
    assert r.rc == 2, r
    assert f"error: {message}" in r.stderr, r
    assert "run './build.sh help'" in r.stderr, r
    assert not (tmp_path / "cache" / "sdist").exists(), "a usage error fetched something"


def test_rebase_tree_that_is_not_a_git_checkout_exits_2(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    # a plain directory even when the temporary directory sits inside some git checkout
    r = run_build_sh(
        REPO_ROOT,
        tmp_path / "cache",
        "rebase",
        "--tree",
        str(plain),
        extra_env={"GIT_CEILING_DIRECTORIES": str(tmp_path)},
    )
    assert r.rc == 2, r
    assert f"--tree '{plain}' is not a git checkout" in r.stderr, r


# --- 1b. patches/PIN and patches/series, read by tools/series.py ---------------------------------

PIN_AND_SERIES_ERRORS = [
    ("build", "PIN", None, "patches/PIN is missing"),
    ("pristine", "PIN", None, "patches/PIN is missing"),
    ("build", "PIN", "package=llama-cpp-python\nsha256=00\n", "patches/PIN has no 'version='"),
    ("build", "PIN", "version 1.2.3\n", "patches/PIN line 1 is not KEY=VALUE: 'version 1.2.3'"),
    ("build", "series", None, "patches/series is missing"),
    ("check", "series", None, "patches/series is missing"),
]


@pytest.mark.parametrize(
    ("subcommand", "name", "text", "message"),
    PIN_AND_SERIES_ERRORS,
    ids=[f"{c} {n} {m}" for c, n, _, m in PIN_AND_SERIES_ERRORS],
)
def test_a_missing_or_malformed_pin_or_series_exits_2(
    repo: Path, tmp_path: Path, subcommand: str, name: str, text: str | None, message: str
) -> None:
    path = repo / "patches" / name
    if text is None:
        path.unlink()
    else:
        path.write_text(text)
    cache = tmp_path / "cache"
    r = run_build_sh(repo, cache, subcommand, tmpdir=tmp_path / "tmp", no_cmake=True)
    assert r.rc == 2, r
    assert f"error: {message}" in r.stderr, r
    assert not (cache / "sdist").exists(), f"{subcommand} went on to fetch the sdist\n{r}"


# --- 2. the sdist's sha256 --------------------------------------------------------------------


@pytest.mark.parametrize("subcommand", ["check", "build"])
def test_tampered_sdist_is_refused(tmp_path: Path, seed: Seed, tmp_dir: Path, subcommand: str) -> None:
    cache = tmp_path / "cache"
    tampered = cache / "sdist" / SDIST_NAME
    tampered.parent.mkdir(parents=True)
    shutil.copyfile(seed.sdist, tampered)  # a copy, never a link: the byte goes into this file only
    with tampered.open("ab") as f:
        f.write(b"\0")
    actual = sha256_of(tampered)
    r = run_build_sh(REPO_ROOT, cache, subcommand, tmpdir=tmp_dir, no_cmake=True)
    assert r.rc == 1, r
    assert f"{tampered} has sha256 {actual}" in r.stderr, r
    assert f"patches/PIN expects    {SHA256}" in r.stderr, r
    assert f"what to do: delete {tampered} and run again" in r.stderr, r
    assert not (cache / "src").exists(), f"a tree was made from the tampered sdist\n{r}"
    assert not (cache / "build").exists(), r
    assert leftovers(cache, tmp_dir) == [], r


# --- 3. and 4. the lint of patches/series -----------------------------------------------------


def test_series_entry_without_a_file_exits_2(repo: Path, cache: Path, tmp_dir: Path) -> None:
    with (repo / "patches" / "series").open("a") as f:
        f.write("0099-onebit-not-there.patch\n")
    r = run_build_sh(repo, cache, "check", tmpdir=tmp_dir)
    assert r.rc == 2, r
    assert "patches/series lists '0099-onebit-not-there.patch', which is not in patches/" in r.stderr, r
    assert "==> verify the sdist" not in r.stderr, f"check went past the lint of the series\n{r}"
    assert leftovers(cache, tmp_dir) == [], r


def test_orphan_patch_fails_the_lint(repo: Path, sdist_cache: Path, tmp_dir: Path) -> None:
    first = repo / "patches" / series(repo)[0]
    shutil.copyfile(first, repo / "patches" / "0099-onebit-orphan.patch")
    r = run_build_sh(repo, sdist_cache, "check", tmpdir=tmp_dir)
    assert r.rc == 1, r
    assert "error: 0099-onebit-orphan.patch is in patches/ but not in patches/series" in r.stderr, r
    assert "==> verify the sdist" not in r.stderr, r
    assert not (sdist_cache / "src").exists(), r


@pytest.mark.parametrize("line", ["Why:", "Upstream:"])
def test_patch_without_a_header_line_fails_the_lint(repo: Path, sdist_cache: Path, tmp_dir: Path, line: str) -> None:
    name = series(repo)[-1]
    patch = repo / "patches" / name
    text = patch.read_text()
    assert f"\n{line}" in text
    patch.write_text(text.replace(f"\n{line}", "\nReason:", 1))
    r = run_build_sh(repo, sdist_cache, "check", tmpdir=tmp_dir)
    assert r.rc == 1, r
    assert f"error: {name} has no '{line}' line in its header" in r.stderr, r
    assert "==> verify the sdist" not in r.stderr, r
    assert not (sdist_cache / "src").exists(), r


# --- 5. a patch that does not apply -----------------------------------------------------------


@pytest.fixture
def broken_patch(repo: Path) -> str:
    """Corrupt a context line in the first hunk of the second patch (the first if alone)."""
    names = series(repo)
    name = names[1] if len(names) > 1 else names[0]
    corrupt_first_context_line(repo / "patches" / name)
    return name


def test_check_names_a_patch_that_does_not_apply(repo: Path, cache: Path, tmp_dir: Path, broken_patch: str) -> None:
    r = run_build_sh(repo, cache, "check", tmpdir=tmp_dir)
    assert r.rc == 1, r
    assert "error: the series does not apply to the pristine tree" in r.stderr, r
    assert broken_patch in r.stderr, f"the failing patch is not named\n{r}"
    assert "what to do: fix the patch in patches/" in r.stderr, r
    assert leftovers(cache, tmp_dir) == [], r
    assert git(cache / "src" / VERSION / "pristine", "status", "--porcelain") == "?? .onebit-ok\n"


def test_build_stops_at_a_patch_that_does_not_apply(repo: Path, cache: Path, tmp_dir: Path, broken_patch: str) -> None:
    r = run_build_sh(repo, cache, "build", tmpdir=tmp_dir, no_cmake=True)
    assert r.rc == 1, r
    assert "==> apply patches/series (git am -3)" in r.stderr, r
    assert "error: the series does not apply to the pristine tree" in r.stderr, r
    assert broken_patch in r.stderr, f"the failing patch is not named\n{r}"
    assert "configure llama.cpp" not in r.stderr, r
    assert not (cache / "build").exists(), r
    assert not (repo / "build").exists(), r
    assert leftovers(cache, tmp_dir) == [], f"a half-patched tree was left behind\n{r}"


# --- 6. a clean check -------------------------------------------------------------------------


def _recording_cmake(where: Path, fail_build: int = 0) -> Path:
    """A cmake that records its calls in where/cmake.log, lists every target for ``--target help``
    and fails its FAIL_BUILD-th build (0: none): the per-patch compile step without a compiler."""
    bin_dir = where / "recording-cmake-bin"
    bin_dir.mkdir(exist_ok=True)
    log = where / "cmake.log"
    stub = bin_dir / "cmake"
    stub.write_text(
        f"""#!/bin/sh
echo "$*" >> '{log}'
case "$*" in
  *"--target help"*) for t in llama test-onebit-moe-policy llama-cli ggml-rpc-server; do echo "... $t"; done; exit 0;;
  --build*) n=$(grep -c -- '^--build .* -j' '{log}')
            [ "$n" = "{fail_build}" ] && {{ echo 'stub: error' >&2; exit 2; }};;
esac
exit 0
"""
    )
    stub.chmod(0o755)
    return bin_dir


def test_check_passes_on_the_committed_series(repo: Path, cache: Path, tmp_dir: Path) -> None:
    before = {p.name: p.read_bytes() for p in (repo / "patches").iterdir()}
    stub = _recording_cmake(tmp_dir.parent)
    r = run_build_sh(
        repo, cache, "check", tmpdir=tmp_dir, extra_env={"PATH": f"{stub}{os.pathsep}{os.environ['PATH']}"}
    )
    assert r.rc == 0, r
    n = len(series(repo))
    assert (
        f"==> check passed: {n} patch(es) apply without fuzz, re-export byte-identically and each compiles" in r.stderr
    )
    # every patch configured and compiled, the targets that exist at that patch only
    calls = (tmp_dir.parent / "cmake.log").read_text().splitlines()
    builds = [c for c in calls if c.startswith("--build") and " -j " in c]
    assert len([c for c in calls if c.startswith("-S ")]) == n and len(builds) == n, calls
    assert all(b.endswith("--target llama test-onebit-moe-policy llama-cli ggml-rpc-server") for b in builds), builds
    assert "error" not in r.stderr, r
    assert {p.name: p.read_bytes() for p in (repo / "patches").iterdir()} == before, "check changed patches/"
    assert leftovers(cache, tmp_dir) == [], f"check left files behind\n{r}"
    assert ruff_calls(repo) == [f"check {repo}", f"format --check {repo}"], r


def test_check_names_a_patch_that_does_not_compile(repo: Path, cache: Path, tmp_dir: Path) -> None:
    stub = _recording_cmake(tmp_dir.parent, fail_build=2)
    r = run_build_sh(
        repo, cache, "check", tmpdir=tmp_dir, extra_env={"PATH": f"{stub}{os.pathsep}{os.environ['PATH']}"}
    )
    assert r.rc == 1, r
    assert "[2/" in r.stderr and "patch 2 ('" in r.stderr and "does not compile on its own" in r.stderr, r
    assert "check passed" not in r.stderr, r


def test_check_can_skip_the_compile(repo: Path, cache: Path, tmp_dir: Path) -> None:
    r = run_build_sh(repo, cache, "check", tmpdir=tmp_dir, no_cmake=True, extra_env={"ONEBIT_CHECK_COMPILE": "0"})
    assert r.rc == 0, r
    assert "(ONEBIT_CHECK_COMPILE=0: not compiled patch by patch)" in r.stderr, r


@pytest.mark.parametrize(
    ("failing", "message"),
    [
        ("check", "error: ruff check found problems (above)"),
        ("format", "error: ruff format would reformat the files above"),
    ],
)
def test_ruff_problems_fail_the_check(repo: Path, cache: Path, tmp_dir: Path, failing: str, message: str) -> None:
    (repo / ".venv" / f"ruff-fails-{failing}").touch()
    r = run_build_sh(repo, cache, "check", tmpdir=tmp_dir)
    assert r.rc == 1, r
    assert message in r.stderr, r
    assert f"stub ruff: {failing} found problems" in r.stderr, f"ruff's report is not shown\n{r}"
    assert "==> apply the series to a clean pristine tree" not in r.stderr, r
    assert leftovers(cache, tmp_dir) == [], r


def test_check_without_ruff_says_where_it_comes_from(repo: Path, cache: Path, tmp_dir: Path) -> None:
    (repo / ".venv" / "bin" / "ruff").unlink()
    r = run_build_sh(repo, cache, "check", tmpdir=tmp_dir)
    assert r.rc == 1, r
    assert f"error: no ruff in {repo}/.venv: it comes with the test extra" in r.stderr, r


# --- 7. rebase --tree -------------------------------------------------------------------------


def commits_above_pristine(tree: Path) -> list[str]:
    return git(tree, "log", "--reverse", "--format=%s", f"{PRISTINE_TAG}..HEAD").splitlines()


def subjects(repo: Path) -> list[str]:
    """The subjects of the series' patches, unfolded as git log prints them."""
    out = []
    for name in series(repo):
        head = (repo / "patches" / name).read_text().split("\n\n", 1)[0]
        subject = head.split("Subject: ", 1)[1].replace("\n ", " ")
        out.append(subject.removeprefix("[PATCH] "))
    return out


def test_rebase_tree_applies_the_series(repo: Path, cache: Path, seed: Seed, tmp_path: Path) -> None:
    tree = clone_pristine(seed.pristine, tmp_path / "llama.cpp", branch="mine")
    base = git(tree, "rev-parse", "HEAD").strip()
    r = run_build_sh(repo, cache, "rebase", "--tree", str(tree))
    assert r.rc == 0, r
    assert f"==> the series applies to {tree}" in r.stderr, r
    assert git(tree, "rev-parse", "--abbrev-ref", "HEAD").strip() == "mine"
    assert commits_above_pristine(tree) == subjects(repo)
    assert git(tree, "rev-parse", f"HEAD~{len(series(repo))}").strip() == base
    assert git(tree, "status", "--porcelain", "--untracked-files=no") == ""


def test_rebase_tree_conflict_names_patch_files_and_recovery(
    repo: Path, cache: Path, seed: Seed, tmp_path: Path
) -> None:
    # the first patch that inserts lines into an upstream file; change both lines around the
    # insertion upstream, so a three-way merge cannot place the patch's lines
    patch_name = next(n for n in series(repo) if inserts_upstream(repo / "patches" / n))
    path, before, after, _added = first_upstream_hunk(repo / "patches" / patch_name)
    tree = clone_pristine(seed.pristine, tmp_path / "llama.cpp", branch="mine")
    target = tree / path
    text = target.read_text()
    pair = f"{before}\n{after}\n"
    assert text.count(pair) == 1, f"{path}: the context of {patch_name} is not unique upstream"
    target.write_text(text.replace(pair, f"{before} # changed upstream\n{after} # changed upstream\n"))
    git(tree, "commit", "-q", "-am", "upstream moves on")
    head = git(tree, "rev-parse", "HEAD").strip()

    r = run_build_sh(repo, cache, "rebase", "--tree", str(tree))
    assert r.rc == 1, r
    assert "error: conflict while applying" in r.stderr and f"in {tree}" in r.stderr, r
    assert patch_name in r.stderr, f"the conflicting patch is not named\n{r}"
    assert "conflicting files:" in r.stderr and f"    {path}\n" in r.stderr, r
    assert f"    cd {tree}\n" in r.stderr, r
    assert "git am --continue" in r.stderr, r
    assert f"{repo}/build.sh export --from {tree}" in r.stderr, r
    # the tree is left in git am for the user to resolve, nothing of the series committed
    assert git(tree, "rev-parse", "HEAD").strip() == head
    assert Path(git(tree, "rev-parse", "--absolute-git-dir").strip(), "rebase-apply").is_dir()
    assert path in git(tree, "diff", "--name-only", "--diff-filter=U")

    # exporting from the tree in the middle of git am is refused, patches/ untouched
    before_export = {p.name: p.read_bytes() for p in (repo / "patches").iterdir()}
    e = run_build_sh(repo, cache, "export", "--from", str(tree))
    assert e.rc == 1, e
    assert "is in the middle of git am: finish it (git am --continue) first" in e.stderr, e
    assert {p.name: p.read_bytes() for p in (repo / "patches").iterdir()} == before_export


def test_rebase_tree_with_uncommitted_changes_exits_2(repo: Path, cache: Path, seed: Seed, tmp_path: Path) -> None:
    tree = clone_pristine(seed.pristine, tmp_path / "llama.cpp", branch="mine")
    head = git(tree, "rev-parse", "HEAD").strip()
    with (tree / "README.md").open("a") as f:
        f.write("\nlocal edit\n")
    r = run_build_sh(repo, cache, "rebase", "--tree", str(tree))
    assert r.rc == 2, r
    assert f"error: --tree '{tree}' has uncommitted changes; commit or stash them first" in r.stderr, r
    assert git(tree, "rev-parse", "HEAD").strip() == head
    gitdir = Path(git(tree, "rev-parse", "--absolute-git-dir").strip())
    assert not (gitdir / "rebase-apply").exists()
    assert "local edit" in (tree / "README.md").read_text()


# --- 8. export --from -------------------------------------------------------------------------


def test_export_from_a_rebased_tree_is_byte_identical(
    repo: Path, cache: Path, seed: Seed, tmp_path: Path, tmp_dir: Path
) -> None:
    tree = clone_pristine(seed.pristine, tmp_path / "llama.cpp", branch="mine")
    r = run_build_sh(repo, cache, "rebase", "--tree", str(tree))
    assert r.rc == 0, r
    # start from an emptied patches/ (PIN kept), so every byte comes from the export
    for p in (repo / "patches").iterdir():
        if p.name != "PIN":
            p.unlink()
    e = run_build_sh(repo, cache, "export", "--from", str(tree), tmpdir=tmp_dir)
    assert e.rc == 0, e
    assert list(tmp_dir.iterdir()) == [], "export left its temporary directory behind"
    n = len(series(REPO_ROOT))
    assert f"==> exported {n} patch(es) from {tree} into patches/" in e.stderr, e
    exported = {p.name: p.read_bytes() for p in (repo / "patches").iterdir()}
    committed = {p.name: p.read_bytes() for p in (REPO_ROOT / "patches").iterdir()}
    assert sorted(exported) == sorted(committed)
    for name, data in committed.items():
        assert exported[name] == data, f"patches/{name} differs after export"


# --- 9. the emulated drive's system packages (build.sh sourced) --------------------------------

DRIVE_PACKAGES = ("libfuse3-dev", "fuse3", "fio", "pkg-config")
# cmd_build with every step around system_packages stood in for: each says its name
CMD_BUILD_STUBS = """
pin_value() { echo 0.0.0; }
series_hash() { echo 0; }
flags_hash() { echo 0; }
open_log() { LOG=$SYSPKG_LOG; }
pinned_pristine() { :; }
apply_series() { :; }
build_tree() { say "stub: build_tree"; }
current_env() { :; }
lib_dir_of() { echo /nowhere; }
setup_python() { say "stub: setup_python"; }
"""


@dataclass(frozen=True)
class Machine:
    """What the system-packages step finds: the user id, the packages dpkg-query lists as installed,
    the ones whose commands work (fio, fusermount3, pkg-config and its fuse3), apt-get and its exit."""

    uid: int = 0
    dpkg: tuple[str, ...] | None = None  # None: no dpkg-query
    working: tuple[str, ...] = ()
    apt_get: bool = True
    apt_exit: int = 0


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)


def run_system_packages(tmp_path: Path, machine: Machine, call: str = "system_packages", **env: str) -> Run:
    """``CALL`` in a bash that sourced the checkout's build.sh, on a PATH of stand-ins only; apt-get's
    calls recorded in tmp_path/apt-calls, one line each with DEBIAN_FRONTEND first."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname",):  # what sourcing build.sh runs (ONEBIT_JOBS set: no nproc)
        os.symlink(shutil.which(tool), bin_dir / tool)
    _stub(bin_dir / "id", f'[ "$1" = -u ] && echo {machine.uid}\n')
    if machine.dpkg is not None:
        listed = " ".join(machine.dpkg)
        _stub(
            bin_dir / "dpkg-query",
            f'pkg=$3\ncase " {listed} " in *" $pkg "*) printf "install ok installed"; exit 0;; esac\n'
            'echo "dpkg-query: no packages found matching $pkg" >&2\nexit 1\n',
        )
    if "pkg-config" in machine.working:
        fuse = 0 if "libfuse3-dev" in machine.working else 1
        _stub(bin_dir / "pkg-config", f'[ "$1 $2" = "--exists fuse3" ] && exit {fuse}\nexit 1\n')
    if "fio" in machine.working:
        _stub(bin_dir / "fio", "exit 0\n")
    if "fuse3" in machine.working:
        _stub(bin_dir / "fusermount3", "exit 0\n")
    calls = tmp_path / "apt-calls"
    if machine.apt_get:
        _stub(
            bin_dir / "apt-get", f'echo "DEBIAN_FRONTEND=$DEBIAN_FRONTEND $*" >> "{calls}"\nexit {machine.apt_exit}\n'
        )
    log = tmp_path / "build.log"
    script = f'source "$1"\nLOG=$2\n{CMD_BUILD_STUBS if call == "cmd_build" else ""}\n{call}\n'
    full_env = {
        "PATH": str(bin_dir),
        "HOME": str(tmp_path),
        "ONEBIT_CACHE": str(tmp_path / "cache"),
        "ONEBIT_JOBS": "1",
        "SYSPKG_LOG": str(log),
        **env,
    }
    p = subprocess.run(
        [shutil.which("bash"), "-c", script, "bash", str(REPO_ROOT / "build.sh"), str(log)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    return Run(p.returncode, p.stdout, p.stderr)


def apt_calls(tmp_path: Path) -> list[str]:
    calls = tmp_path / "apt-calls"
    return calls.read_text().splitlines() if calls.exists() else []


UPDATE = "DEBIAN_FRONTEND= update"
INSTALL = "DEBIAN_FRONTEND=noninteractive install -y --no-install-recommends"
STEP_SAID = "==> install the emulated drive's system packages: apt-get install"
NOTICE_SAID = "notice: the emulated drive (onebit-drive, onebit-bench --drive) needs"
# (the machine, the packages it lacks, whether the step installs them)
SYSTEM_PACKAGE_CASES = {
    # root with apt-get: installs exactly what is missing, after apt-get update
    "root, nothing there": (Machine(uid=0), DRIVE_PACKAGES, True),
    "root, dpkg lists some": (Machine(uid=0, dpkg=("fuse3", "pkg-config")), ("libfuse3-dev", "fio"), True),
    "root, some commands work": (Machine(uid=0, working=("pkg-config", "fio")), ("libfuse3-dev", "fuse3"), True),
    "root, dpkg lists all": (Machine(uid=0, dpkg=DRIVE_PACKAGES), (), False),
    "root, all commands work": (Machine(uid=0, dpkg=(), working=DRIVE_PACKAGES), (), False),
    # not root, or no apt-get: the command, as a notice, and nothing run
    "user": (Machine(uid=1000, dpkg=("fio",)), ("libfuse3-dev", "fuse3", "pkg-config"), False),
    "root without apt-get": (Machine(uid=0, apt_get=False), DRIVE_PACKAGES, False),
}


@pytest.mark.parametrize("case", sorted(SYSTEM_PACKAGE_CASES))
def test_system_packages_installs_as_root_and_says_the_command_otherwise(tmp_path: Path, case: str) -> None:
    machine, missing, installs = SYSTEM_PACKAGE_CASES[case]
    r = run_system_packages(tmp_path, machine)
    assert r.rc == 0, r
    names = " ".join(missing)
    if installs:
        assert apt_calls(tmp_path) == [UPDATE, f"{INSTALL} {names}"], r
        assert f"{STEP_SAID} {names}\n" in r.stderr and "notice" not in r.stderr, r
    elif missing:
        assert apt_calls(tmp_path) == [], r
        assert f"{NOTICE_SAID} {names}, not installed; to install them: sudo apt-get install {names}\n" in r.stderr, r
        assert "==> install" not in r.stderr, r
    else:
        assert apt_calls(tmp_path) == [] and r.stderr == "", r


def test_onebit_no_apt_skips_the_step(tmp_path: Path) -> None:
    r = run_system_packages(tmp_path, Machine(uid=0), ONEBIT_NO_APT="1")
    assert r.rc == 0 and r.stderr == "", r
    assert apt_calls(tmp_path) == []
    assert "ONEBIT_NO_APT=1" in run_build_sh(REPO_ROOT, tmp_path / "cache", "help").stdout


def test_a_failed_apt_get_is_a_notice_and_the_build_goes_on(tmp_path: Path) -> None:
    r = run_system_packages(tmp_path, Machine(uid=0, apt_exit=100), call="cmd_build")
    assert r.rc == 0, r
    assert apt_calls(tmp_path) == [UPDATE], "install ran after a failed update"
    assert "notice: apt-get could not install libfuse3-dev fuse3 fio pkg-config (its log: " in r.stderr, r
    assert "stub: setup_python" in r.stderr, f"the build stopped at apt-get\n{r}"


@pytest.mark.parametrize(("uid", "said"), [(0, STEP_SAID), (1000, NOTICE_SAID)])
def test_the_build_runs_the_step_between_llama_cpp_and_python(tmp_path: Path, uid: int, said: str) -> None:
    r = run_system_packages(tmp_path, Machine(uid=uid), call="cmd_build")
    assert r.rc == 0, r
    marks = ("stub: build_tree", said, "stub: setup_python")
    seen = [m for line in r.stderr.splitlines() for m in marks if line.startswith(m)]
    assert seen == list(marks), r
    assert bool(apt_calls(tmp_path)) == (uid == 0), r
