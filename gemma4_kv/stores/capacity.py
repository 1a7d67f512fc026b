"""What the embedded store keeps when its CPU tier is full: whole servable hits, ranked
by how often requests ask for them (W-TinyLFU).

An object (one group's KV of one chunk) is worth its memory only as part of a hit a
lookup can serve: chunk c of a full-attention group serves only with chunks 0..c-1 of
that group and, for every sliding group, the window before the hit. So the unit kept or
evicted is a hit *end* (a token count on a chain of chunk hashes) holding every object
its hit needs; an object stays while some end holds it and is freed when none does.

Ends have a class, given by the scheduler:
- HIGH: where a stored prompt ends (the hit of that prompt asked again) and where its
  generated tokens end;
- LOW: the ends every `retention_interval` tokens, kept only so that a hit can stop
  there, and ends a longer stored end passes through (an earlier turn of a chat, whose
  next turn extends it). Every LOW end goes before any HIGH end; a LOW end that serves
  a hit is HIGH again, for good if a longer end passes through it (a branching point).

HIGH ends are ranked by W-TinyLFU (Einziger, Friedman, Manes: "TinyLFU: A Highly
Efficient Cache Admission Policy", 2017). A new end enters a recency window
(`window_share` of the tier); the oldest ends pushed out of it stay only by displacing
ends of the main part (a segmented LRU) that were asked for less often. An end too large
for the window is admitted to main only the same way. In a store with an L2 tier
(`ties_admit`) an end asked as often as main's least recent one displaces it: L2 still
holds it, and a long document asked once can be brought up from L2 and served rather
than recomputed (a tie would refuse it room). Frequencies count the requests
that saved an end and the hits it served, halved every `sample` counts so that old
popularity fades. A looping or scanning set larger than the tier thus keeps a stable
subset that hits every round, where LRU keeps nothing.

Bookkeeping only (no LMCache here): the store asks it what to evict and tells it what
it stored. Every call costs O(objects of the ends it touches) plus, when memory is
short, a walk over the ends it may evict. Thread-safe: lookups (hits) and saves run on
different threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ..layout.groups import KVLayout
from ..layout.plan import hit_chunks
from .base import HIGH, LOW
from .ranking import Ranking

ObjKey = tuple[bytes, int]
"""(chunk hash, group id) of one stored object."""
EndKey = tuple[bytes, int]
"""(hash of the chunk holding the end's last token, end token count)."""


@dataclass(frozen=True)
class EndSpec:
    """A hit end: its key, class and the objects its hit needs."""

    key: EndKey
    cls: int
    cells: tuple[ObjKey, ...]


def hit_end(layout: KVLayout, chunk_size: int, chain: Sequence[bytes], tokens: int,
            cls: int) -> EndSpec:
    """The end of a hit of `tokens` tokens on `chain`, with every object the hit reads."""
    cells = [(chain[c], g) for g, c in hit_chunks(layout, 0, tokens, chunk_size)]
    return EndSpec((chain[-(-tokens // chunk_size) - 1], tokens), cls, tuple(cells))


@dataclass(eq=False)
class _End:
    key: EndKey
    cls: int
    cells: frozenset[ObjKey]
    owners: set[str] = field(default_factory=set)
    """Requests still saving it, while it is pending (not every object stored yet)."""
    live: bool = False
    size: int = 0
    """Bytes it held alone when it went live (its share of the window)."""
    pins: int = 0
    shared: bool = False
    """It served a hit while a longer stored end passed through it: a branching point
    (a document with several questions), never superseded."""


class Capacity:
    """The account of one tier of `total` bytes; its owner (`embedded.EmbeddedStore`)
    asks it what to evict and tells it what was stored, loaded or lost."""

    def __init__(self, total: int, *, window_share: float = 0.05,
                 protected_share: float = 0.8, min_sample: int = 1024,
                 ties_admit: bool = False):
        self._total = self._limit = total
        self._lock = threading.RLock()
        self._ends: dict[EndKey, _End] = {}
        self._users: dict[ObjKey, set[EndKey]] = {}  # ends (pending or live) needing it
        self._objects: dict[ObjKey, int] = {}  # in the tier (written or being written)
        self._stored: set[ObjKey] = set()  # written
        self._garbage: set[ObjKey] = set()  # in the tier, needed by no end: to delete
        self._requests: dict[str, set[EndKey]] = {}  # ends each saving request planned
        self._at: dict[bytes, set[EndKey]] = {}  # ends by the hash of their last chunk
        self._promised: dict[str, int] = {}  # room made for lookups in flight, by owner
        self._rank = Ranking(window_share=window_share, protected_share=protected_share,
                             min_sample=min_sample, ties_admit=ties_admit)
        self.used = 0

    @property
    def limit(self) -> int:
        """Bytes the account may give: the tier's, less what it holds untracked."""
        return self._limit

    def untracked(self, nbytes: int) -> None:
        """The tier holds `nbytes` beyond the account (objects a reader still holds,
        allocation overhead): room the account cannot give, left out of its limit."""
        with self._lock:
            self._limit = self._total - nbytes

    # -- what is stored ---------------------------------------------------------------
    def live_ends(self) -> dict[EndKey, str]:
        """Live ends and the segment each is in. Nothing here decides on it: the soak
        benchmark counts them (tests/faults.py `snapshot`) to show the bookkeeping does
        not grow, and the tests check which segment an end is in."""
        with self._lock:
            return dict(self._rank.where)

    def frequency(self, key: EndKey) -> int:
        return self._rank.frequency(key)

    # -- saves ------------------------------------------------------------------------
    def plan(self, req_id: str, ends: Sequence[EndSpec], sizes: dict[ObjKey, int]) -> None:
        """A request saves towards `ends`. At an end's first sight for this request, a
        HIGH end is asked for once more; an end not yet known is admitted if it fits
        now or could by evicting what it may evict (`_victims`), HIGH ends first.
        Admitted ends hold their objects from then on; a rejected one stores nothing."""
        with self._lock:
            seen = self._requests.setdefault(req_id, set())
            planned = 0  # bytes of this call's ends admitted so far
            for spec in sorted(ends, key=lambda e: -e.cls):
                if spec.key in seen:
                    continue
                seen.add(spec.key)
                if spec.cls == HIGH:
                    self._rank.count(spec.key)
                end = self._ends.get(spec.key)
                if end is not None:
                    if spec.cls == HIGH and end.cls == LOW:
                        self._promote(end)
                    if not end.live:
                        end.owners.add(req_id)
                    continue
                new = sum(sizes.get(c, 0) for c in set(spec.cells)
                          if c not in self._objects and not self._users.get(c))
                short = planned + new - (self._limit - self.used)
                if short > 0 and self._rank.victims(short, spec.cls, self.frequency(spec.key),
                                                    new, self._alone, self._limit) is None:
                    continue
                planned += new
                self._add(_End(spec.key, spec.cls, frozenset(spec.cells), {req_id}))

    def wanted(self, keys: Iterable[ObjKey]) -> list[ObjKey]:
        """Of these objects a save could store, those an admitted end needs and that are
        not in the tier yet."""
        with self._lock:
            return [k for k in keys if self._users.get(k) and k not in self._objects]

    def grant(self, req_id: str, sizes: dict[ObjKey, int]) -> tuple[list[ObjKey], list[ObjKey]]:
        """Which of these objects (wanted by this request's save, see `wanted`) get
        memory now, and the objects to delete first to make room: (granted, garbage).
        Objects a HIGH end needs come first, with room made as this request's most
        valuable pending end may; then those only LOW ends need, with room from LOW
        ends. What cannot fit is not granted, and this request's pending ends that
        needed it are given up (they could not complete)."""
        with self._lock:
            mine = [self._ends[k] for k in self._requests.get(req_id, ())
                    if k in self._ends and not self._ends[k].live]
            high = [k for k in sizes if any(self._ends[e].cls == HIGH
                                            for e in self._users.get(k, ()))]
            low = [k for k in sizes if k not in set(high)]
            granted: list[ObjKey] = []
            for cls, keys in ((HIGH, high), (LOW, low)):
                if not keys:
                    continue
                need = sum(sizes[k] for k in keys)
                short = need - (self._limit - self.used - sum(sizes[k] for k in granted))
                ends = [e for e in mine if e.cls == cls] if cls == LOW else mine
                best = max(ends, key=lambda e: (e.cls, self.frequency(e.key)), default=None)
                victims = [] if short <= 0 else None if best is None else self._rank.victims(
                    short, best.cls, self.frequency(best.key), need, self._alone,
                    self._limit)
                if victims is None:
                    for end in (mine if cls == HIGH else ends):
                        if end.key in self._ends:
                            self._evict(end)
                    if cls == HIGH:
                        return [], self._take_garbage()
                    continue
                for end in victims:
                    self._evict(end)
                granted += keys
            self._rank.balance_window(self._limit)
            return granted, self._take_garbage()

    def reserved(self, sizes: dict[ObjKey, int]) -> None:
        """These objects now have memory in the tier (being written)."""
        with self._lock:
            for k, n in sizes.items():
                self.used += n - self._objects.get(k, 0)
                self._objects[k] = n
                if not self._users.get(k):
                    self._garbage.add(k)

    def stored(self, keys: Iterable[ObjKey]) -> None:
        """These objects are written: ends that now have every object go live."""
        with self._lock:
            waiting: set[EndKey] = set()
            for k in keys:
                if k in self._objects:
                    self._stored.add(k)
                    waiting.update(self._users.get(k, ()))
            for key in waiting:
                end = self._ends[key]
                if not end.live and end.cells <= self._stored:
                    self._go_live(end)

    def kept(self, sizes: dict[ObjKey, int]) -> None:
        """Objects handed out for deletion that the tier kept (read-locked): still there,
        deleted later unless an end needs them again."""
        with self._lock:
            for k, n in sizes.items():
                self.used += n - self._objects.get(k, 0)
                self._objects[k] = n
                self._stored.add(k)
                if not self._users.get(k):
                    self._garbage.add(k)

    def dropped(self, keys: Iterable[ObjKey]) -> list[ObjKey]:
        """These objects are gone from the tier (aborted, lost, bad): every end needing
        one cannot serve and is evicted. Returns what else that leaves unneeded."""
        with self._lock:
            ends: set[EndKey] = set()
            for k in keys:
                self.used -= self._objects.pop(k, 0)
                self._stored.discard(k)
                self._garbage.discard(k)
                ends.update(self._users.get(k, ()))
            for key in ends:
                self._evict(self._ends[key])
            return self._take_garbage()

    def finished(self, req_id: str) -> list[ObjKey]:
        """A request stopped saving: ends only it was completing are given up. Returns
        the objects no end needs any more (to delete). A lookup's room promised to
        `req_id` goes too (`room`)."""
        with self._lock:
            self._promised.pop(req_id, None)
            for key in self._requests.pop(req_id, ()):
                end = self._ends.get(key)
                if end is not None and not end.live:
                    end.owners.discard(req_id)
                    if not end.owners:
                        self._evict(end)
            return self._take_garbage()

    # -- hits -------------------------------------------------------------------------
    def served(self, spec: EndSpec, sizes: dict[ObjKey, int], create: bool = True,
               req_id: str = "") -> None:
        """A lookup pinned the hit ending at `spec`: it is asked for once more (once per
        request: vLLM looks a waiting request up again every step) and is more recent;
        a LOW end becomes HIGH. With `create` (every object of the hit, from chunk 0, is
        in the tier), a hit no live end names (brought up from another tier, or left by
        other ends) becomes a live HIGH end."""
        with self._lock:
            self._rank.count(spec.key, req_id)
            end = self._ends.get(spec.key)
            if end is None or not end.live:
                if not create:
                    return
                if end is None:
                    end = _End(spec.key, HIGH, frozenset(spec.cells))
                    self._add(end)
                for c in end.cells:
                    if c not in self._objects:
                        self.used += sizes.get(c, 0)
                        self._objects[c] = sizes.get(c, 0)
                    self._stored.add(c)
                self._go_live(end)
            end.pins += 1
            if end.cls == LOW:
                end.shared = self._has_longer(end)
                self._promote(end)
            else:
                self._rank.touch(end, self._limit)

    def unpinned(self, key: EndKey) -> None:
        with self._lock:
            end = self._ends.get(key)
            if end is not None and end.pins:
                end.pins -= 1

    def garbage(self) -> list[ObjKey]:
        """Objects no end needs (to delete)."""
        with self._lock:
            return self._take_garbage()

    def room(self, nbytes: int, asked: EndKey, owner: str = "") -> tuple[bool, list[ObjKey]]:
        """Make room for `nbytes` a lookup of `asked` may bring up from another tier, as
        a save of it could (`_victims`): (whether they fit, objects to delete now). The
        room is promised to `owner` until `landed(owner)` or `finished(owner)`: other
        lookups in flight at once do not count it free (their objects would find no
        room in L1 when LMCache loads them)."""
        with self._lock:
            short = nbytes - (self._limit - self.used - sum(self._promised.values()))
            ok = short <= 0
            if not ok:
                victims = self._rank.victims(short, HIGH, self.frequency(asked) + 1,
                                             nbytes, self._alone, self._limit)
                for end in victims or ():
                    self._evict(end)
                ok = victims is not None
            if ok and owner:
                self._promised[owner] = nbytes
            return ok, self._take_garbage()

    def landed(self, owner: str) -> None:
        """What `owner`'s lookup brought up is in the tier's account now (`kept`), or
        never will be: its promised room is no longer set apart."""
        with self._lock:
            self._promised.pop(owner, None)

    def hold(self, owner: str, keys: Iterable[ObjKey]) -> None:
        """Keep these objects (in the tier, stored) until `finished(owner)`, whatever
        else is evicted: what a lookup brought up, until it has pinned its hit."""
        with self._lock:
            key = (owner.encode(), -1)
            end = self._ends.get(key)
            cells = frozenset(keys) | (end.cells if end is not None else frozenset())
            if end is not None:
                self._evict(end)
            self._add(_End(key, HIGH, cells, {owner}))
            self._requests.setdefault(owner, set()).add(key)

    def stored_among(self, keys: Iterable[ObjKey]) -> list[ObjKey]:
        """Those of `keys` the account holds as written."""
        with self._lock:
            return [k for k in keys if k in self._stored]

    def tracked(self) -> list[ObjKey]:
        """Every object in the tier by this account."""
        with self._lock:
            return list(self._objects)

    def __contains__(self, key: ObjKey) -> bool:
        """Whether the object is in the tier (or being written) by this account."""
        return key in self._objects

    def clear(self) -> None:
        """Forget everything (the tier was emptied)."""
        with self._lock:
            limit = self._limit
            # Capacity's own (no subclass has another `__init__`): mypy refuses `self.__init__`
            Capacity.__init__(self, self._total, window_share=self._rank.window_share,
                              protected_share=self._rank.protected_share,
                              min_sample=self._rank.min_sample,
                              ties_admit=self._rank.ties_admit)
            self._limit = limit  # the tier still holds what it held untracked

    # -- policy -----------------------------------------------------------------------
    def _alone(self, end: _End, released: dict) -> int:
        """Bytes evicting `end` frees, after the ends already counted in `released`."""
        n = 0
        for c in end.cells:
            released[c] = released.get(c, 0) + 1
            if len(self._users.get(c, ())) <= released[c]:
                n += self._objects.get(c, 0)
        return n

    def _add(self, end: _End) -> None:
        self._ends[end.key] = end
        self._at.setdefault(end.key[0], set()).add(end.key)
        for c in end.cells:
            self._users.setdefault(c, set()).add(end.key)
            self._garbage.discard(c)

    def _go_live(self, end: _End) -> None:
        end.live, end.owners = True, set()
        end.size = self._alone(end, {})
        self._rank.enter(end, self._limit)
        if end.cls == LOW:
            return
        for h in {h for h, _ in end.cells} - {end.key[0]}:
            for key in self._at.get(h, ()):
                older = self._ends[key]
                if older.live and older.cls == HIGH and not older.shared:
                    older.cls = LOW  # superseded: a longer stored end passes through it
                    self._rank.enter(older, self._limit)

    def _has_longer(self, end: _End) -> bool:
        """Whether a live end needs one of this end's last-chunk objects and goes further."""
        h, tokens = end.key
        return any(other.live and other.key[1] > tokens
                   for c in end.cells if c[0] == h
                   for other in (self._ends[k] for k in self._users.get(c, ())))

    def _promote(self, end: _End) -> None:
        end.cls = HIGH
        if end.live:
            self._rank.enter(end, self._limit)

    def _evict(self, end: _End) -> None:
        self._rank.remove(end.key)
        self._ends.pop(end.key, None)
        at = self._at.get(end.key[0])
        if at is not None:
            at.discard(end.key)
            if not at:
                del self._at[end.key[0]]
        for c in end.cells:
            users = self._users.get(c)
            if users is not None:
                users.discard(end.key)
                if not users:
                    del self._users[c]
                    if c in self._objects:
                        self._garbage.add(c)

    def _take_garbage(self) -> list[ObjKey]:
        """The objects to delete; they leave the accounting now (a deletion the tier
        refuses comes back through `kept`)."""
        out = sorted(self._garbage)
        for k in out:
            self.used -= self._objects.pop(k, 0)
            self._stored.discard(k)
        self._garbage.clear()
        return out
