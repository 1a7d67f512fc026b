"""Test set-up: Triton kernels run under the interpreter on machines without a GPU."""

import os

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _HAS_CUDA = False

if not _HAS_CUDA:
    # Must be set before any @triton.jit function is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PYTHONHASHSEED", "0")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords and not _HAS_CUDA:
            item.add_marker(skip)
