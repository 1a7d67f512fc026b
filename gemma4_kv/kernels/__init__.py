"""Triton kernels of gemma4-kv (installed as `gemma4_kv.kernels`)."""

from .launch import BlockCopy, copy_blocks

__all__ = ["BlockCopy", "copy_blocks"]
