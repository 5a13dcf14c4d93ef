"""The expert-cache model: a trace's routing (routing), replayed through a cache (replay),
timed on a drive (simulate), drawn (plot); the bytes of one expert from a GGUF (expert_bytes)."""
