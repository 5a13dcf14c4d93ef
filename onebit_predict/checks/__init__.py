"""The checks of the patched build: bit-identity and what the predictor costs.

- ``bitident``: off against each predictor and consumer mode, every logits row compared as bytes;
- ``bench``: decode tok/s and compute buffer of every configuration side by side (onebit-bench);
- ``bench_cold``: the same with the expert pages evicted before every token (``--cold``);
- ``bench_memory``: each run confined to a memory cgroup below the expert bytes (``--memory-limit``);
- ``rounds``: what the benchmarks share: a configuration, its worker process, the alternating rounds;
- ``worker``: one timed run of a configuration, inside the worker process
  (started as ``python -m onebit_predict.commands.bench_worker``).
"""
