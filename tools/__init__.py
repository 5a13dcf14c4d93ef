"""Scripts run from the checkout's root (``python3 tools/NAME.py``), not part of the installed package.

Each is a command of its own: a harness, a trainer or build tooling. Logic that a test or a
command of the package needs lives in ``onebit_predict`` and is imported from there; this file
only lets the tests import ``tools.series`` (build.sh's reader and lint of patches/, standard
library only) by its name.

- ``ahead_table.py``: the hit rates of predicting K layers ahead, as docs/results.md's table;
- ``bench_stats.py``: onebit-stats against a plain numpy pass on ``onebit_predict.synth``'s trace;
- ``prefetch_op_cost.py``: what the prefetch consumer's op costs on the compute path;
- ``published_figures.py``, ``saving_figures.py``: the figures of docs/results.md;
- ``series.py``: patches/PIN and patches/series, read and linted for build.sh;
- ``train_learned.py``: the learned predictor's sidecars (models/*.learned-k*.gguf);
- ``train_tiny.py``: the trained tiny models in models/ (the ``train`` extra).
"""
