"""onebit-predict: next-layer MoE expert prediction for llama.cpp, measured and checked.

The C++ side lives in the patch series under ``patches/``; this package is the sidecar that
reads its traces, holds its environment policy to parity, and runs its checks. Build tooling
is not part of it: build.sh reads and lints ``patches/`` with ``tools/series.py``.

The rooms, each a subpackage whose docstring lists its modules:

- ``commands``: the console scripts (argument parsing and printing; the only argparse users);
- ``checks``: the checks of the patched build: bit-identity and the cost benchmarks;
- ``llama``: running the patched llama.cpp: the build's paths, models, contexts, traces;
- ``costmodel``: the expert-cache model: replay, the decode-time model, its plots;
- ``metrics``: the hit rates of onebit-stats and their compiled kernel;
- ``drive``: the emulated drive (a FUSE device model in C) and its fio check;
- ``grow``: grown models (experts widened to a real size), the vocabulary of the byte-level models.

The modules the rooms share:

- ``atomic``: write a file whole or not at all (temporary name, fsync, size check, rename);
- ``constants``: environment names, trace layout, exit codes: every number the C++ side shares;
- ``gguf_experts``: the one reader of where a GGUF's routed experts lie and what one weighs;
- ``learned``: the learned lookahead predictor: its GGUF sidecar, its loss, its scores;
- ``moe_check``: the check every command that takes a model runs first (a MoE GGUF llama.cpp loads);
- ``policy``: the ONEBIT_MOE_PREDICT / _PREFETCH environment policy, the C++ one's exact twin;
- ``synth``: a synthetic llama-server-like trace of any size, for benchmarks and tests;
- ``trace``: read a P/A trace: a validated header and memory-mapped records;
- ``trace_writer``: write a P/A trace from Python, in the reader's own layout;
- ``trace_written``: the verdict on a trace just written (whole, or why not);
- ``units``: byte sizes and bandwidths as people write them (``6.75MiB``, ``3GB/s``).
"""

__version__ = "0.1.0"
