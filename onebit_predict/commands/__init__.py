"""The console scripts, one module per command: argument parsing and printing only.

Every command goes through :func:`onebit_predict.commands.common.run_command`, which maps
exceptions to exit codes (0 ok, 1 check failed, 2 usage or input error) and logs to stderr.
No module outside this package imports argparse.

- ``common``: what every command shares: parent parsers, argument types, the table, the exit codes;
- ``stats``: ``onebit-stats``: the hit rates of traces (rates), and the door to replay, simulate and the plots;
- ``replay``: ``onebit-stats replay``: an expert cache replayed on a trace;
- ``simulate``: ``onebit-stats simulate``: the decode-time model of a streamed expert pipeline;
- ``simulate_out``: how simulate prints the expert model: the tables, ``--json``, ``--csv``;
- ``simulate_pages``: simulate's page-granular options (``--granularity page``, ``--memory-limit``, ``--measured``);
- ``plot_memory``: ``onebit-stats plot-memory``: onebit-bench ``--memory-limit`` reports side by side;
- ``plot_drives``: ``onebit-stats plot-drives``: the ``--memory-limit --drive`` matrix, per drive, cell by cell;
- ``trace``: ``onebit-trace``: record a P/A trace;
- ``bitident``: ``onebit-bitident``: off against each predictor, byte for byte;
- ``bench``: ``onebit-bench``: what the predictor costs (warm, ``--cold``, ``--memory-limit``);
- ``bench_worker``: the worker process of onebit-bench, one configuration's run (not for people);
- ``tiny``: ``onebit-tiny``: a tiny random MoE model for checks;
- ``grow``: ``onebit-grow``: grown models, widened, quantized, verified;
- ``learned``: ``onebit-learned``: which model a learned-predictor sidecar names;
- ``int2``: ``onebit-int2``: 2-bit expert variants of a model and their quality against F16;
- ``int2_out``: how onebit-int2 prints its reports: labels, rows, the text tables;
- ``compensator``: ``onebit-compensator``: fit and show the 2-bit experts' compensator sidecar;
- ``vocab``: ``python -m onebit_predict.commands.vocab``: give a byte-level GGUF its vocabulary.
"""
