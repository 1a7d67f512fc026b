"""Transfer statistics in vLLM's own metrics: the "KV Transfer metrics" log line and
Prometheus counters (`KVConnectorStats`, `KVConnectorPromMetrics`).

Each worker rank counts its loads, saves and lookups in a `Gemma4KVStats`; vLLM
collects them every step (`get_kv_connector_stats`), sums them over ranks
(`aggregate`), ships the `data` dict to the front-end, rebuilds it there
(`build_kv_connector_stats`) and logs `reduce()` or feeds `Gemma4KVPromMetrics`.
All values are plain counters, so summing is the whole aggregation.
"""

from __future__ import annotations

import json
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats)

COUNTERS = {
    # name: (Prometheus help text, unit shown in the log line or None)
    "load_bytes": ("Bytes of KV loaded from the store into vLLM's cache", "GB"),
    "load_blocks": ("Blocks loaded (all layers of a group)", None),
    "load_seconds": ("GPU time of loads, first copy to last", "s"),
    "save_bytes": ("Bytes of KV stored from vLLM's cache", "GB"),
    "save_blocks": ("Blocks stored (all layers of a group)", None),
    "saves": ("Save jobs started (copies of a step's chunks into the store)", None),
    "saves_committed": ("Save jobs whose objects the store has made visible", None),
    "saves_failed": ("Save jobs the store failed (nothing of them stored; the engine "
                     "goes on)", None),
    "lookups": ("Lookups answered by a worker rank", None),
    "lookup_seconds": ("Time spent answering lookups", "s"),
    "hit_tokens": ("Tokens of the hits pinned for vLLM", None),
    "hit_tokens_l2": ("Hit tokens brought up from an L2 tier", None),
    "rejected_objects": ("Objects from an L2 tier that failed verification", None),
    "hung_l2_prefetches": ("L2 prefetches given up unanswered (their locks released)", None),
    "evicted_objects": ("Objects the CPU tier deleted to make room or as unservable", None),
    "lookups_unanswered": ("Lookups a worker rank did not answer in time (misses)", None),
    "l2_waits_given_up": ("Lookups that stopped waiting for an L2 fetch past its budget",
                          None),
    "l2_fetches_not_worth_it": ("L2 fetches not asked for: slower than recomputing", None),
    "l2_lookups_paused": ("Lookups that skipped L2 during a pause after repeated give-ups",
                          None),
    "cold_launches": ("Kernel launches of a signature the start-up warm-up did not compile "
                      "(the first of each compiles in a request's time)", None),
    # in microseconds: vLLM's LLM.get_metrics() reads counters as integers
    "scheduler_us": ("Host time of the scheduler half in vLLM's calls, microseconds", None),
    "scheduler_steps": ("Steps the scheduler half planned", None),
    "worker_us": ("Host time of a worker rank in vLLM's calls, microseconds", None),
    "worker_steps": ("Steps a worker rank ran", None),
}
STEP_KINDS = {"plain": "neither load nor save", "load": "load (and may save)",
              "save": "save and do not load"}
"""Steps by what the connector does in them (`step_kind`)."""
for _half in ("scheduler", "worker"):
    for _kind, _what in STEP_KINDS.items():
        COUNTERS[f"{_half}_us_{_kind}"] = (
            f"Host time of the {_half} half in steps that {_what}, microseconds", None)
        COUNTERS[f"{_half}_steps_{_kind}"] = (f"Steps that {_what}, of the {_half} half",
                                               None)
PER_GROUP = ("load_bytes", "save_bytes")


def step_kind(meta) -> str:
    """What the connector does in the step of `meta` (`STEP_KINDS`)."""
    return "load" if meta.loads else "save" if meta.saves else "plain"


