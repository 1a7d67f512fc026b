"""The store on a running `lmcache server` (LMCache 0.5.6, engine-driven mode): the
connection (`connection`), the mapped shared-memory L1 (`shm`), reads and writes over
them (`reads`, `writes`), window chains for sliding groups (`windows`) and the store
interface on top (`store`)."""

from .connection import ServerConnection, ServerUnavailable, object_slots, server_argv
from .shm import UnsupportedServer
from .store import ServerStore

__all__ = ["ServerConnection", "ServerStore", "ServerUnavailable", "UnsupportedServer",
           "object_slots", "server_argv"]
