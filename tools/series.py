#!/usr/bin/env python3
"""patches/PIN and patches/series, read and linted for build.sh.

Build tooling, not part of the installed package: standard library only and nothing from
onebit_predict, because build.sh runs this script with the system's python3 before any
virtualenv exists.

    python3 tools/series.py [--patches DIR] pin KEY   print KEY's value in PIN
    python3 tools/series.py [--patches DIR] files     the series' patch files, in order
    python3 tools/series.py [--patches DIR] lint      check the series and each header

DIR defaults to ``patches`` (run from the checkout's root). Exit codes: 0 ok; 1 lint
problems, each printed on stderr; 2 usage error, or a PIN or series that is missing or
malformed (a key absent, a listed patch not in DIR).

What ``lint`` asks of the series (docs/patches.md says why):

- patches/series lists at least one patch, none twice, and every listed file exists;
- every ``*.patch`` in DIR is listed;
- every listed patch has a ``Subject:`` and, in its commit message, the lines ``Why:``,
  ``Hooks:``, ``Drop when:`` and ``Upstream:``;
- its file name is the one ``git format-patch`` gives its subject, whole: the subject part
  (between ``NNNN-`` and ``.patch``) at most 52 characters, so git never cuts it.
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass
from email.header import decode_header, make_header
from pathlib import Path

PIN_FILE = "PIN"
SERIES_FILE = "series"
HEADER_LINES = ("Why:", "Hooks:", "Drop when:", "Upstream:")
# git format-patch names a patch NNNN-<subject>.patch in at most 64 characters
# (format.filenameMaxLength): 5 for "NNNN-", 7 for ".patch" and its terminator, 52 left
SUBJECT_NAME_MAX = 52
_NAME = re.compile(r"^(\d{4})-(.+)\.patch$")
_PATCH_PREFIX = re.compile(r"^\[PATCH[^\]]*\]\s*")

USAGE = "usage: python3 tools/series.py [--patches DIR] {pin KEY | files | lint}"


class SeriesError(Exception):
    """PIN or series is missing or malformed (exit 2)."""


@dataclass(frozen=True)
class Problem:
    message: str
    input_error: bool = False  # a listed file that does not exist: exit 2, as files does


def _label(patches: Path, name: str) -> str:
    return f"{patches.name}/{name}"


# --- PIN --------------------------------------------------------------------------------------


def read_pin(patches: Path) -> dict[str, str]:
    """PIN's KEY=VALUE lines (comments and blank lines skipped; the first of a key wins)."""
    path = patches / PIN_FILE
    if not path.is_file():
        raise SeriesError(f"{_label(patches, PIN_FILE)} is missing")
    pin: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not key.strip():
            raise SeriesError(f"{_label(patches, PIN_FILE)} line {number} is not KEY=VALUE: {line!r}")
        pin.setdefault(key.strip(), value.strip())
    return pin


def pin_value(patches: Path, key: str) -> str:
    value = read_pin(patches).get(key, "")
    if not value:
        raise SeriesError(f"{_label(patches, PIN_FILE)} has no '{key}='")
    return value


# --- series -----------------------------------------------------------------------------------


def listed_names(patches: Path) -> list[str]:
    """The names patches/series lists, in order (comments after '#' and whitespace dropped)."""
    path = patches / SERIES_FILE
    if not path.is_file():
        raise SeriesError(f"{_label(patches, SERIES_FILE)} is missing")
    names = ("".join(line.split("#", 1)[0].split()) for line in path.read_text().splitlines())
    return [name for name in names if name]


def _not_there(patches: Path, name: str) -> str:
    return f"{_label(patches, SERIES_FILE)} lists '{name}', which is not in {patches.name}/"


def series_files(patches: Path) -> list[Path]:
    """The listed patch files, absolute, in series order; SeriesError on one that is absent."""
    base = Path(os.path.abspath(patches))
    files = []
    for name in listed_names(patches):
        if not (patches / name).is_file():
            raise SeriesError(_not_there(patches, name))
        files.append(base / name)
    return files


# --- one patch's header -----------------------------------------------------------------------


def commit_message(text: str) -> tuple[str | None, list[str]]:
    """(subject, message lines) of a git format-patch file: the subject unfolded and without
    its [PATCH] prefix, the lines up to the '---' that opens the diffstat."""
    lines = text.splitlines()
    subject = None
    message: list[str] = []
    for i, line in enumerate(lines):
        if line == "---":
            break
        if subject is None and line.startswith("Subject:"):
            parts = [line[len("Subject:") :].strip()]
            j = i + 1
            while j < len(lines) and lines[j][:1] in (" ", "\t"):
                parts.append(lines[j])  # RFC 2822 folding: the line break goes, the blank stays
                j += 1
            raw = "".join(parts)
            if "=?" in raw:
                raw = str(make_header(decode_header(raw)))
            subject = _PATCH_PREFIX.sub("", raw.strip())
        message.append(line)
    return subject, message


