"""How long a lookup waits for a slower tier: as long as the hit is worth.

A hit from an L2 tier replaces the prefill of the tokens it adds beyond the CPU tier's
hit. Waiting longer than that prefill would take makes the request slower than not
waiting, so the wait is bounded by the prefill's time (`Rates.prefill_s`). A fetch
expected to take longer than that at the tier's throughput is not waited for at all.

Before an engine has measured anything, priors stand in (`Rates`): the prefill time from
the model's FLOPs and the device's rate (`priors.py`; none on a CPU), and the rates the
engines before it measured on this host, per tier and fingerprint (`rate_file.py`),
refined and written back as fetches finish. Without a prefill estimate the bound is
`timeout_s`.

A fetch whose store reports the bytes it has brought up so far (`Prefetch.progress_bytes`)
is given up once nothing arrived for `timeout_s`, and is never given up while bytes keep
arriving and the hit is worth twice the fetch's time at their rate (`still_worth`). A
store that reports nothing is waited for at most `timeout_s` unless this engine has
seen the tier finish a fetch: a rate from the file says the tier was alive, not that it
is.

A tier that does not deliver within its budget is given up on for that lookup only;
after `PAUSE_AFTER` such give-ups in a row (and no fetch that finished in between),
lookups stop asking slower tiers for a while (5 s, doubling to 60 s), so a dead tier
costs a few timeouts, and one slow lookup never pauses the others.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from ..stores.stats import Stats
from .rate_file import RateFile, entry_key

logger = logging.getLogger(__name__)

PAUSE_AFTER = 3
"""Give-ups in a row after which slower tiers are left alone for a while."""
STALL_FACTOR = 2.0
"""A fetch running this many times longer than its expected time counts as stalled."""
PREFILL_MIN_TOKENS = 64
"""Steps computing fewer tokens say little about prefill (their time is the weights')."""
SAVE_EVERY_S = 60.0
"""Prefill rates are written back at most this often (tier rates whenever a fetch ends)."""
_EWMA = 0.3


class Rates:
    """Costs: prefill seconds per token (measured from the model thread's steps, else
    persisted, else `prefill_prior(start, tokens)`), and the slower tiers' throughput
    (measured from fetches that finished, else persisted). With a `RateFile`, the
    measurements are written back under (`tier`, `engine`) keys. Thread-safe: the
    values under `_lock`; file I/O only on the lookup thread (`fetched`, `save_if_due`),
    never under the lock."""

    def __init__(self, prefill_prior=None, file: RateFile | None = None, tier: str = "",
                 engine: str = ""):
        self._lock = threading.Lock()
        self._prefill_prior = prefill_prior
        self._file = file
        self._keys = {"tier": entry_key("tier", tier, engine),
                      "prefill": entry_key("prefill", engine)}
        known = file.read() if file is not None else {}
        self._persisted = {kind: known.get(key) for kind, key in self._keys.items()}
        self._prefill_s_per_token: float | None = None
        self._tier_bytes_per_s: float | None = None
        self._dirty = False
        self._saved_at: float | None = None

    def prefill(self, tokens: int, seconds: float) -> None:
        """One step computed `tokens` tokens in `seconds`."""
        if tokens >= PREFILL_MIN_TOKENS and seconds > 0:
            self._prefill_s_per_token = self._mix(self._prefill_s_per_token, seconds / tokens)

    def fetched(self, nbytes: int, seconds: float) -> None:
        """A fetch from a slower tier brought `nbytes` up in `seconds` (lookup thread)."""
        if nbytes > 0 and seconds > 0:
            self._tier_bytes_per_s = self._mix(self._tier_bytes_per_s, nbytes / seconds)
            self._save()

    def _mix(self, old: float | None, new: float) -> float:
        with self._lock:
            self._dirty = True
            return new if old is None else (1 - _EWMA) * old + _EWMA * new

    @property
    def tier_measured(self) -> bool:
        """Whether this engine has seen a slower tier finish a fetch."""
        return self._tier_bytes_per_s is not None

    def prefill_s(self, tokens: int, start: int = 0) -> float | None:
        """Time to prefill `tokens` tokens after `start` cached ones: measured, else
        persisted, else the prior; None if none is known."""
        rate = self._prefill_s_per_token or self._persisted["prefill"]
        if rate is not None:
            return rate * tokens
        return None if self._prefill_prior is None else self._prefill_prior(start, tokens)

    def fetch_s(self, nbytes: int | None) -> float | None:
        """Expected time to fetch `nbytes` from a slower tier, or None if unknown."""
        rate = self._tier_bytes_per_s or self._persisted["tier"]
        return None if rate is None or nbytes is None else nbytes / rate

    def save_if_due(self, now: float) -> None:
        """Write measurements back if some changed and `SAVE_EVERY_S` has passed (lookup
        thread: the model thread's `prefill` never writes)."""
        if self._dirty and (self._saved_at is None or now - self._saved_at >= SAVE_EVERY_S):
            self._saved_at = now
            self._save()

    def _save(self) -> None:
        with self._lock:
            values = {"tier": self._tier_bytes_per_s, "prefill": self._prefill_s_per_token}
            self._dirty = False
        known = {self._keys[k]: v for k, v in values.items() if v is not None}
        if self._file is not None and known:
            self._file.update(known)


@dataclass
class Wait:
    """One lookup's wait for a slower tier (`WaitPolicy.start`); the lookup thread's."""

    asked: float
    worth_s: float | None
    """Prefill time of the tokens the hit adds (None: unknown)."""
    fetch_bytes: int | None
    until: float
    """Deadline for a fetch whose store reports progress (the budget)."""
    until_blind: float
    """Deadline for one whose store does not."""
    seen_bytes: int = 0
    seen_at: float = 0.0
    """When `seen_bytes` last grew (from `asked`)."""


class WaitPolicy:
    """Budgets of lookups that wait for a slower tier, and the pause after repeated
    give-ups. Used on the lookup thread only (`Rates` is shared)."""

    def __init__(self, timeout_s: float, rates: Rates | None = None,
                 stats: Stats | None = None):
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

    def budget(self, extra_tokens: int, fetch_bytes: int | None, start: int = 0) -> float:
        """Seconds a lookup may wait for a fetch adding `extra_tokens` to its hit of
        `start` tokens by bringing up `fetch_bytes` (None: unknown); 0 if the fetch is not
        worth waiting for (expected to take longer than prefilling those tokens)."""
        worth = self.rates.prefill_s(extra_tokens, start)
        expected = self.rates.fetch_s(fetch_bytes)
        if worth is None:
            return self.timeout_s
        if expected is not None and expected > worth:
            self._count("l2_fetches_not_worth_it")
            return 0.0
        progressing = self.timeout_s if expected is None else max(self.timeout_s,
                                                                  STALL_FACTOR * expected)
        return min(worth, progressing)

    def start(self, now: float, extra_tokens: int, fetch_bytes: int | None,
              start: int = 0) -> Wait | None:
        """The wait of a lookup that may ask a slower tier now, or None if the fetch is
        not worth waiting for (`budget`)."""
        self.rates.save_if_due(now)
        budget = self.budget(extra_tokens, fetch_bytes, start)
        if budget <= 0:
            return None
        blind = budget if self.rates.tier_measured else min(budget, self.timeout_s)
        return Wait(now, self.rates.prefill_s(extra_tokens, start), fetch_bytes,
                    now + budget, now + blind, 0, now)

    def keep_waiting(self, w: Wait, now: float, progress_bytes: int | None) -> bool:
        """Whether a lookup still waits for its unfinished fetch, given the bytes its store
        has brought up so far (None: the store does not tell)."""
        if progress_bytes is None:
            return now < w.until_blind
        if progress_bytes > w.seen_bytes:
            w.seen_bytes, w.seen_at = progress_bytes, now
        if now - w.seen_at >= self.timeout_s:
            return False  # stalled: nothing arrived for timeout_s
        return now < w.until or self.still_worth(w.worth_s, w.fetch_bytes, now - w.asked,
                                                 w.seen_bytes)

    @staticmethod
    def still_worth(worth_s: float | None, fetch_bytes: int | None, elapsed_s: float,
                    progress_bytes: int) -> bool:
        """Whether a fetch that has brought up `progress_bytes` of `fetch_bytes` in
        `elapsed_s` is worth twice its whole time at that rate (`STALL_FACTOR`)."""
        if not worth_s or not fetch_bytes or progress_bytes <= 0 or elapsed_s <= 0:
            return False
        projected = elapsed_s * fetch_bytes / min(progress_bytes, fetch_bytes)
        return worth_s >= STALL_FACTOR * projected

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
