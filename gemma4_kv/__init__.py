"""gemma4-kv: vLLM KV cache offload for hybrid-attention models (Gemma 4) through LMCache."""

__version__ = "0.1.0"

FORMAT_VERSION = 3
"""Version of the stored chunk format (KV_2LTD objects per group, their trailer's
checksum); part of every key. 3: the checksum weights are distinct per position."""
