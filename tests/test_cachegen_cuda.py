"""`l2_codec: cachegen` on a GPU (`l2_codec_device: auto`): the frames written there are
the CPU's, byte for byte, and a frame decodes to the same bytes on either device, for
every bit budget, both KV dtypes and shapes with partial groups and scale blocks. The
CPU coder is checked against a numpy oracle of the format (tests/test_cachegen.py), so
equality here carries that check to the GPU. Skipped without one."""

from __future__ import annotations

import pytest
import torch

from gemma4_kv.stores import cachegen
from test_cachegen import sealed

pytestmark = pytest.mark.cuda

SHAPES = [(2, 3, 256, 96), (2, 5, 250, 512), (2, 2, 17, 2048)]


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_frames_and_loads_are_the_cpus(shape, dtype, bits):
    gpu = torch.device("cuda")
    _, raw = sealed(shape, dtype, seed=bits)
    size = cachegen.frame_size(shape, bits)
    on_cpu, on_gpu = bytearray(size), bytearray(size)
    cachegen.encode_into(raw, on_cpu, shape, dtype, bits)
    cachegen.encode_into(raw, on_gpu, shape, dtype, bits, gpu)
    assert on_gpu == on_cpu
    back_cpu, back_gpu = bytearray(len(raw)), bytearray(len(raw))
    cachegen.decode_into(bytes(on_cpu), back_cpu)
    cachegen.decode_into(bytes(on_cpu), back_gpu, gpu)
    assert back_gpu == back_cpu


def test_device_for():
    assert cachegen.device_for("auto").type == "cuda"
    assert cachegen.device_for("cpu").type == "cpu"
