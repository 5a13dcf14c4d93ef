"""Running the patched llama.cpp: where the build is (paths), models and contexts (runner),
tiny models for checks (tiny), and the page eviction and drive measurement of ``--cold``."""
