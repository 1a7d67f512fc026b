"""Which saves may take room in a shared `lmcache server`'s L1 once it is full.

The server evicts by LRU (`server_argv`): alone, a loop of prompts larger than its L1
keeps nothing, each save pushing out the prompt asked next. So an engine decides, as
TinyLFU does (Einziger et al., 2017), whether a save may displace what is there: while
the server is FULL, the save of an end is refused unless that end was asked for more
often before than the least recent end this engine knows on the server (its victim).
Refused saves write nothing, so the server evicts nothing more and a loop keeps the
subset it holds, each of it hit every round. Frequencies are `ranking.Ranking`'s (once
per request, halved as they age), so a newly hot prompt gets in and stale ends go.

The server reports its use over HTTP only, so FULL is inferred (`advance`): an end this
engine stored is asked again and must be saved again (the server evicted it), or an end
evicted or refused before is asked again. "Asked" means within the request's lookup
reach (`looked_up`): a save towards an end its lookup could not name (with a draft
that owns KV, the prompt's last chunk has no key until a token follows it) says nothing
of the server, nor does one whose lookup the server did not answer (given up as not
worth the wait on a busy machine, or the server down). FULL lasts `hold_s` after the last such sign,
then the engine saves everything again (ROOM), as it does at start and on a new server
process. Bookkeeping only: no I/O, one lock, O(1) per call; `reserve` (model thread)
and `pin` (lookup thread) both call it.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from ..ranking import Ranking

EndKey = tuple[bytes, int]
"""(hash of the chunk holding the end's last token, end token count), as `capacity`."""

HOLD_S = 300.0
"""FULL lasts this long after the last sign of it: a loop whose refused prompts come
back within it keeps its subset."""
KEYS_MAX = 1 << 14
"""Ends remembered per record (resident, absent, hits, decisions), oldest forgotten."""
MIN_SAMPLE = 1024
"""Counts between two halvings of every frequency (at least; `Ranking.count`)."""


class Pressure(enum.Enum):
    ROOM = "room"
    """Every save is stored (the server evicts by LRU if it must)."""
    FULL = "full"
    """A save is stored only if its end is more frequent than the victim's."""


class Event(enum.Enum):
    EVICTED = "evicted"
    """An end known on the server (or refused) is asked again without a hit."""
    EPOCH = "epoch"
    """Another server process: its L1 is empty."""
    TICK = "tick"
    """Time passes (FULL may lapse)."""


def _remember(d: OrderedDict, key, value=None) -> None:
    d[key] = value
    d.move_to_end(key)
    while len(d) > KEYS_MAX:
        d.popitem(last=False)


class Admission:
    """One engine's admission of saves to a shared server; see the module doc."""

    def __init__(self, *, hold_s: float = HOLD_S, min_sample: int = MIN_SAMPLE,
                 clock: Callable[[], float] = time.monotonic):
        self.hold_s, self._clock = hold_s, clock
        self._lock = threading.Lock()
        self.state = Pressure.ROOM
        self._until = 0.0  # FULL until then (under _lock, as everything below)
        self._epoch: int | None = None
        self._freq = Ranking(window_share=0.0, protected_share=0.0,
                             min_sample=min_sample)  # only its frequencies
        self._resident: OrderedDict[EndKey, None] = OrderedDict()
        """Ends this engine stored or hit on the server, least recent first."""
        self._absent: OrderedDict[EndKey, None] = OrderedDict()
        """Ends known evicted or refused."""
        self._hit: OrderedDict[tuple[str, EndKey], None] = OrderedDict()
        """(request, end) hit: that request's save of the end follows a hit."""
        self._decided: OrderedDict[tuple[str, EndKey], bool] = OrderedDict()
        """(request, end) -> the decision on its first save (later ones follow it)."""
        self._reach: OrderedDict[str, int] = OrderedDict()
        """request -> the longest hit its lookups could have found (tokens)."""
        self.refused = 0
        """Saves refused so far (first decisions only)."""

    # -- the state machine ------------------------------------------------------------
    def advance(self, event: Event) -> Pressure:
        """The one place the pressure changes (call under `_lock`)."""
        now = self._clock()
        if event is Event.EPOCH:
            self.state = Pressure.ROOM
            for d in (self._resident, self._absent, self._hit, self._decided,
                      self._reach):
                d.clear()
        elif event is Event.EVICTED:
            self.state, self._until = Pressure.FULL, now + self.hold_s
        elif self.state is Pressure.FULL and now >= self._until:
            self.state = Pressure.ROOM
        return self.state

    def _sync(self, epoch: int) -> None:
        if epoch != self._epoch:
            self._epoch = epoch
            self.advance(Event.EPOCH)
        self.advance(Event.TICK)

    # -- what the store tells it ------------------------------------------------------
    def hit(self, req_id: str, key: EndKey, epoch: int) -> None:
        """`req_id` pinned a hit ending at `key` on server process `epoch`."""
        with self._lock:
            self._sync(epoch)
            self._freq.count(key, req_id)
            self._absent.pop(key, None)
            _remember(self._resident, key)
            _remember(self._hit, (req_id, key))

    def looked_up(self, req_id: str, reach: int) -> None:
        """The server answered `req_id`'s lookup for up to `reach` tokens (the longest
        answered; 0: asked, nothing answered yet)."""
        with self._lock:
            _remember(self._reach, req_id, max(reach, self._reach.get(req_id, 0)))

    def admit(self, req_id: str, key: EndKey, epoch: int) -> bool:
        """Whether `req_id`'s save towards end `key` may reserve room on the server;
        the first call per (request, end) decides, later ones get the same answer."""
        with self._lock:
            decided = self._decided.get((req_id, key))
            if decided is not None:
                return decided
            self._sync(epoch)
            prior = self._freq.frequency(key)
            self._freq.count(key, req_id)
            if (req_id, key) in self._hit:
                ok = True  # a save after this request's hit: the server holds it
            else:
                asked = key[1] <= self._reach.get(req_id, key[1])  # unknown: asked
                if asked and (key in self._resident or key in self._absent):
                    self._resident.pop(key, None)
                    self.advance(Event.EVICTED)
                ok = self.state is Pressure.ROOM
                if not ok:
                    victim = next(iter(self._resident), None)
                    ok = prior > (self._freq.frequency(victim) if victim else 0)
                    if ok and victim is not None:
                        del self._resident[victim]  # displaced, as far as we know
                        _remember(self._absent, victim)
            if ok:
                self._absent.pop(key, None)
                _remember(self._resident, key)
            else:
                self.refused += 1
                _remember(self._absent, key)
            _remember(self._decided, (req_id, key), ok)
            return ok

    def frequency(self, key: EndKey) -> int:
        with self._lock:
            return self._freq.frequency(key)
