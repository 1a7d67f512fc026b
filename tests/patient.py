"""Preload (`gemma4_kv.tools.harness` spec "preload") for engines whose expected hits are
derived by hand and must not depend on how busy the machine is: the scheduler waits up
to 60 s for a worker rank's lookup answer (`scheduler.RANK_TIMEOUT_S`, 2 s by default)
and a server lookup up to 30 s (`ServerConfig.TIMEOUT_MAX_S`, 1.5 s). On a loaded CI
machine the defaults turned a due hit into a miss now and then: an unanswered rank, or
a server that answered late. Faults that need the defaults are tested elsewhere."""

from __future__ import annotations

RANK_TIMEOUT_S = 60.0
SERVER_TIMEOUT_MAX_S = 30.0


def install() -> None:
    from gemma4_kv.connector import scheduler
    from gemma4_kv.stores.config import ServerConfig

    scheduler.RANK_TIMEOUT_S = RANK_TIMEOUT_S
    ServerConfig.TIMEOUT_MAX_S = SERVER_TIMEOUT_MAX_S
