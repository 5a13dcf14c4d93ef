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


def test_the_wait_fields_are_held_to_c(tmp_path):
    """The fields the route-time wait added, where the ABI put them (new fields go last, so after
    the fields before them), at C's offsets: ``prefetch_wait`` of the params (after ``compensator``),
    ``route_wait_us``, ``route_waits`` and ``wait`` of the stats (after ``route_stale``)."""
    params = [f[0] for f in OnebitMoeParams._fields_]
    stats = [f[0] for f in OnebitMoeStats._fields_]
    assert params[params.index("compensator") + 1] == "prefetch_wait"
    at = stats.index("route_stale")
    assert stats[at : at + 4] == ["route_stale", "route_wait_us", "route_waits", "wait"]
    types = dict(OnebitMoeStats._fields_)
    assert [ctypes.sizeof(types[f]) for f in stats[at + 1 : at + 4]] == [8, 8, 4]
    for cls, name, fields in (
        (OnebitMoeParams, "onebit_moe_params", ["compensator", "prefetch_wait"]),
        (OnebitMoeStats, "onebit_moe_stats", stats[at : at + 4]),
    ):
        _, offsets = c_layout(tmp_path, name, fields)
        assert [getattr(cls, f).offset for f in fields] == offsets


def test_the_keep_fields_are_held_to_c(tmp_path):
    """The fields ONEBIT_MOE_PREFETCH_KEEP added, where the ABI put them: ``prefetch_keep`` and
    ``prefetch_debug_keep_cap`` of the params (after ``prefetch_wait``), ``keep``, ``keep_evicted``
    and ``keep_capacity`` of the stats (after ``wait``: an i32, then a u64 and an i64 on 8 bytes), and
    after them the guesses' room's ``spec_skipped`` and ``spec_unused`` (u64), at C's offsets."""
    params = [f[0] for f in OnebitMoeParams._fields_]
    stats = [f[0] for f in OnebitMoeStats._fields_]
    at_params = params.index("prefetch_wait")
    assert params[at_params : at_params + 3] == ["prefetch_wait", "prefetch_keep", "prefetch_debug_keep_cap"]
    at = stats.index("wait")
    assert stats[at : at + 6] == ["wait", "keep", "keep_evicted", "keep_capacity", "spec_skipped", "spec_unused"]
    types = dict(OnebitMoeStats._fields_)
    assert [ctypes.sizeof(types[f]) for f in stats[at + 1 : at + 6]] == [4, 8, 8, 8, 8]
    assert (types["keep_evicted"], types["keep_capacity"]) == (ctypes.c_uint64, ctypes.c_int64)  # -1: none yet
    for cls, name, fields in (
        (OnebitMoeParams, "onebit_moe_params", params[at_params : at_params + 3]),
        (OnebitMoeStats, "onebit_moe_stats", stats[at : at + 6]),
    ):
        _, offsets = c_layout(tmp_path, name, fields)
        assert [getattr(cls, f).offset for f in fields] == offsets


def test_the_order_fields_are_held_to_c(tmp_path):
    """The fields ONEBIT_MOE_PREFETCH_ORDER added, last again: ``prefetch_order`` of the params
    (after ``prefetch_debug_keep_cap``), ``order``, ``order_marked`` and ``order_reordered`` of the
    stats (after ``spec_unused``: an i32, then two u64 on 8 bytes), at C's offsets."""
    params = [f[0] for f in OnebitMoeParams._fields_]
    stats = [f[0] for f in OnebitMoeStats._fields_]
    at_params = params.index("prefetch_debug_keep_cap")
    assert params[at_params : at_params + 2] == ["prefetch_debug_keep_cap", "prefetch_order"]
    at = stats.index("spec_unused")
    assert stats[at : at + 4] == ["spec_unused", "order", "order_marked", "order_reordered"]
    types = dict(OnebitMoeStats._fields_)
    assert [types[f] for f in stats[at + 1 : at + 4]] == [ctypes.c_int32, ctypes.c_uint64, ctypes.c_uint64]
    for cls, name, fields in (
        (OnebitMoeParams, "onebit_moe_params", params[at_params : at_params + 2]),
        (OnebitMoeStats, "onebit_moe_stats", stats[at : at + 4]),
    ):
        size, offsets = c_layout(tmp_path, name, fields)
        assert ctypes.sizeof(cls) == size
        assert [getattr(cls, f).offset for f in fields] == offsets


def test_the_layers_fields_are_held_to_c(tmp_path):
    """The fields ONEBIT_MOE_PREFETCH_LAYERS added, last: ``prefetch_layers`` and
    ``prefetch_debug_handback`` of the params (after ``prefetch_order``), ``layers``, ``layers_ops``,
    ``layers_bytes`` and ``layers_cut`` of the stats (after ``order_reordered``: an i32, then three u64
    on 8 bytes), then keep=anon's ``order_waiting``, ``keep_streamed`` and ``keep_given_back`` (u64), at C's
    offsets, the structures ending there."""
    params = [f[0] for f in OnebitMoeParams._fields_]
    stats = [f[0] for f in OnebitMoeStats._fields_]
    at_params = params.index("prefetch_order")
    assert params[at_params:] == ["prefetch_order", "prefetch_layers", "prefetch_debug_handback"]
    at = stats.index("order_reordered")
    assert stats[at:] == [
        "order_reordered",
        "layers",
        "layers_ops",
        "layers_bytes",
        "layers_cut",
        "order_waiting",
        "keep_streamed",
        "keep_given_back",
    ]
    types = dict(OnebitMoeStats._fields_)
    assert [types[f] for f in stats[at + 1 :]] == [ctypes.c_int32, *[ctypes.c_uint64] * 6]
    for cls, name, fields in (
        (OnebitMoeParams, "onebit_moe_params", params[at_params:]),
        (OnebitMoeStats, "onebit_moe_stats", stats[at:]),
    ):
        size, offsets = c_layout(tmp_path, name, fields)
        assert ctypes.sizeof(cls) == size
        assert [getattr(cls, f).offset for f in fields] == offsets
