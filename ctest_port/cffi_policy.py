"""Build the C++ environment policy (src/onebit-moe-policy.cpp) into a cffi module.

The parity tests call the C functions through it. The module is compiled once per
source (the header, the .cpp, the declarations below, cffi and the Python ABI) into
``<cache>/cffi/<hash>/``, where the cache root is ``$ONEBIT_CACHE`` or
``~/.cache/onebit-predict``; later runs load it from there (``onebit_predict.metrics.cffi_build``,
shared with the package's own C kernels).

The declarations are the pinned series' whole policy: the predictor's, the prefetch
consumer's (``onebit_prefetch_parse``, ``onebit_prefetch_mode_name``) and the C API's
precedence (``onebit_resolve_knob``). One pin means one tree: a header that lacks any of them
is not a tree of this series, and the build fails (cffi cannot compile a declaration the source
does not have) instead of a test quietly skipping half the parity.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from onebit_predict.llama.paths import NotBuiltError
from onebit_predict.metrics.cffi_build import cache_root, load_cffi_module  # noqa: F401 (cache_root: re-exported)

MODULE = "_onebit_policy_cffi"
HEADER = "onebit-moe-policy.h"
SOURCE = "onebit-moe-policy.cpp"
PRELUDE = f'#include "{HEADER}"\n'
COMPILE_ARGS = ["-std=c++17"]
KNOB_CDEF = """
const char * onebit_resolve_knob(const char * api_value, const char * env_value);
"""
CDEF = """
#define ONEBIT_MAX_LAYERS ...

enum onebit_mode {
    ONEBIT_MODE_OFF    = 0,
    ONEBIT_MODE_ROUTER = 1,
    ONEBIT_MODE_BLOCK  = 2,
    ONEBIT_MODE_LEARNED = 3,
};

struct onebit_env {
    const char * mode;
    const char * depth;
    const char * margin;
    const char * min;
    const char * layers;
    const char * no_attn;
    const char * stats;
    const char * ahead;
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
    int32_t ahead;
};

int32_t onebit_policy_parse(const struct onebit_env * env, int32_t n_layer, int32_t n_expert, int32_t n_expert_used,
                            struct onebit_policy * out, char * warn, size_t warn_cap);
int32_t onebit_effective_depth(int32_t depth_requested, int32_t n_expert, int32_t n_expert_used);
int32_t onebit_effective_min(int32_t min_requested, int32_t depth, int32_t n_expert_used);
int32_t onebit_n_read(const float * logits, int32_t depth, float margin, int32_t min_read);
int32_t onebit_parse_layers(const char * spec, int32_t n_layer, uint8_t * mask, char * warn, size_t warn_cap);
"""
PREFETCH_CDEF = """
enum onebit_prefetch_mode {
    ONEBIT_PREFETCH_OFF    = 0,
    ONEBIT_PREFETCH_ADVISE = 1,
    ONEBIT_PREFETCH_READ   = 2,
    ONEBIT_PREFETCH_POPULATE = 3,
    ONEBIT_PREFETCH_PREAD    = 4,
};

enum onebit_keep {
    ONEBIT_KEEP_KERNEL = 0,
    ONEBIT_KEEP_LRU    = 1,
    ONEBIT_KEEP_ANON   = 2,
};

enum onebit_order {
    ONEBIT_ORDER_INDEX = 0,
    ONEBIT_ORDER_HITS  = 1,
};

#define ONEBIT_PREFETCH_ROUTE_CALL ...
#define ONEBIT_PREFETCH_THREADS_DEFAULT ...
#define ONEBIT_PREFETCH_THREADS_MAX ...
#define ONEBIT_PREFETCH_MAX_BYTES_LIMIT ...
#define ONEBIT_PREFETCH_GUARD_DEFAULT ...
#define ONEBIT_PREFETCH_GUARD_MAX ...
#define ONEBIT_PREFETCH_LAYERS_MAX ...

struct onebit_prefetch_env {
    const char * mode;
    const char * max_bytes;
    const char * threads;
    const char * guard;
    const char * room;
    const char * route;
    const char * random;
    const char * wait;
    const char * keep;
    const char * order;
    const char * layers;
};

struct onebit_prefetch_policy {
    int32_t mode;
    int32_t n_threads;
    int64_t max_bytes;
    int32_t guard;
    float   room;
    int32_t speculative;
    int32_t route;
    int32_t random;
    int32_t wait;
    int32_t keep;
    int32_t order;
    int32_t layers;
};

const char * onebit_prefetch_mode_name(int32_t mode);
int32_t onebit_prefetch_parse(const struct onebit_prefetch_env * env, int32_t predict_mode,
                              struct onebit_prefetch_policy * out, char * warn, size_t warn_cap);
"""


def load_c_policy(src_dir: Path) -> tuple[Any, Any]:
    """``(ffi, lib)`` of the policy in ``src_dir`` (a patched tree's ``src/``), built once per source."""
    header, source = src_dir / HEADER, src_dir / SOURCE
    if not (header.is_file() and source.is_file()):
        raise NotBuiltError(f"{source} does not exist: {src_dir.parent} is not a patched llama.cpp tree")

    return load_cffi_module(
        MODULE,
        CDEF + PREFETCH_CDEF + KNOB_CDEF,
        PRELUDE,
        sources=[source],
        depends=[header, source],
        include_dirs=[src_dir],
        compile_args=COMPILE_ARGS,
        source_extension=".cpp",
    )
