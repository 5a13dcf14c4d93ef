"""One pin: patches/PIN is the only place that names the llama.cpp tree the series applies to.

build.sh reads it (through tools/series.py); pyproject.toml must name the same
llama-cpp-python (pip resolves the package from it), and these tests hold it to PIN. No other
file in the checkout may name another llama-cpp-python version, and the front page (README.md)
and docs/patches.md name the pin only by pointing at patches/PIN.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tools.series import read_pin

REPO_ROOT = Path(__file__).resolve().parents[1]
PIN = read_pin(REPO_ROOT / "patches")

# a llama-cpp-python version as a requirement (llama-cpp-python==X) or as its sdist's name
# (llama_cpp_python-X.tar.gz)
VERSION_REF = re.compile(r"llama[-_]cpp[-_]python\s*(?:==|-)\s*(\d+(?:\.\d+)+)", re.IGNORECASE)
# where other versions may be written: the series itself (its commits quote upstream), the
# measurements (what they were measured on), the bench JSON and binary files
EXEMPT = re.compile(r"^(patches/|docs/results\.md$|docs/measured/.*\.json$)")
BINARY_SUFFIXES = (".gguf", ".safetensors", ".bin", ".png", ".tar.gz")
# documents that must name the pin only through patches/PIN
BY_REFERENCE = ("README.md", "docs/patches.md")


def _pyproject_requirements() -> list[str]:
    text = (REPO_ROOT / "pyproject.toml").read_text()
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # Python 3.10: the dependency strings, as written
        return re.findall(r"""["']([^"']+)["']""", text.split("dependencies", 1)[1].split("]", 1)[0])
    return list(tomllib.loads(text)["project"]["dependencies"])


def _checkout_files() -> list[str]:
    """The files git tracks, and the new ones it does not ignore (what a commit would hold)."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return sorted({name for name in out.decode().split("\0") if name})


def _text(name: str) -> str | None:
    path = REPO_ROOT / name
    if name.endswith(BINARY_SUFFIXES) or not path.is_file():
        return None
    data = path.read_bytes()
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def test_pin_names_llama_cpp_python() -> None:
    assert PIN.get("package") == "llama-cpp-python"
    assert re.fullmatch(r"\d+(\.\d+)+", PIN.get("version", "")), PIN
    assert re.fullmatch(r"[0-9a-f]{64}", PIN.get("sha256", "")), PIN


def test_pyproject_requires_the_pinned_llama_cpp_python() -> None:
    reqs = [r for r in _pyproject_requirements() if re.match(r"llama[-_]cpp[-_]python\b", r, re.IGNORECASE)]
    assert reqs == [f"llama-cpp-python=={PIN['version']}"], (
        f"pyproject.toml requires {reqs}; patches/PIN pins version={PIN['version']}"
    )


def test_no_file_names_another_llama_cpp_python_version() -> None:
    found = []
    for name in _checkout_files():
        if EXEMPT.match(name):
            continue
        text = _text(name)
        if text is None:
            continue
        for m in VERSION_REF.finditer(text):
            if m.group(1) != PIN["version"]:
                line = text.count("\n", 0, m.start()) + 1
                found.append(f"{name}:{line}: {m.group(0)}")
    assert not found, f"patches/PIN pins {PIN['version']}, but:\n" + "\n".join(found)


def test_the_sdist_hash_is_written_in_patches_pin_only() -> None:
    holders = [name for name in _checkout_files() if name != "patches/PIN" and PIN["sha256"] in (_text(name) or "")]
    assert not holders, f"the sdist's sha256 is repeated in {holders}: read it from patches/PIN"


@pytest.mark.parametrize("name", BY_REFERENCE)
def test_the_docs_name_the_pin_through_patches_pin(name: str) -> None:
    text = (REPO_ROOT / name).read_text()
    for key in ("version", "upstream", "sha256"):
        assert PIN[key] not in text, f"{name} repeats patches/PIN's {key}={PIN[key]}: point at patches/PIN instead"
    assert "patches/PIN" in text, f"{name} should say where the pin is: patches/PIN"
