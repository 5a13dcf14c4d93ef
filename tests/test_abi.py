"""The ctypes structures the sidecar passes to libllama match the C layout of the patched tree:
``struct llama_context_params`` (llama-cpp-python's, passed by value to onebit_init_from_model)
and ``struct onebit_moe_params`` and ``struct onebit_moe_stats`` (ours), size and every field's
offset, read from a C program compiled against the tree's headers."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from onebit_predict.llama.moe_api import OnebitMoeParams
from onebit_predict.llama.moe_stats import OnebitMoeStats
from onebit_predict.llama.paths import llama_tree
from onebit_predict.llama.runner import llama

pytestmark = pytest.mark.needs_build


def c_layout(tmp_path, struct: str, fields: list[str]) -> tuple[int, list[int]]:
    """(sizeof, [offsetof(field) ...]) of ``struct`` as the C compiler lays it out."""
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler is needed (build.sh needs one too)"
    tree = llama_tree()
    offsets = "".join(f'    printf(" %zu", offsetof(struct {struct}, {f}));\n' for f in fields)
    src = tmp_path / "layout.c"
    src.write_text(
        '#include <stddef.h>\n#include <stdio.h>\n#include "onebit-moe.h"\n'
        f'int main(void) {{\n    printf("%zu", sizeof(struct {struct}));\n{offsets}    return 0;\n}}\n'
    )
    exe = tmp_path / "layout"
    subprocess.run(
        [cc, "-o", str(exe), str(src), f"-I{tree / 'include'}", f"-I{tree / 'ggml' / 'include'}"], check=True
    )
    size, *offs = (
        int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()
    )
    return size, offs


@pytest.mark.parametrize("name", ["onebit_moe_params", "onebit_moe_stats", "llama_context_params"])
def test_ctypes_structures_match_the_c_layout(name, tmp_path):
    ours = {"onebit_moe_params": OnebitMoeParams, "onebit_moe_stats": OnebitMoeStats}
    cls = ours[name] if name in ours else llama().llama_context_params
    fields = [f[0] for f in cls._fields_]
    size, offsets = c_layout(tmp_path, name, fields)
    assert ctypes.sizeof(cls) == size
    assert [getattr(cls, f).offset for f in fields] == offsets
