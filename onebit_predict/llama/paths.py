"""Where the patched llama.cpp build lives, as build.sh recorded it.

build.sh writes ``build/current.env`` in the checkout (KEY=VALUE lines: ``LLAMA_TREE``,
``LLAMA_BUILD_DIR``, ``LLAMA_LIB_DIR``; ``PRISTINE_LIB_DIR`` after ``./build.sh pristine``,
the unpatched pin's libllama for onebit-bench's side-by-side row). Environment variables of
the same names win, and ``LLAMA_CPP_LIB_PATH`` (llama-cpp-python's own variable) overrides the
library dir. ``ONEBIT_LLAMA_TREE`` names a patched source tree for the checks that need no build.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import NamedTuple

REPO_ROOT = Path(__file__).resolve().parents[2]  # onebit_predict/llama/paths.py -> the checkout
CURRENT_ENV = REPO_ROOT / "build" / "current.env"


class NotBuiltError(RuntimeError):
    """The patched llama.cpp build cannot be found: run ./build.sh first."""


class BuildInfo(NamedTuple):
    tree: Path  # the patched llama.cpp source tree (a git work tree)
    build_dir: Path  # its CMake build directory
    lib_dir: Path  # the directory holding libllama.so


def _read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    if not path.is_file():
        return values
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        values[key.strip()] = value.strip()
    return values


def build_info() -> BuildInfo:
    """Locate the patched tree, its build dir and libllama; raise NotBuiltError if absent."""
    values = _read_env_file(CURRENT_ENV)
    for key in ("LLAMA_TREE", "LLAMA_BUILD_DIR", "LLAMA_LIB_DIR"):
        if os.environ.get(key):
            values[key] = os.environ[key]
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        values["LLAMA_LIB_DIR"] = os.environ["LLAMA_CPP_LIB_PATH"]
    missing = [k for k in ("LLAMA_TREE", "LLAMA_BUILD_DIR", "LLAMA_LIB_DIR") if not values.get(k)]
    if missing:
        raise NotBuiltError(
            f"no patched llama.cpp build recorded ({CURRENT_ENV} lacks {', '.join(missing)}); run ./build.sh"
        )
    info = BuildInfo(Path(values["LLAMA_TREE"]), Path(values["LLAMA_BUILD_DIR"]), Path(values["LLAMA_LIB_DIR"]))
    if not (info.lib_dir / "libllama.so").is_file():
        raise NotBuiltError(f"{info.lib_dir / 'libllama.so'} does not exist; run ./build.sh")
    return info


def llama_tree() -> Path:
    """The patched llama.cpp source tree: ``ONEBIT_LLAMA_TREE`` if set, else build_info().tree."""
    if os.environ.get("ONEBIT_LLAMA_TREE"):
        return Path(os.environ["ONEBIT_LLAMA_TREE"])
    return build_info().tree


def pristine_lib_dir() -> Path | None:
    """The unpatched pin's libllama dir (``./build.sh pristine``), or None if it was not built
    (or its libllama.so is gone)."""
    value = _read_env_file(CURRENT_ENV).get("PRISTINE_LIB_DIR")
    if not value or not (Path(value) / "libllama.so").is_file():
        return None
    return Path(value)


def use_patched_libllama() -> BuildInfo:
    """Point llama-cpp-python at the patched libllama (call before importing llama_cpp)."""
    info = build_info()
    if not os.environ.get("LLAMA_CPP_LIB_PATH"):  # unset or empty: an empty value would make llama_cpp look in "."
        os.environ["LLAMA_CPP_LIB_PATH"] = str(info.lib_dir)
    return info


def use_pristine_libllama() -> Path:
    """Point llama-cpp-python at the unpatched pin's libllama (call before importing llama_cpp);
    its directory. ``LLAMA_CPP_LIB_PATH`` wins (onebit-bench's worker is started with it); else
    the one ``./build.sh pristine`` recorded; NotBuiltError if there is neither."""
    if os.environ.get("LLAMA_CPP_LIB_PATH"):
        return Path(os.environ["LLAMA_CPP_LIB_PATH"])
    lib_dir = pristine_lib_dir()
    if lib_dir is None:
        raise NotBuiltError(f"no unpatched llama.cpp build recorded in {CURRENT_ENV}; run ./build.sh pristine")
    os.environ["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    return lib_dir
