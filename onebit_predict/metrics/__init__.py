"""The hit-rate metrics of onebit-stats and their compiled kernel.

- ``stats``: per-layer hit rates of a P/A trace and its consistency control (two engines);
- ``stats_kernel``: the C engine, ``stats_kernel.c`` through cffi, one call per chunk;
- ``cffi_build``: build a cffi extension once per source into the cache and load it from there.
"""
