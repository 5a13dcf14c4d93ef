"""Grown models: trained tiny MoE models whose experts are widened with zeros to a real size.

``grow`` writes the grown GGUF (and sizes it), ``quantize`` runs the patched
``llama-quantize`` on it, ``store`` caches the outputs with their manifests, and ``verify``
proves that a grown model routes and predicts as its original (docs/grown-models.md).
``vocab`` gives a byte-level model the RWKV vocabulary that maps text to its bytes (the bundled
models carry it: models/README.md).
"""
