"""A stand-in for torchvision on machines without it (vLLM's CPU build here), for the
multimodal end-to-end test on CPU (tests/test_e2e_mm.py) only: it is on the path of
that test's processes alone (`tests/e2e_mm.py` `STANDIN`).

transformers imports torchvision at the top of Gemma 4's image processor module (which
its processor module imports) and needs it for any video processor class, which
Gemma 4's processor requires even for images. Those imports succeed here; every function
raises, so nothing is computed through this package: the test selects transformers' PIL
image processor (`pil_backend.py`) and sends no video."""

from __future__ import annotations

import enum
import sys
import types

__version__ = "0.0.0+standin"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    RGB = 3


def _absent(module: str):
    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)

        def absent(*args, **kwargs):
            raise NotImplementedError(f"{module}.{name}: torchvision is a stand-in here "
                                      "(tests/torchvision_standin)")
        return absent
    return __getattr__


def _module(name: str, **attrs) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__dict__.update(attrs, __getattr__=_absent(name))
    sys.modules[name] = m
    return m


transforms = _module("torchvision.transforms", InterpolationMode=InterpolationMode)
transforms.functional = _module("torchvision.transforms.functional",
                                InterpolationMode=InterpolationMode)
transforms.v2 = _module("torchvision.transforms.v2")
transforms.v2.functional = _module("torchvision.transforms.v2.functional",
                                   InterpolationMode=InterpolationMode)
io = _module("torchvision.io", ImageReadMode=ImageReadMode)
