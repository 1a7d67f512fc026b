"""Preload (`gemma4_kv.tools.harness` spec "preload") for engines whose expected hits are
derived by hand and must not depend on how busy the machine is: the scheduler waits up
to 60 s for a worker rank's lookup answer (`scheduler.RANK_TIMEOUT_S`, 2 s by default)
and a server lookup up to 30 s (`ServerConfig.TIMEOUT_MAX_S`, 1.5 s), and a lookup waits
for the server up to the engine's `lookup_timeout_s`, whatever the prefill it saves
(`lookup.wait.WaitPolicy.budget` bounds the wait by that prefill's measured time: a
tiny CPU model's 512 tokens take less than a busy machine's server lookup). On a loaded
CI machine the defaults turned a due hit into a miss now and then: an unanswered rank,
a server that answered late, a wait not worth it. Faults and waits that need the
defaults are tested elsewhere (tests/test_lookup_wait.py, tests/test_e2e_faults.py)."""

from __future__ import annotations

RANK_TIMEOUT_S = 60.0
SERVER_TIMEOUT_MAX_S = 30.0


def install() -> None:
    from gemma4_kv.connector import scheduler
    from gemma4_kv.lookup.wait import WaitPolicy
    from gemma4_kv.stores.config import ServerConfig

    scheduler.RANK_TIMEOUT_S = RANK_TIMEOUT_S
    ServerConfig.TIMEOUT_MAX_S = SERVER_TIMEOUT_MAX_S
    WaitPolicy.budget = _the_timeout


def _the_timeout(self, extra_tokens: int, fetch_bytes: int | None, start: int = 0) -> float:
    """`WaitPolicy.budget` of a patient engine: its `lookup_timeout_s` for every fetch."""
    return self.timeout_s
