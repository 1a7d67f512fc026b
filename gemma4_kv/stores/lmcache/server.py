"""The wire of a running `lmcache server` (engine-driven mode, LMCache 0.5.6): one
method per server call gemma4-kv makes (`ServerWire`), with typed arguments and typed
answers (`Pending[T]`). The server store (`stores/server/`) calls these methods only,
never LMCache's RPC names or payload classes, so a new wire format is adapted here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from .version import check_version

T = TypeVar("T")


class Pending(Generic[T]):
    """A call sent whose answer is to come: `query` / `wait` for it, then `result` is
    the typed answer (what LMCache's future raises, it raises)."""

    def __init__(self, future, convert: Callable[[Any], T]):
        self._future, self._convert = future, convert

    def query(self) -> bool:
        """Whether the answer has come (never waits)."""
        return self._future.query()

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds; whether the answer has come."""
        return self._future.wait(timeout)

    def result(self, timeout: float | None = None) -> T:
        return self._convert(self._future.result(timeout))


@dataclass(frozen=True)
class Registration:
    """The server's answer to a registration: its shared-memory L1 segment."""

    shm_name: str
    pool_size: int


@dataclass(frozen=True)
class Slots:
    """The server's answer to a prepare (store or retrieve): whether it succeeded, and
    the L1 slots it handed out (dicts of offset, length, shape, dtype), with, for a
    store, the chunk index of each within the range asked."""

    success: bool
    slots: list[dict]
    chunk_indices: list


@dataclass(frozen=True)
class GroupShape:
    """What a registration says of one KV cache group's objects."""

    block_size: int
    num_layers: int
    hidden_dim_size: int
    dtype: str
    """The torch dtype's name without `torch.` (e.g. "bfloat16")."""
    slots: int
    """Token slots per object (`server.connection.object_slots`)."""


ServerKey = Any
"""A key of the wire (LMCache's `IPCCacheServerKey`): made by `ServerWire.key` only."""


def _slots(reply) -> Slots:
    ctx = getattr(reply, "context", None) or {}
    return Slots(bool(getattr(reply, "success", True)), list(ctx.get("slots") or []),
                 list(ctx.get("chunk_indices") or []))


def _found(reply) -> int | None:
    return None if reply is None else int(reply)


class ServerWire:
    """The calls of one client of a running server, each sent without waiting.

    `client` is LMCache's request client itself, the one way to it from outside this
    package: the tests and benchmarks wrap its methods to count or alter what the
    server answers. The store uses the methods below only."""

    def __init__(self, url: str):
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        check_version()
        self.client = RequestClientFactory.create(url)

    # -- keys -------------------------------------------------------------------------
    @staticmethod
    def key(model_name: str, token_ids: tuple[int, ...], start: int, end: int,
            request_id: str, worker_id: int | None) -> ServerKey:
        """The key of tokens [start, end) of a chain registered under `model_name`."""
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        return IPCCacheServerKey(model_name=model_name, world_size=1, worker_id=worker_id,
                                 token_ids=token_ids, start=start, end=end,
                                 request_id=request_id, num_kv_readers=1)

    # -- registrations ----------------------------------------------------------------
    def ping(self, instance_id: int | None) -> Pending[bool]:
        """Whether the server answers (for `instance_id`: keeps it from being reaped)."""
        return Pending(self.client.ping(instance_id), bool)

    def chunk_size(self) -> Pending[int]:
        return Pending(self.client.get_chunk_size(), int)

    def register(self, instance_id: int, model_name: str,
                 shape: GroupShape) -> Pending[Registration]:
        """Register one instance whose objects have `shape` (idempotent on the server)."""
        from lmcache.v1.multiprocess.custom_types import RegisterEngineDrivenContextPayload

        payload = RegisterEngineDrivenContextPayload(
            instance_id=instance_id, model_name=model_name, world_size=1,
            block_size=shape.block_size, num_layers=shape.num_layers,
            hidden_dim_size=shape.hidden_dim_size, dtype_str=shape.dtype, use_mla=False,
            num_physical_slots=shape.slots)
        return Pending(self.client.register_kv_cache_engine_driven_context(payload),
                       lambda r: Registration(str(r.shm_name or ""), int(r.pool_size)))

    def unregister(self, instance_id: int) -> Pending[None]:
        """Unregister one instance (0.5.6 commits its open reservations)."""
        return Pending(self.client.unregister_kv_cache_engine_driven_context(instance_id),
                       lambda r: None)

    # -- reads ------------------------------------------------------------------------
    def lookup(self, key: ServerKey) -> Pending[None]:
        """Start locking the leading run of `key`'s chain the server holds (and bring
        it up from L2 first); its outcome is `lookup_status` of the key's session."""
        return Pending(self.client.lookup(key, 1), lambda r: None)

    def lookup_status(self, request_id: str) -> Pending[int | None]:
        """Chunks the lookup of session `request_id` found and locked (None: not yet)."""
        return Pending(self.client.query_prefetch_status(request_id), _found)

    def free_lookup_locks(self, key: ServerKey) -> Pending[Any]:
        return Pending(self.client.free_lookup_locks(key, 1), lambda r: r)

    def prepare_retrieve(self, key: ServerKey, instance_id: int) -> Pending[Slots]:
        """The L1 slots of locked objects to read (a failure releases their locks)."""
        return Pending(self.client.prepare_retrieve(key, instance_id), _slots)

    def commit_retrieve(self, key: ServerKey, instance_id: int) -> Pending[Any]:
        """Done reading what `prepare_retrieve` handed out: its locks go."""
        return Pending(self.client.commit_retrieve(key, instance_id), lambda r: r)

    # -- writes -----------------------------------------------------------------------
    def prepare_store(self, key: ServerKey, instance_id: int) -> Pending[Slots]:
        """L1 slots reserved for the chunks of `key` the server neither holds nor lacks
        room for."""
        return Pending(self.client.prepare_store(key, instance_id), _slots)

    def commit_store(self, key: ServerKey, instance_id: int) -> Pending[bool]:
        """Make the filled slots visible; whether the server took the commit."""
        return Pending(self.client.commit_store(key, instance_id, b""), bool)

    def end_session(self, request_id: str) -> Pending[Any]:
        return Pending(self.client.end_session(request_id), lambda r: r)

    def close(self) -> None:
        self.client.close()
