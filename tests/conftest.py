"""Shared pytest fixtures, one section per topic; add yours in a section of its own."""

from __future__ import annotations

import os

import pytest

from ctest_port.cffi_policy import load_c_policy
from onebit_predict.paths import NotBuiltError, llama_tree


# --- the C++ environment policy through cffi (tests/test_policy_parity.py) ----------------

@pytest.fixture(scope="session")
def c_policy():
    """``(ffi, lib)`` of src/onebit-moe-policy.cpp in the patched tree (ONEBIT_LLAMA_TREE, or the
    tree build.sh recorded). Without a tree the tests fail, or skip when ONEBIT_ALLOW_SKIP=1."""
    try:
        return load_c_policy(llama_tree() / "src")
    except NotBuiltError as e:
        if os.environ.get("ONEBIT_ALLOW_SKIP") == "1":
            pytest.skip(f"no patched llama.cpp tree (ONEBIT_ALLOW_SKIP=1): {e}")
        pytest.fail(str(e), pytrace=False)

# --- end of the C++ policy section ---------------------------------------------------------


# --- tiny random models written by the patched build (bit-identity, traces, commands) ----

@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(arch)``: the path of a tiny random GGUF of that architecture (made once)."""
    from onebit_predict.tiny import write_tiny_model

    made: dict[str, object] = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(arch: str):
        if arch not in made:
            try:
                made[arch] = write_tiny_model(arch, root / f"{arch}.gguf")
            except NotBuiltError as e:
                pytest.fail(str(e), pytrace=False)
        return made[arch]

    return get

# --- end of the tiny models section ---------------------------------------------------------
