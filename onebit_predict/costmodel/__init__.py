"""The cost models: what prediction would save an engine that streams its experts from the drive.

The expert model (docs/cost-model.md, "The cache" and "The timing"):

- ``routing``: a trace's decode routing as per-layer arrays: what replay and simulate consume;
- ``replay``: a layer's routing through an expert cache of N slots: LRU, LFRU or Belady;
- ``simulate``: the decode-time model of a streamed expert pipeline, played on the routing;
- ``expert_bytes``: the bytes one expert occupies in each layer of a GGUF;
- ``plot``: the PNGs of simulate, plot-memory and plot-drives (the optional ``plot`` extra).

The page model (docs/cost-model.md, "Pages: the page-granular model"):

- ``layout``: where the experts are in the file, in pages;
- ``kernel``: the kernel's side of a mapped file: page cache, drive, readahead;
- ``pages``: the page-granular decode-time model: demand faults and prefetch requests as events;
- ``page_settings``: its constants, each with where it came from: measured, given or assumed;
- ``page_check``: its play of a trace's configurations against the benchmarks, and the check;
- ``measured``: what ``onebit-bench --json`` measured, read for the model to be checked against;
- ``row_config``: one benchmark row's configuration, typed: predictor, consumer and their knobs;
- ``drive_cells``: the drive matrix's cells (drive x expert size x limit): ratios, the floor, the physical limit.
"""
