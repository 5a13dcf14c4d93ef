"""Models for the checks: grown models and the byte-level models' vocabulary (the package is named
for its main job; the trained models themselves live in the checkout's models/).

Grown models are trained tiny MoE models whose experts are widened with zeros to a real size
(docs/grown-models.md):

- ``grow``: write the grown GGUF (and size it);
- ``quantize``: run the patched ``llama-quantize`` on it and read what it decided;
- ``store``: the cache of grown models, each output with its manifest;
- ``verify``: the proof that a grown model routes and predicts as its original.

And for any model:

- ``vocab``: give a byte-level model the RWKV vocabulary that maps text to its bytes
  (the bundled models carry it: models/README.md);
- ``gguf_keys``: copy a GGUF key from a reader to a writer, read an architecture key, check a
  written GGUF is whole.
"""
