"""The hit-rate metrics of onebit-stats (stats) and their compiled C kernel (stats_kernel, cffi_build)."""
