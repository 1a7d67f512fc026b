"""Layout and planning: what vLLM's KV cache groups are, and which blocks a chunk or a hit
covers."""
