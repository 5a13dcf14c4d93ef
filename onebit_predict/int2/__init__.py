"""2-bit routed experts: what llama.cpp's own low-bit types do to a trained MoE, and a compensator (issue 24).

- variants.py: the variants of a model (``f16``, ``q8_0``, ``q4_k_m``, ``q2_k``, ``iq2_xxs``,
  ``iq2_xs``, ``iq2_s``, ``tq2_0``) made with ``llama-quantize`` on the routed expert tensors
  only, every other tensor byte-identical to the source, and the importance matrix; all
  cached under ``$ONEBIT_CACHE/int2``;
- texts.py: the texts (training text for the imatrix, the held-out texts for the figures:
  the corpus's validation split, and llama-cpp-python's own sources from outside it);
- quality.py: each variant against the F16 model on held-out text with ``llama-perplexity``
  (mean and 99th-percentile KL divergence, top-1 agreement, PPL), optionally with a
  compensator (``ONEBIT_MOE_COMPENSATOR``);
- agreement.py: the routing of each variant against F16's, layer by layer, and the first
  token where greedy generation departs from F16's;
- compensator.py: the compensator's GGUF sidecar, the model it names, and its least-squares fit;
- capture.py: per-layer activations captured from llama.cpp runs, the fit's data;
- moe_numpy.py: a MoE block in numpy from a GGUF's tensors, the reference the fit aims at;
- blame.py: where a row's KL against F16 lives, layer by layer (F16's MoE output put in one layer);
- per_expert.py: a low-rank map per routed expert, fitted and scored in numpy through the graph;
- kl_fit.py: a sidecar refitted to the KL against F16 through a torch forward pass (the ``fit`` extra);
- plot.py: mean KL divergence over expert bytes per token, from a quality report.

``onebit-int2`` (commands/int2.py) makes, measures and plots the variants; ``onebit-compensator``
(commands/compensator.py) fits and shows compensators.
"""
