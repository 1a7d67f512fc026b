"""How long a lookup waits for a slower tier: as long as the hit is worth.

A hit from an L2 tier replaces the prefill of the tokens it adds beyond the CPU tier's
hit. Waiting longer than that prefill would take makes the request slower than not
waiting, so the wait is bounded by the prefill's measured time (`Rates.prefill_s`). A
fetch expected to take longer than that at the tier's measured throughput is not
waited for at all. Without measurements the bound is `timeout_s`.

A tier that does not deliver within its budget is given up on for that lookup only;
after `PAUSE_AFTER` such give-ups in a row (and no fetch that finished in between),
lookups stop asking slower tiers for a while (5 s, doubling to 60 s), so a dead tier
costs a few timeouts, and one slow lookup never pauses the others.
"""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger(__name__)

PAUSE_AFTER = 3
"""Give-ups in a row after which slower tiers are left alone for a while."""
STALL_FACTOR = 2.0
"""A fetch running this many times longer than its expected time counts as stalled."""
PREFILL_MIN_TOKENS = 64
"""Steps computing fewer tokens say little about prefill (their time is the weights')."""
_EWMA = 0.3


class Rates:
    """Measured costs: prefill seconds per token (from the model thread's steps) and the
    slower tiers' throughput (from fetches that finished). Thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._prefill_s_per_token: float | None = None
        self._tier_bytes_per_s: float | None = None

    def prefill(self, tokens: int, seconds: float) -> None:
        """One step computed `tokens` tokens in `seconds`."""
        if tokens >= PREFILL_MIN_TOKENS and seconds > 0:
            self._prefill_s_per_token = self._mix(self._prefill_s_per_token, seconds / tokens)

    def fetched(self, nbytes: int, seconds: float) -> None:
        """A fetch from a slower tier brought `nbytes` up in `seconds`."""
        if nbytes > 0 and seconds > 0:
            self._tier_bytes_per_s = self._mix(self._tier_bytes_per_s, nbytes / seconds)

    def _mix(self, old: float | None, new: float) -> float:
        with self._lock:
            return new if old is None else (1 - _EWMA) * old + _EWMA * new

    def prefill_s(self, tokens: int) -> float | None:
        """Measured time to prefill `tokens` tokens, or None before any measurement."""
        rate = self._prefill_s_per_token
        return None if rate is None else rate * tokens

    def fetch_s(self, nbytes: int | None) -> float | None:
        """Expected time to fetch `nbytes` from a slower tier, or None if unknown."""
        rate = self._tier_bytes_per_s
        return None if rate is None or nbytes is None else nbytes / rate


class WaitPolicy:
    """Budgets of lookups that wait for a slower tier, and the pause after repeated
    give-ups. Used on the lookup thread only (`Rates` is shared)."""

    def __init__(self, timeout_s: float, rates: Rates | None = None, stats=None):
        self.timeout_s = timeout_s
        self.rates = rates or Rates()
        self.stats = stats
        self._given_up = 0
        self._paused_until, self._pause = 0.0, 5.0

    def allows(self, now: float) -> bool:
        """Whether lookups may ask slower tiers now (not paused)."""
        if now < self._paused_until:
            self._count("l2_lookups_paused")
            return False
        return True

    def budget(self, extra_tokens: int, fetch_bytes: int | None) -> float:
        """Seconds a lookup may wait for a fetch adding `extra_tokens` to its hit by
        bringing up `fetch_bytes` (None: unknown); 0 if the fetch is not worth waiting
        for (expected to take longer than prefilling those tokens)."""
        worth = self.rates.prefill_s(extra_tokens)
        expected = self.rates.fetch_s(fetch_bytes)
        if worth is None:
            return self.timeout_s
        if expected is not None and expected > worth:
            self._count("l2_fetches_not_worth_it")
            return 0.0
        progressing = self.timeout_s if expected is None else max(self.timeout_s,
                                                                  STALL_FACTOR * expected)
        return min(worth, progressing)

    def fetched(self, nbytes: int, seconds: float) -> None:
        """A fetch finished within its budget: the tier answers."""
        self.rates.fetched(nbytes, seconds)
        self._given_up = 0
        self._pause = 5.0

    def gave_up(self, now: float) -> None:
        """A lookup stopped waiting for its fetch; after `PAUSE_AFTER` in a row, slower
        tiers are left alone for a while."""
        self._count("l2_waits_given_up")
        self._given_up += 1
        if self._given_up >= PAUSE_AFTER and now >= self._paused_until:
            logger.warning("gemma4-kv: %d lookups in a row gave up waiting for an L2 tier; "
                           "serving from the CPU tier alone for %.0f s", self._given_up,
                           self._pause)
            self._paused_until = now + self._pause
            self._pause = min(60.0, 2 * self._pause)
            self._given_up = 0

    def _count(self, name: str) -> None:
        if self.stats is not None:
            self.stats.add(name, 1)
