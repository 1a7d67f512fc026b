"""collective_rpc target of tests/test_e2e_preemption.py (tests/ is on the engine's
PYTHONPATH): the requests holding a pinned hit on this worker rank."""

from __future__ import annotations


def pinned_requests(worker) -> list[str]:
    """Asked through the rank's own lookup socket first: a rank handles the messages of
    its socket in order, so the scheduler's releases sent before this call are done."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from gemma4_kv.lookup import messages
    from gemma4_kv.lookup.channel import LookupClient

    cw = get_kv_transfer_group()._worker
    client = LookupClient([cw.server.address], timeout_ms=10_000)
    try:
        assert client.ask_all(messages.Release("sync")) == [messages.Done(ok=True)]
    finally:
        client.close()
    return sorted(cw.lookups.pinned_requests())
