"""The staging ring hands out regions in order and takes them back once their copies'
events fire; it never hands out memory still in use. (CUDA events on a GPU; on the CPU
an event is anything with query(), here a flag the test sets.)"""

from __future__ import annotations

import pytest
import torch

from gemma4_kv.transfer.staging import StagingPool


class Flag:
    def __init__(self):
        self.fired = False

    def query(self):
        return self.fired


def overlaps(a, b):
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() and b0 < a0 + a.numel()


def test_regions_come_back_in_order_and_never_overlap_live_ones():
    pool = StagingPool(4096, torch.device("cpu"))
    a, b, c = pool.take(1500), pool.take(1500), pool.take(1000)
    assert a is not None and b is not None and c is not None
    assert pool.take(512) is None  # full
    ea, eb, ec = Flag(), Flag(), Flag()
    for r, e in ((a, ea), (b, eb), (c, ec)):
        pool.release_after(r, e)
    eb.fired = True
    assert pool.take(512) is None  # a (the oldest) is still being copied
    ea.fired = True
    d = pool.take(1200)  # wraps into a's and b's old place
    assert d is not None and not overlaps(d, c)
    e = pool.take(2000)
    assert e is None  # only b's tail is free before c
    ec.fired = True
    pool.release_after(d, Flag())
    assert pool.take(4096) is None and pool.take(1500) is not None


def test_a_region_given_back_twice_or_foreign_is_an_error():
    pool = StagingPool(1024, torch.device("cpu"))
    r = pool.take(100)
    pool.release_after(r, Flag())
    with pytest.raises(ValueError):
        pool.release_after(r, Flag())
    with pytest.raises(ValueError):
        pool.release_after(torch.empty(8, dtype=torch.uint8), Flag())


@pytest.mark.cuda
def test_with_cuda_events_a_region_comes_back_once_its_copy_has_run():
    pool = StagingPool(64 << 20, torch.device("cuda"))
    side = torch.cuda.Stream()
    host = torch.empty(48 << 20, dtype=torch.uint8, pin_memory=True)
    region = pool.take(48 << 20)
    region.fill_(7)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the copy from finishing at once
        host.copy_(region, non_blocking=True)
        done = side.record_event()
    pool.release_after(region, done)
    assert pool.take(48 << 20) is None  # still being copied out
    done.synchronize()
    assert pool.take(48 << 20) is not None and int(host[-1]) == 7
