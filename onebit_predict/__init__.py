"""onebit-predict: next-layer MoE expert prediction for llama.cpp, measured and checked.

The C++ side lives in the patch series under ``patches/``; this package is the sidecar
that reads its traces, holds its environment policy to parity, and runs its checks.
"""

__version__ = "0.1.0"
