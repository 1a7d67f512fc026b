"""The embedded store's slower tiers: what a lookup asks LMCache's L2 adapters (disk,
Redis/Valkey, ...) for, and how what comes up is verified before it may be offered.

An L2 lookup is an LMCache prefetch (`start_prefetch` / `poll`), never waited for. What it
loads is verified against its trailer as it lands (`integrity.py`), on the threads of a
`verifier.Verifier`, never on the lookup thread; a bad object is dropped from every tier and
never offered again by this process. Until a prefetch settles, the objects it may bring up
are not offered at all (`_maybe_untrusted`), and those L1 held when it started stay
read-locked, so they cannot be evicted and come up again unverified. A prefetch whose tasks
have not answered within `L2_TASK_LIMIT_S` (a stuck NFS mount under `fs_native`, a tier that
stopped answering) is given up: its locks go at once, and what it may still bring up is
verified when first offered (`_unverified`); past `MAX_HUNG` of those the tier counts as
down. `L2Prefetches` owns that state (each prefetch's own in `l2_prefetch.py`);
`embedded.EmbeddedStore` holds one and asks it what L1 may offer. It never touches the
store's account (`capacity.Capacity`): what the account must learn (a prefetch landed,
objects failed verification, a lookup is done) it returns as decisions
(`l2_prefetch.Decision`), which the store applies.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence

from ..layout.groups import AttentionKind, KVLayout
from ..layout.plan import hit_chunks, window_chunks
from ..layout import integrity
from .base import ChunkKey, Prefetch
from .l2_prefetch import (Check, Decision, L2Prefetch, Landed, Rejected, Round, Rounds,
                          Settled, Stage)
from .lmcache import StorageLayer
from .verifier import Entry, Verifier

logger = logging.getLogger(__name__)

L2_TASK_LIMIT_S = 30.0
"""A prefetch still unanswered this long after it started is given up (LMCache keeps a
task's read locks for 300 s): lookups wait for L2 for a few seconds at most, so nothing
waits on it any more, and what it holds is needed by saves and other hits."""
MAX_HUNG = 64
"""Given-up prefetches kept (polled until their tasks answer, to unlock what they lock
then). At this many the tier counts as down (`tier_up`): no prefetch is asked until
some answer, so a tier that stays stuck costs bounded memory and polling, and none is
ever forgotten with its LMCache locks still to release."""
HUNG_POLL_BATCH = 8
"""Given-up prefetches whose tasks one `poll` asks LMCache about, in turn: a poll runs
before every lookup, on the lookup thread, and a stuck tier should not slow it down."""


class L2Prefetches(Rounds):
    """The embedded store's L2 reads and their state: prefetches in flight or given up,
    and the keys of L1 they leave untrusted, bad or unverified. It is handed L1 (`tier`),
    the objects' layouts and sizes per group and the rank whose keys it builds; every
    call that names objects takes the store's current `namespace`. The store asks it
    what L1 may offer (`resident`, `withheld`), tells it what left L1, and applies the
    decisions it returns. Objects a prefetch brought up are verified by its `Verifier`,
    off the lookup thread. Lookup thread, but for `stored` and `left_l1`, which the
    store's writes call from the model thread: the sets they change are changed only
    under `_marks`."""

    def __init__(self, tier: StorageLayer, layout: KVLayout, chunk_size: int, *,
                 layouts: dict[int, object], sizes: dict[int, int], kv_rank: int = 0,
                 verify: bool = True):
        self._tier = tier
        self._layout, self._chunk_size = layout, chunk_size
        self._layouts, self._bytes = layouts, sizes
        self._kv_rank, self._verify = kv_rank, verify
        self._groups = [g.group_id for g in layout.groups]
        self._windows = {g.group_id: window_chunks(g, chunk_size) for g in layout.groups}
        self._full = [g.group_id for g in layout.groups if g.kind is AttentionKind.FULL]
        self._inflight: list = []  # prefetches not settled yet (lookup thread)
        self._maybe_untrusted: Counter = Counter()  # keys an unsettled prefetch may load
        self._bad: set = set()  # keys whose L2 copy failed verification
        self._hung: deque = deque()  # given up, tasks unanswered; polled in turn
        self._hung_keys: Counter = Counter()  # what those may still bring up from L2
        self._unverified: set = set()  # keys a given-up prefetch may bring up unverified
        self._marks = threading.Lock()
        """Guards every change to `_bad`, `_unverified` and `_hung_keys`, which the
        model thread's writes change too (`stored`, `left_l1`); held for no I/O.
        Membership tests read them without it (one atomic lookup)."""
        self._verifier = Verifier()
        self._decided: list[Decision] = []  # of the call running; returned by it

    def _key(self, chunk_hash: bytes, gid: int, namespace: str):
        return self._tier.key(chunk_hash, namespace, self._kv_rank, gid)

    def _take(self) -> list[Decision]:
        out, self._decided = self._decided, []
        return out

    # -- what L1 may offer ------------------------------------------------------------
    def resident(self, chain: Sequence[bytes],
                 namespace: str) -> tuple[dict[int, set[int]], list[Decision]]:
        """Per group id, the chunk indices whose object sits in L1 and may be offered
        (not possibly brought up by an unverified prefetch, not known bad); and what
        verifying objects a given-up prefetch brought up decided."""
        return self._resident(chain, namespace), self._take()

    def _resident(self, chain: Sequence[bytes], namespace: str) -> dict[int, set[int]]:
        out = {}
        rows = [(gid, [self._key(h, gid, namespace) for h in chain], self._layouts[gid])
                for gid in self._groups]
        for (gid, keys, _), present in zip(rows, self._tier.resident_rows(rows)):
            if self._unverified:
                self._check_unverified(gid, keys, present)
            out[gid] = {i for i in present if keys[i] not in self._maybe_untrusted
                        and keys[i] not in self._bad and keys[i] not in self._unverified} \
                if self._withholds() else set(present)
        return out

    def withheld(self, keys) -> bool:
        """Whether any of these keys may not be offered: a prefetch may still bring it
        up, its L2 copy failed verification, or it awaits verification."""
        return self._withholds() and any(
            k in self._maybe_untrusted or k in self._bad or k in self._unverified
            for k in keys)

    def _withholds(self) -> bool:
        """Whether any key is withheld at all: if none, a lookup skips hashing each of
        its keys (ObjectKey hashes are not cached) against empty sets."""
        return bool(self._maybe_untrusted or self._bad or self._unverified)

    def is_bad(self, key) -> bool:
        """Whether the key's L2 copy failed verification (never offered again)."""
        return key in self._bad

    def stored(self, keys) -> None:
        """Fresh copies of these keys were written: they replace ones that failed or
        awaited verification."""
        with self._marks:
            self._bad.difference_update(keys)
            self._unverified.difference_update(keys)

    def left_l1(self, keys) -> None:
        """Keys deleted from L1: a given-up prefetch still running may bring them back
        from L2 unverified, so they are verified again before they are offered."""
        with self._marks:
            if self._hung_keys:
                self._unverified.update(k for k in keys if k in self._hung_keys)

    def l1_cleared(self) -> None:
        """L1 was emptied: everything a given-up prefetch may bring back is unverified."""
        with self._marks:
            hung = list(self._hung_keys)
        self.left_l1(hung)

    def reset(self) -> None:
        """The store moved to a new generation: keys of the old one are never looked up
        again, so none awaits verification."""
        with self._marks:
            self._unverified.clear()

    def counts(self) -> dict[str, int]:
        """What it tracks, for health snapshots: prefetches in flight and given up, keys
        withheld until a prefetch settles, known bad, awaiting verification."""
        return {"inflight": len(self._inflight),
                "untrusted": sum(self._maybe_untrusted.values()), "bad": len(self._bad),
                "hung": len(self._hung), "unverified": len(self._unverified)}

    def tier_up(self) -> bool:
        """Whether to ask L2 at all: not while `MAX_HUNG` prefetches are given up
        unanswered (the tier is stuck; lookups answer from L1 until some answer)."""
        return len(self._hung) < MAX_HUNG

    # -- reads: L2 --------------------------------------------------------------------
    def start_prefetch(self, chain: Sequence[bytes], start: int, limit: int,
                       namespace: str, owner: str, ask: bool) -> Prefetch:
        """Ask the L2 tiers for the longest prefix of `chain` they can serve, without
        waiting: LMCache loads what it needs into L1 (each sliding group only its window
        before each chunk end). Without `ask` (the store has no room for it: it made the
        room, set apart for `owner`, first) nothing is asked: it is finished at once."""
        p = L2Prefetch(time.monotonic(), chain=tuple(chain), start=start, limit=limit,
                       namespace=namespace, owner=owner,
                       stage=Stage.FETCHING if ask else Stage.DONE, finished=not ask)
        if ask:
            p.ask(self, [([(gid, list(chain)) for gid in self._groups], "prefix")],
                  namespace)
            self._inflight.append(p)
        return p

    def in_flight(self) -> bool:
        return bool(self._inflight)

    def poll(self, namespace: str) -> list[Decision]:
        """Move every prefetch on (`L2Prefetch.advance`): verify what it loaded from L2,
        drop what fails, release its locks (also of prefetches whose lookup gave up
        waiting). LMCache's prefix fetch serves chunk ends: a hit ending inside a chunk
        may need one more window chunk, and an object that failed leaves a shorter hit
        that needs other window chunks; up to two targeted rounds follow (`next_fetch`).
        Given-up prefetches are asked about `HUNG_POLL_BATCH` at a time, the longest
        unasked first (each within `MAX_HUNG / HUNG_POLL_BATCH` polls). Returns what the
        store's account must learn, in order."""
        now = time.monotonic()
        for _ in range(min(HUNG_POLL_BATCH, len(self._hung))):
            p = self._hung.popleft()
            p.advance(self, now, namespace, L2_TASK_LIMIT_S)
            if p.stage is Stage.GIVEN_UP:
                self._hung.append(p)
        for p in self._inflight:
            p.advance(self, now, namespace, L2_TASK_LIMIT_S)
        self._inflight = [p for p in self._inflight
                          if p.stage in (Stage.FETCHING, Stage.VERIFYING)]
        return self._take()

    # -- `Rounds`: what a prefetch asks of its holder ------------------------------------
    def submit(self, tasks: list, namespace: str) -> Round:
        planned = [(policy, [(gid, hs, [self._key(h, gid, namespace) for h in hs])
                             for gid, hs in rows])
                   for rows, policy in tasks]
        keys = [k for _, rows in planned for _, _, ks in rows for k in ks]
        held = [ks[i] for _, rows in planned for gid, _, ks in rows
                for i in self._tier.resident(gid, ks, self._layouts[gid], True)]
        before = set(held)
        untrusted = [k for k in keys if k not in before]
        self._maybe_untrusted.update(untrusted)
        submitted = []
        for policy, rows in planned:
            handle = self._tier.prefetch(
                [(gid, ks, self._layouts[gid], self._windows[gid] if policy == "prefix"
                  else -1) for gid, _, ks in rows], policy)
            submitted.append((handle, rows))
        return Round(submitted, held, untrusted)

    def outcome(self, handle) -> object | None:
        return self._tier.prefetch_outcome(handle)

    def can_verify(self) -> bool:
        return self._verifier.has_room()

    def give_up(self, job: L2Prefetch, held: list, untrusted: list) -> None:
        """Stop waiting for a prefetch whose tasks do not answer: its read locks go, and
        everything its tasks may still bring up into L1 is verified before it is offered.
        That is every key it asked for, those L1 held when it started too: LMCache may
        not have started it yet (8 run at once, more wait in its queue), so a held key
        evicted meanwhile is looked up and loaded from L2 when it does. Until its tasks
        answer, a key of it that leaves L1 is marked again (`left_l1`). Its tasks are
        still polled: what they lock when they answer is unlocked then."""
        self._tier.unlock(held)
        self._decided.append(Landed(job.owner, gave_up=True))  # what lands later: untracked
        with self._marks:
            self._unverified.update(job.hung_keys)
            self._hung_keys.update(job.hung_keys)
        self._maybe_untrusted.subtract(untrusted)
        self._maybe_untrusted += Counter()
        self._hung.append(job)
        logger.warning("gemma4-kv: an L2 prefetch did not answer within %.0f s (a stuck "
                       "tier or mount?): given up, its locks released; what it brings up "
                       "later is verified before use", L2_TASK_LIMIT_S)

    def hung_answered(self, job: L2Prefetch) -> None:
        """Unlock what a given-up prefetch's tasks locked, now that they answered."""
        self._tier.unlock([keys[i] for (_, rows), result in zip(job.tasks, job.results)
                           for row, (_, _, keys) in enumerate(rows)
                           for i in result.hit[row]])
        with self._marks:
            self._hung_keys.subtract(job.hung_keys)
            self._hung_keys += Counter()  # drop zero counts

    def _check_unverified(self, gid: int, keys: list, present: list[int]) -> None:
        """Verify the objects among `keys[present]` (in L1) that a given-up prefetch may
        have brought up: a good one is offered from now on, a bad one is dropped."""
        todo = [i for i in present if keys[i] in self._unverified]
        if not todo:
            return
        subset = [keys[i] for i in todo]
        locked = [subset[i]
                  for i in self._tier.resident(gid, subset, self._layouts[gid], True)]
        try:
            verdict = {k: self._verified(k, k.chunk_hash, gid) for k in locked}
        finally:
            self._tier.unlock(locked)
        bad = [k for k, ok in verdict.items() if ok is False]
        with self._marks:
            self._unverified.difference_update(k for k, ok in verdict.items() if ok)
        if bad:
            self._drop_bad(bad)

    def _drop_bad(self, bad: list) -> None:
        with self._marks:
            self._bad.update(bad)
            self._unverified.difference_update(bad)
        self._tier.delete_everywhere(bad)
        self._decided.append(Rejected(tuple((k.chunk_hash, k.object_group_id) for k in bad)))
        logger.warning("gemma4-kv: %d object(s) from an L2 tier failed verification "
                       "(corrupt, truncated or foreign): dropped, recomputed instead",
                       len(bad))

    def next_fetch(self, p: L2Prefetch, namespace: str) -> list[ChunkKey]:
        """What L1 lacks of the longest hit (at most `p.limit`) still within reach: one
        whose full-attention chunks L1 holds (the prefix fetch brought every one L2 had)
        and none of whose objects is known bad or was asked for in vain. Nothing if that
        hit is servable already."""
        resident = self._resident(p.chain, namespace)
        c = self._chunk_size
        for end in sorted({p.limit} | set(range(c, p.limit, c)), reverse=True):
            if end <= p.start:
                break
            cells = hit_chunks(self._layout, p.start, end, c)
            if any(ch not in resident[g] for g, ch in cells if g in self._full):
                continue
            keys = [(p.chain[ch], g) for g, ch in cells if ch not in resident[g]]
            if any(k in p.asked or self.is_bad(self._key(*k, namespace)) for k in keys):
                continue
            return keys
        return []

    def check(self, p: L2Prefetch) -> Check:
        """Hand what the prefetch's tasks brought up to the verifier: the hit's objects
        loaded from L2 (locked by the tasks), and strays, objects it brought into L1 but
        left out of the hit it reports (LMCache keeps them there unlocked, e.g. those
        past a value that failed to load, which ends a prefix): locked here, so none is
        deleted while it is read. All stay locked and withheld until `settle`."""
        locked, items, held = [], [], set(p.held)
        strays: dict[int, list] = {}  # group id -> (key, chunk hash) left out of the hit
        for (_, rows), result in zip(p.tasks, p.results):
            for row, (gid, hashes, keys) in enumerate(rows):
                loaded = set(result.from_l2[row])
                for i in result.hit[row]:
                    locked.append(keys[i])  # as submitted: the namespace may have changed
                    if i in loaded:
                        items.append((keys[i], hashes[i], gid, False))
                hit = set(result.hit[row])
                strays.setdefault(gid, []).extend(
                    (keys[i], hashes[i]) for i in range(len(keys))
                    if i not in hit and keys[i] not in held)
        stray_keys = []
        for gid, pairs in strays.items():
            keys = [k for k, _ in pairs]
            for i in self._tier.resident(gid, keys, self._layouts[gid], True):
                stray_keys.append(keys[i])
                items.append((keys[i], pairs[i][1], gid, True))
        batch = self._verifier.submit([self._object(k, h, gid) for k, h, gid, _ in items])
        return Check(locked, stray_keys, items, batch)

    def settle(self, p: L2Prefetch, namespace: str) -> Settled:
        """Take the verdicts of a prefetch's objects (its check is done): the good ones
        are kept and offered, the bad dropped everywhere; every lock it held goes."""
        check, bad = p.verifying, []  # `advance` settles a prefetch while VERIFYING
        landed: dict[ChunkKey, int] = {}
        stray_landed: dict[ChunkKey, int] = {}
        for (key, h, gid, stray), ok in zip(check.items, check.batch.result()):
            if ok:
                (stray_landed if stray else landed)[(h, gid)] = self._bytes[gid]
            elif ok is False:
                bad.append(key)
            else:  # not verified: verified again before it is ever offered
                with self._marks:
                    self._unverified.add(key)
        if p.namespace == namespace:
            # Tracked from now on: the hit's objects are held for the lookup's pin (if
            # it still waits), what no hit needs is deleted (strays at once).
            self._decided.append(Landed(p.owner, kept=(*landed, *stray_landed),
                                        held=() if p.done_with else tuple(landed)))
        else:
            self._decided.append(Landed(p.owner))
        self._tier.unlock(check.locked + check.strays)
        self._tier.unlock(p.held)
        if bad:
            self._drop_bad(bad)
        self._maybe_untrusted.subtract(p.untrusted)
        self._maybe_untrusted += Counter()  # drop zero counts
        return Settled(landed, len(bad))

    def _object(self, key, chunk_hash: bytes, gid: int) -> Entry:
        """The object in L1 as the verifier takes it, (KV, trailer, key value); True if
        nothing is verified, False if it is gone, None if reading it raised (it is then
        verified again before it is ever offered: `_unverified`)."""
        if not self._verify:
            return True
        try:
            obj = self._tier.read([key]).get(key)
        except Exception as e:  # noqa: BLE001 - LMCache's read failed: not offered yet
            logger.warning("gemma4-kv: reading an object to verify it failed (%s); it is "
                           "not offered until it verifies", e)
            with self._marks:
                self._unverified.add(key)
            return None
        if obj is None:
            return False
        return obj.kv, obj.trailer, integrity.key64(key.model_name, chunk_hash, gid)

    def _verified(self, key, chunk_hash: bytes, gid: int) -> bool | None:
        """Whether the object in L1 matches its trailer, verified here, at once (see
        `_object`)."""
        obj = self._object(key, chunk_hash, gid)
        return integrity.verify(*obj) if isinstance(obj, tuple) else obj

    def finish_prefetch(self, prefetch: Prefetch) -> list[Decision]:
        """The lookup is done with this prefetch (it pinned its hit, or gave up): what it
        brought up and no hit holds goes (`Done`)."""
        return [prefetch.finish()] if isinstance(prefetch, L2Prefetch) else []

    def close(self) -> None:
        """Stop verifying (after the verifications running end)."""
        self._verifier.close()
