"""tools/series.py: patches/PIN and patches/series, read and linted for build.sh.

Each test writes a small patches/ directory of its own (format-patch files with the header
docs/patches.md asks for) and runs the module's command line on it: what it prints, on which
stream, and its exit code (0 ok, 1 lint problems, 2 usage or a missing/malformed PIN or series).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import series

REPO_ROOT = Path(__file__).resolve().parents[1]

PIN_TEXT = """\
# a comment
package=llama-cpp-python
version=1.2.3
sha256=00ff
"""

HEADER = {
    "Why:": "Why: the predictor needs the routing of layer l before layer l+1 runs.",
    "Hooks:": "Hooks: src/llama-graph.cpp (build_moe_ffn), one call.",
    "Drop when:": "Drop when: llama.cpp exposes the router logits itself.",
    "Upstream:": "Upstream: no, project-specific.",
}


def patch_text(subject: str, *, drop: str | None = None, folded: bool = False) -> str:
    body = "\n".join(line for key, line in HEADER.items() if key != drop)
    subject_line = f"Subject: [PATCH] {subject}"
    if folded:  # git folds a long Subject: header at a blank
        head, tail = subject.rsplit(" ", 1)
        subject_line = f"Subject: [PATCH] {head}\n {tail}"
    return (
        "From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\n"
        "From: A Developer <dev@example.org>\n"
        "Date: Mon, 1 Jun 2026 12:00:00 +0000\n"
        f"{subject_line}\n"
        "\n"
        f"{body}\n"
        "---\n"
        " src/x.cpp | 1 +\n"
        " 1 file changed, 1 insertion(+)\n"
        "\n"
        "diff --git a/src/x.cpp b/src/x.cpp\n"
        "--- a/src/x.cpp\n"
        "+++ b/src/x.cpp\n"
        "@@ -1 +1,2 @@\n"
        " int x;\n"
        "+int y;\n"
        "-- \n"
        "2.43.0\n"
    )


GOOD = {
    "0001-ggml-cpu-fix-AMX-batched-mul_mat-offsets.patch": "ggml-cpu: fix AMX batched mul_mat offsets",
    "0002-onebit-build-wiring-and-the-policy.patch": "onebit: build wiring and the policy",
    "0003-onebit-the-P-A-trace.patch": "onebit: the P/A trace",
}


def make_patches(
    root: Path, patches: dict[str, str] | None = None, *, listed: list[str] | None = None, pin: str | None = PIN_TEXT
) -> Path:
    """root/patches with PIN, the given {file name: text} and a series listing `listed`
    (default: every file, in order)."""
    d = root / "patches"
    d.mkdir()
    if pin is not None:
        (d / "PIN").write_text(pin)
    patches = {name: patch_text(subject) for name, subject in GOOD.items()} if patches is None else patches
    for name, text in patches.items():
        (d / name).write_text(text)
    names = list(patches) if listed is None else listed
    (d / "series").write_text("".join(f"{n}\n" for n in names))
    return d


def run(capsys: pytest.CaptureFixture[str], d: Path, *args: str) -> tuple[int, str, str]:
    rc = series.main(["--patches", str(d), *args])
    out, err = capsys.readouterr()
    return rc, out, err


def errors(err: str) -> list[str]:
    return [line.removeprefix("error: ") for line in err.splitlines() if line.startswith("error: ")]


# --- a good series ------------------------------------------------------------------------------


def test_a_good_series_passes_the_lint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_patches(tmp_path)
    assert series.lint(d) == []
    assert run(capsys, d, "lint") == (0, "", "")


def test_files_prints_the_listed_patches_in_order(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_patches(tmp_path)
    order = list(reversed(GOOD))
    (d / "series").write_text("# the series\n\n" + "".join(f"  {n}  # a comment\n" for n in order))
    rc, out, err = run(capsys, d, "files")
    assert (rc, err) == (0, "")
    assert out.splitlines() == [str(d / n) for n in order]
    assert all(Path(line).is_absolute() for line in out.splitlines())


def test_a_folded_subject_is_read_whole(tmp_path: Path) -> None:
    name = "0001-onebit-a-subject-that-git-folded-over-two-lines.patch"
    d = make_patches(tmp_path, {name: patch_text("onebit: a subject that git folded over two lines", folded=True)})
    subject, _ = series.commit_message((d / name).read_text())
    assert subject == "onebit: a subject that git folded over two lines"
    assert series.lint(d) == []


# --- the pin ------------------------------------------------------------------------------------


def test_pin_prints_a_value(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_patches(tmp_path)
    assert run(capsys, d, "pin", "version") == (0, "1.2.3\n", "")
    assert run(capsys, d, "pin", "package") == (0, "llama-cpp-python\n", "")


@pytest.mark.parametrize(
    ("pin", "key", "message"),
    [
        (None, "version", "patches/PIN is missing"),
        (PIN_TEXT, "upstream", "patches/PIN has no 'upstream='"),
        ("version=\n", "version", "patches/PIN has no 'version='"),
        ("version 1.2.3\n", "version", "patches/PIN line 1 is not KEY=VALUE: 'version 1.2.3'"),
    ],
    ids=["missing", "no key", "empty value", "malformed"],
)
def test_a_missing_or_malformed_pin_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pin: str | None, key: str, message: str
) -> None:
    d = make_patches(tmp_path, pin=pin)
    rc, out, err = run(capsys, d, "pin", key)
    assert (rc, out) == (2, "")
    assert errors(err) == [message]


# --- what the lint refuses ----------------------------------------------------------------------


def test_a_duplicate_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = list(GOOD)
    d = make_patches(tmp_path, listed=[*names, names[1]])
    rc, _, err = run(capsys, d, "lint")
    assert rc == 1
    assert errors(err) == [f"listed twice in patches/series: {names[1]}"]


def test_an_unlisted_patch_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = list(GOOD)
    d = make_patches(tmp_path, listed=names[:2])
    rc, _, err = run(capsys, d, "lint")
    assert rc == 1
    assert errors(err) == [f"{names[2]} is in patches/ but not in patches/series"]


def test_a_listed_patch_that_is_missing_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_patches(tmp_path, listed=[*GOOD, "0004-onebit-not-there.patch"])
    message = "patches/series lists '0004-onebit-not-there.patch', which is not in patches/"
    rc, _, err = run(capsys, d, "lint")
    assert rc == 2
    assert errors(err) == [message]
    rc, out, err = run(capsys, d, "files")
    assert (rc, out) == (2, "")
    assert errors(err) == [message]


def test_a_missing_series_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_patches(tmp_path)
    (d / "series").unlink()
    for command in ("lint", "files"):
        rc, out, err = run(capsys, d, command)
        assert (rc, out) == (2, "")
        assert errors(err) == ["patches/series is missing"]


def test_an_empty_series_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = make_patches(tmp_path, {})
    rc, _, err = run(capsys, d, "lint")
    assert rc == 1
    assert errors(err) == ["patches/series lists no patch"]


@pytest.mark.parametrize("key", list(HEADER))
def test_a_header_without_a_line_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str) -> None:
    name, subject = next(iter(GOOD.items()))
    d = make_patches(tmp_path, {name: patch_text(subject, drop=key)})
    rc, _, err = run(capsys, d, "lint")
    assert rc == 1
    assert errors(err) == [f"{name} has no '{key}' line in its header"]


def test_header_lines_count_in_the_commit_message_only(tmp_path: Path) -> None:
    name, subject = next(iter(GOOD.items()))
    text = patch_text(subject, drop="Upstream:").replace("+int y;\n", "+int y;\nUpstream: in the diff\n")
    d = make_patches(tmp_path, {name: text})
    assert [p.message for p in series.lint(d)] == [f"{name} has no 'Upstream:' line in its header"]


def test_a_subject_too_long_for_a_file_name_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    subject = "onebit: capture each layer's routing, router-mode prediction, the P/A trace"
    name = "0001-onebit-capture-each-layer-s-routing-router-mode-pred.patch"  # as git cuts it
    d = make_patches(tmp_path, {name: patch_text(subject)})
    rc, _, err = run(capsys, d, "lint")
    assert rc == 1
    assert errors(err) == [
        f"{name}: its subject is 72 characters as a file name, git format-patch keeps 52 and cuts the rest: "
        f"shorten the subject '{subject}'"
    ]


def test_a_name_longer_than_52_fails(tmp_path: Path) -> None:
    subject = "onebit: " + "x" * 50
    name = f"0001-onebit-{'x' * 50}.patch"  # renamed by hand past what git would write
    d = make_patches(tmp_path, {name: patch_text(subject)})
    messages = [p.message for p in series.lint(d)]
    assert f"{name}: the subject part of its name is 57 characters (at most 52)" in messages


def test_a_name_that_is_not_its_subject_fails(tmp_path: Path) -> None:
    name = "0001-onebit-a-name-of-its-own.patch"
    d = make_patches(tmp_path, {name: patch_text("onebit: the real subject")})
    assert [p.message for p in series.lint(d)] == [
        f"{name}: its name does not match its subject: git format-patch names it 0001-onebit-the-real-subject.patch"
    ]


def test_every_problem_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = list(GOOD)
    texts = {
        name: patch_text(subject, drop="Why:" if i == 0 else None) for i, (name, subject) in enumerate(GOOD.items())
    }
    d = make_patches(tmp_path, texts, listed=[names[0], names[0], names[1]])
    rc, _, err = run(capsys, d, "lint")
    assert rc == 1
    assert sorted(errors(err)) == sorted(
        [
            f"listed twice in patches/series: {names[0]}",
            f"{names[2]} is in patches/ but not in patches/series",
            f"{names[0]} has no 'Why:' line in its header",
        ]
    )


# --- git's file names ---------------------------------------------------------------------------

# subjects and the file names git 2.43 format-patch gave them (before its cut at 52 characters)
GIT_NAMES = [
    ("onebit: a... b..c", "onebit-a.-b.c"),
    ("x: (hyper) -- PLE; QSA!", "x-hyper-PLE-QSA"),
    ("ggml-cpu: AMX mul_mat, fixed.", "ggml-cpu-AMX-mul_mat-fixed"),
    ("café: non-ascii déjà vu", "caf-non-ascii-d-j-vu"),
    ("_lead under_score_ ...", "_lead-under_score_"),
    ("onebit: block mode, run layer l+1's own block", "onebit-block-mode-run-layer-l-1-s-own-block"),
]


@pytest.mark.parametrize(("subject", "name"), GIT_NAMES)
def test_sanitized_subject_is_gits(subject: str, name: str) -> None:
    assert series.sanitized_subject(subject) == name


# --- the command line ---------------------------------------------------------------------------


@pytest.mark.parametrize("args", [[], ["pin"], ["pin", "a", "b"], ["files", "x"], ["frob"], ["--patches"]])
def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], args: list[str]) -> None:
    rc = series.main(args)
    out, err = capsys.readouterr()
    assert (rc, out) == (2, "")
    assert err.startswith("error: ") and series.USAGE in err


def test_runs_as_a_script_with_the_standard_library_alone(tmp_path: Path) -> None:
    """build.sh runs ``$PYTHON tools/series.py`` with the system's python3 before .venv exists:
    run here with no site-packages (-S), no environment and no checkout on the path (-I), from
    another directory, it must still answer."""
    d = make_patches(tmp_path)
    script = REPO_ROOT / "tools" / "series.py"

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-I", "-S", str(script), "--patches", str(d), *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )

    p = run("pin", "version")
    assert (p.returncode, p.stdout, p.stderr) == (0, "1.2.3\n", "")
    p = run("lint")
    assert (p.returncode, p.stdout, p.stderr) == (0, "", "")
    p = run("files")
    assert p.returncode == 0 and p.stdout.splitlines() == [str(d / n) for n in (d / "series").read_text().split()]


# --- the committed series -----------------------------------------------------------------------


def test_the_committed_series_passes_the_lint() -> None:
    """What ./build.sh check lints first, without build.sh."""
    problems = series.lint(REPO_ROOT / "patches")
    assert not problems, "\n".join(p.message for p in problems)
