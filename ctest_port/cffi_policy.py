"""Build the C++ environment policy (src/onebit-moe-policy.cpp) into a cffi module.

The parity tests call the C functions through it. The module is compiled once per
source (the header, the .cpp, the declarations below, cffi and the Python ABI) into
``<cache>/cffi/<hash>/``, where the cache root is ``$ONEBIT_CACHE`` or
``~/.cache/onebit-predict``; later runs load it from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import cffi

from onebit_predict.paths import NotBuiltError

ENV_CACHE = "ONEBIT_CACHE"
MODULE = "_onebit_policy_cffi"
HEADER = "onebit-moe-policy.h"
SOURCE = "onebit-moe-policy.cpp"
PRELUDE = f'#include "{HEADER}"\n'
COMPILE_ARGS = ["-std=c++17"]
CDEF = """
#define ONEBIT_MAX_LAYERS ...

struct onebit_env {
    const char * mode;
    const char * depth;
    const char * margin;
    const char * min;
    const char * layers;
    const char * no_attn;
    const char * stats;
};

struct onebit_policy {
    int32_t mode;
    int32_t depth_requested;
    int32_t depth;
    float   margin;
    int32_t min_requested;
    int32_t min_read;
    int32_t no_attn;
    int32_t stats;
    int32_t n_layer_predicted;
    uint8_t layer_mask[...];
};

int32_t onebit_policy_parse(const struct onebit_env * env, int32_t n_layer, int32_t n_expert, int32_t n_expert_used,
                            struct onebit_policy * out, char * warn, size_t warn_cap);
int32_t onebit_effective_depth(int32_t depth_requested, int32_t n_expert, int32_t n_expert_used);
int32_t onebit_effective_min(int32_t min_requested, int32_t depth, int32_t n_expert_used);
int32_t onebit_n_read(const float * logits, int32_t depth, float margin, int32_t min_read);
int32_t onebit_parse_layers(const char * spec, int32_t n_layer, uint8_t * mask, char * warn, size_t warn_cap);
"""


def cache_root() -> Path:
    return Path(os.environ.get(ENV_CACHE) or Path.home() / ".cache" / "onebit-predict")


def load_c_policy(src_dir: Path) -> tuple[Any, Any]:
    """``(ffi, lib)`` of the policy in ``src_dir`` (a patched tree's ``src/``), built once per source."""
    header, source = src_dir / HEADER, src_dir / SOURCE
    if not (header.is_file() and source.is_file()):
        raise NotBuiltError(f"{source} does not exist: {src_dir.parent} is not a patched llama.cpp tree")

    ext_suffix = sysconfig.get_config_var("EXT_SUFFIX")
    key = hashlib.sha256()
    for part in (CDEF, PRELUDE, " ".join(COMPILE_ARGS), cffi.__version__, ext_suffix):
        key.update(part.encode() + b"\0")
    key.update(header.read_bytes() + b"\0" + source.read_bytes())
    module_dir = cache_root() / "cffi" / key.hexdigest()[:16]
    module_path = module_dir / (MODULE + ext_suffix)

    if not module_path.is_file():
        ffi = cffi.FFI()
        ffi.cdef(CDEF)
        ffi.set_source(
            MODULE, PRELUDE, sources=[str(source)], source_extension=".cpp",
            include_dirs=[str(src_dir)], extra_compile_args=COMPILE_ARGS,
        )
        module_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=module_dir) as tmp:
            os.replace(ffi.compile(tmpdir=tmp), module_path)  # atomic: a concurrent run sees all or nothing

    spec = importlib.util.spec_from_file_location(MODULE, module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ffi, module.lib