@dataclass
class Gemma4KVStats(KVConnectorStats):
    """Counters of one interval; keys are `COUNTERS` names and `<name>.g<group>`."""

    data: dict[str, Any] = field(default_factory=dict)
    """vLLM's `KVConnectorStats.data`, restated with its type (vLLM is followed as Any)."""

    def __post_init__(self):
        self._lock = threading.Lock()

    def add(self, name: str, value: float, group: int | None = None) -> None:
        with self._lock:
            self.data[name] = self.data.get(name, 0) + value
            if group is not None and name in PER_GROUP:
                key = f"{name}.g{group}"
                self.data[key] = self.data.get(key, 0) + value

    def lookup(self, tokens: int, from_l2: int, seconds: float) -> None:
        self.add("lookups", 1)
        self.add("lookup_seconds", seconds)
        self.add("hit_tokens", tokens)
        self.add("hit_tokens_l2", from_l2)

    def take(self) -> Gemma4KVStats | None:
        """The counters so far (None if there are none), and start a new interval."""
        with self._lock:
            data, self.data = self.data, {}
        return Gemma4KVStats(data=data) if data else None

    def reset(self) -> None:
        with self._lock:
            self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in other.data.items():
            self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {}
        for name, (_, unit) in COUNTERS.items():
            value = d.get(name, 0)
            if not value:
                continue
            if unit == "GB":
                out[name.replace("_bytes", "_GB")] = round(value / 1e9, 3)
            else:
                out[name] = round(value, 3) if unit == "s" else int(value)
        if d.get("load_seconds"):
            out["load_GB_per_s"] = round(d.get("load_bytes", 0) / d["load_seconds"] / 1e9, 2)
        for half in ("scheduler", "worker"):
            for suffix in ("", *(f"_{k}" for k in STEP_KINDS)):
                if d.get(f"{half}_steps{suffix}"):
                    out[f"{half}_ms_per{suffix}_step"] = round(
                        d.get(f"{half}_us{suffix}", 0) / 1e3 / d[f"{half}_steps{suffix}"], 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())

    def __getstate__(self):
        return {"data": self.data}

    def __setstate__(self, state):
        self.data = state["data"]
        self._lock = threading.Lock()


class Gemma4KVPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per `COUNTERS` entry, `vllm:gemma4_kv_<name>_total`."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {}
        for name, (doc, _) in COUNTERS.items():
            counter = self._counter_cls(name=f"vllm:gemma4_kv_{name}", documentation=doc,
                                        labelnames=labelnames)
            self._counters[name] = {i: counter.labels(*values)
                                    for i, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, children in self._counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                children[engine_idx].inc(value)


class StatsFile:
    """Optional JSON lines, one per layout, lookup, load and save, with blocks and bytes
    per group (`stats_file`: tests, the demo and benchmarks read them)."""

    def __init__(self, path: str | None, layout, rank: int):
        self.path, self.layout, self.rank = path, layout, rank

    def _write(self, line: dict) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(json.dumps(line) + "\n")

    def layout_event(self, fingerprint: str) -> None:
        self._write({"event": "layout", "rank": self.rank, "fingerprint": fingerprint,
                     "groups": [dict(kind=g.kind.value, window=g.window,
                                     block_size=g.block_size, layers=list(g.layers),
                                     aliases=[a for a, _ in g.aliases])
                                for g in self.layout.groups]})

    def __call__(self, event: str, req_id: str, start: int, end: int, plan,
                 t0: float = 0.0, seconds: float | None = None) -> None:
        if not self.path:
            return
        per_group: defaultdict[int, list[int]] = defaultdict(lambda: [0, 0])
        for cb in plan:
            g = self.layout.groups[cb.group_id]
            per_group[cb.group_id][0] += len(cb.block_ids)
            per_group[cb.group_id][1] += len(cb.block_ids) * g.page_bytes * len(g.layers)
        self._write({"event": event, "rank": self.rank, "req_id": req_id, "start": start,
                     "end": end,
                     "seconds": time.perf_counter() - t0 if seconds is None else seconds,
                     "groups": {gid: {"blocks": b, "bytes": n}
                                for gid, (b, n) in per_group.items()}})
