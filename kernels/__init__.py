"""Triton kernels of gemma4-kv (installed as `gemma4_kv.kernels`)."""

from .launch import copy_blocks

__all__ = ["copy_blocks"]
