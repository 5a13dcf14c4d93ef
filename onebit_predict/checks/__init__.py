"""The checks of the patched build: bit-identity (bitident) and the cost benchmarks (bench, bench_cold)."""
