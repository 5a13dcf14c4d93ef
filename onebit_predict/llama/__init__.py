"""Running the patched llama.cpp: where the build is, models and contexts, and what a run measures.

- ``paths``: where the patched build lives, as build.sh recorded it (``build/current.env``);
- ``runner``: models, contexts and batches through llama-cpp-python's low-level API;
- ``moe_api``: the predictor's C API (include/onebit-moe.h), bound with ctypes;
- ``record``: record a P/A trace: a prefill and greedy decodes with the predictor on (onebit-trace);
- ``tiny``: tiny random MoE models for checks, written by the build's ``onebit-tiny-gguf``;
- ``evict``: keep a model's expert pages on the drive, evicted between tokens (``--cold``);
- ``drive``: the drive's sequential bandwidth and the latency of one page read;
- ``cgroup``: a memory cgroup for one benchmark process (``--memory-limit``).
"""
