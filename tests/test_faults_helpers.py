"""tests/faults.py's waits fail when what they wait for never comes: `drop_l1` (nothing
read-locked) and `wait_l2` (every CPU-tier object written to the L2 tier). Before, both
carried on after their timeout and the steps after them ran on a premise that did not
hold. Against a stand-in store: no engine needed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from needs import require

require("vllm")  # faults imports the connector

import faults  # noqa: E402


class Store:
    """What the two helpers use of the worker's store: tier.status, drop_l1,
    l2_writes_in_flight. The CPU tier holds `objects`; `locked_polls` status reads later
    nothing is read-locked (None: never), as the engine's lookup thread would settle
    what held them; `in_flight` L2 writes never end."""

    def __init__(self, objects: int, locked_polls: int | None, in_flight: int = 0):
        self.objects, self.locked_polls, self.dropped = objects, locked_polls, 0
        self.in_flight = in_flight
        self.tier = SimpleNamespace(status=self.status)

    def l2_writes_in_flight(self) -> int:
        return self.in_flight

    def status(self) -> dict:
        locked = 0 if self.locked_polls == 0 else 2
        if self.locked_polls:
            self.locked_polls -= 1
        return {"total_object_count": self.objects, "read_locked_count": locked}

    def drop_l1(self) -> None:
        self.dropped += 1
        self.objects = 0


@pytest.fixture
def store(monkeypatch):
    holder = SimpleNamespace(store=None)
    monkeypatch.setattr(faults, "_worker", lambda: holder)
    return holder


def test_drop_l1_drops_once_nothing_is_read_locked(store):
    store.store = Store(objects=5, locked_polls=3)
    out = faults.drop_l1(None, timeout=30.0)
    assert (out["before"], out["after"], out["read_locked"]) == (5, 0, 0)
    assert store.store.dropped == 1


def test_drop_l1_fails_when_objects_stay_read_locked(store):
    store.store = Store(objects=5, locked_polls=None)
    with pytest.raises(TimeoutError, match=r"^faults\.drop_l1: 2 CPU-tier object\(s\) still "
                                           r"read-locked after 0\.2 s .*nothing dropped$"):
        faults.drop_l1(None, timeout=0.2)
    assert store.store.dropped == 0


def files(disk, n: int) -> None:
    for i in range(n):
        (disk / f"object-{i}").write_bytes(b"kv")


def test_wait_l2_counts_the_objects_once_written(store, tmp_path):
    store.store = Store(objects=3, locked_polls=0)
    files(tmp_path, 3)
    assert faults.wait_l2(None, disk=str(tmp_path), timeout=30.0) == 3


@pytest.mark.parametrize("written, locked, in_flight", [(1, 0, 0), (3, None, 0), (3, 0, 1)])
def test_wait_l2_fails_when_the_writes_never_end(store, tmp_path, written, locked, in_flight):
    """Objects missing from the disk tier, all there but still read-locked, or all there
    with a write still in flight."""
    store.store = Store(objects=3, locked_polls=locked, in_flight=in_flight)
    files(tmp_path, written)
    busy = 0 if locked == 0 else 2
    with pytest.raises(TimeoutError, match=rf"^faults\.wait_l2: after 0\.2 s the disk tier in "
                                           rf".* holds {written} object\(s\) of the CPU "
                                           rf"tier's 3, and {busy} are still read-locked by "
                                           rf"writes, {in_flight} write\(s\) in flight"):
        faults.wait_l2(None, disk=str(tmp_path), timeout=0.2)