def sanitized_subject(subject: str) -> str:
    """The subject as git format-patch writes it into a file name (format_sanitized_subject,
    before the length cut): runs of other characters become one '-', repeated dots one '.',
    trailing '.' and '-' dropped."""
    out: list[str] = []
    gap = False
    i = 0
    while i < len(subject):
        c = subject[i]
        if (c.isascii() and c.isalnum()) or c in "._":
            if gap and out:
                out.append("-")
            gap = False
            out.append(c)
            if c == ".":
                while i + 1 < len(subject) and subject[i + 1] == ".":
                    i += 1
        else:
            gap = True
        i += 1
    return "".join(out).rstrip(".-")


def lint_patch(patches: Path, name: str) -> list[Problem]:
    problems: list[Problem] = []
    subject, message = commit_message((patches / name).read_text(errors="replace"))
    for key in HEADER_LINES:
        if not any(line.startswith(key) for line in message):
            problems.append(Problem(f"{name} has no '{key}' line in its header"))
    m = _NAME.match(name)
    if m is None:
        problems.append(Problem(f"{name}: not a git format-patch file name (NNNN-subject.patch)"))
        return problems
    in_name = m.group(2)
    if len(in_name) > SUBJECT_NAME_MAX:
        problems.append(
            Problem(f"{name}: the subject part of its name is {len(in_name)} characters (at most {SUBJECT_NAME_MAX})")
        )
    if subject is None:
        problems.append(Problem(f"{name} has no 'Subject:' line in its header"))
        return problems
    whole = sanitized_subject(subject)
    if len(whole) > SUBJECT_NAME_MAX:
        problems.append(
            Problem(
                f"{name}: its subject is {len(whole)} characters as a file name, git format-patch keeps "
                f"{SUBJECT_NAME_MAX} and cuts the rest: shorten the subject '{subject}'"
            )
        )
    elif in_name != whole:
        problems.append(
            Problem(
                f"{name}: its name does not match its subject: git format-patch names it {m.group(1)}-{whole}.patch"
            )
        )
    return problems


# --- the whole series -------------------------------------------------------------------------


def lint(patches: Path) -> list[Problem]:
    """Every problem of the series and its headers; SeriesError if patches/series is missing."""
    listed = listed_names(patches)
    problems: list[Problem] = []
    if not listed:
        problems.append(Problem(f"{_label(patches, SERIES_FILE)} lists no patch"))
    seen: set[str] = set()
    for name in listed:
        if name in seen:
            problems.append(Problem(f"listed twice in {_label(patches, SERIES_FILE)}: {name}"))
        seen.add(name)
    for name in sorted(seen):
        if not (patches / name).is_file():
            problems.append(Problem(_not_there(patches, name), input_error=True))
    for path in sorted(patches.glob("*.patch")):
        if path.name not in seen:
            problems.append(Problem(f"{path.name} is in {patches.name}/ but not in {_label(patches, SERIES_FILE)}"))
    for name in dict.fromkeys(listed):
        if (patches / name).is_file():
            problems.extend(lint_patch(patches, name))
    return problems


# --- command line -----------------------------------------------------------------------------


def _error(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    patches = Path("patches")
    if args[:1] == ["--patches"]:
        if len(args) < 2:
            _error("--patches needs a DIR")
            print(USAGE, file=sys.stderr)
            return 2
        patches = Path(args[1])
        args = args[2:]
    if args in (["-h"], ["--help"], ["help"]):
        print(USAGE)
        return 0
    command, rest = (args[0], args[1:]) if args else ("", [])
    if not ((command == "pin" and len(rest) == 1) or (command in ("files", "lint") and not rest)):
        _error(f"unknown command {' '.join(args)!r}" if args else "no command")
        print(USAGE, file=sys.stderr)
        return 2
    try:
        if command == "pin":
            print(pin_value(patches, rest[0]))
        elif command == "files":
            for path in series_files(patches):
                print(path)
        else:
            problems = lint(patches)
            for problem in problems:
                _error(problem.message)
            if any(p.input_error for p in problems):
                return 2
            return 1 if problems else 0
    except SeriesError as e:
        _error(str(e))
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
