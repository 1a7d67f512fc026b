"""The connector's settings: every `kv_connector_extra_config` key, declared once, checked
at start-up before anything is allocated.

Each key is one field of `ConnectorSettings` with its default, a one-line meaning (the
README table is generated from it: `readme.readme_table`) and a checker (`checks`). A bad
value raises `SettingsError`, one line that names the key, what was given and the fix.

`from_extra_config` only parses (it runs in the scheduler, the API server and every
worker). What depends on this host is checked by the worker at start-up (`host_checks`).
"""

from __future__ import annotations

import copy
import difflib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from ..stores.config import ServerConfig, StoreConfig
from .checks import (Bad, SettingsError, adapters, boolean, choice, disk_path, error, integer,
                     fraction, json_text, number, redacted, server_url, show, stats_file,
                     text)

GiB = 1 << 30
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
CODECS = ("none", "lossless", "cachegen")

SERVER_EXCLUSIVE = ("cpu_gb", "disk_path", "disk_gb", "l2_adapters", "l2_codec",
                    "l2_codec_frame", "l2_codec_bits", "l2_codec_device")
"""Tiers of the embedded store: with `lmcache_server` the server's own tiers serve."""


def server_endpoint(url: str) -> tuple[str, int]:
    """(host, port) of an `lmcache_server` URL (checked by `checks.server_url`)."""
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    return host.strip("[]"), int(port)


# -- the keys -------------------------------------------------------------------------

def _key(default, meaning: str, check: Callable, shown: str | None = None):
    """One `kv_connector_extra_config` key: default, README meaning, checker."""
    return field(default=default, metadata={"meaning": meaning, "check": check,
                                            "shown": shown})


@dataclass(frozen=True)
class ConnectorSettings:
    """Validated `kv_connector_extra_config`; build it with `from_extra_config`."""

    chunk_size: int = _key(
        256, "tokens per stored chunk (LMCache's default); a multiple of every group's block "
        "size (checked when the layout is known)", integer(1))
    cpu_gb: float = _key(
        4.0, "GiB of the embedded LMCache CPU tier for the whole engine (pinned when CUDA is "
        "present); when full it keeps whole hits, ranked by how often they are asked "
        "(W-TinyLFU, see \"Full tier\"); each of N tensor-parallel ranks gets `cpu_gb` / N; "
        "start-up fails if it does not fit in free memory", number(above=0), shown="4")
    disk_path: str | None = _key(
        None, "absolute path of a local-disk tier (LMCache `fs_native`) behind the CPU tier; "
        "created with mode 0700 if missing (its parent must exist)", disk_path)
    disk_gb: float = _key(
        0.0, "GiB of the disk tier for the whole engine (`disk_gb` / N per rank), LRU "
        "eviction; 0 = unbounded; needs `disk_path`", number(at_least=0), shown="0")
    l2_adapters: tuple = _key(
        (), "more LMCache tiers, a list of `lmcache server --l2-adapter` JSON objects: "
        "`resp` or `valkey` (a Redis or Valkey server shared by engines; `resp` is LMCache's "
        "C++ client, reconnected and split by value size by gemma4-kv), `fs_native` "
        "on a shared mount with `\"shared\": true`, `p2p`, ...; each checked by LMCache's "
        "parser, network tiers by a connect at start-up; the `fp8` and `turboquant` `serde` "
        "are refused (they store nothing of ours)",
        adapters, shown="`[]`")
    l2_codec: str = _key(
        "none", "how objects are stored in every L2 tier (`disk_path`, `l2_adapters`): "
        "`none` as they are; `lossless` byte-shuffled and zstd-compressed in a frame with "
        "its own checksum, loads bit-identical; `cachegen` quantized against anchor "
        "tokens (`l2_codec_bits`), lossy and bounded, outputs may change (see \"What the "
        "codec changes\"); part of the key fingerprint; needs an L2 tier", choice(CODECS))
    l2_codec_frame: float = _key(
        0.9, "fraction of an object's size its stored frame takes under `l2_codec` (LMCache "
        "0.5.6's tiers load only values of one fixed size per object layout): an object "
        "that does not compress into it is not stored in L2; in (0, 1], part of the key "
        "fingerprint", fraction, shown="0.9")
    l2_codec_bits: int = _key(
        4, "bits per coded KV change under `l2_codec: cachegen` (2-8; anchors keep 8): fewer "
        "bits, smaller frames and larger error (its bound: half a scale step per element); "
        "part of the key fingerprint", integer(2, 8))
    l2_codec_device: str = _key(
        "auto", "where `l2_codec: cachegen` encodes and decodes: `auto` on the engine's GPU "
        "where it has one (the object's bytes go up, the frame's come down), `cpu` on the "
        "CPU; both write the same bytes, so it is not part of the key", choice(("auto", "cpu")))
    num_programs: int = _key(
        32, "SM budget (programs, 1-1024) of the kernel that loads straight from pinned "
        "memory, layer by layer beside the forward", integer(1, 1024))
    model_id: str | None = _key(
        None, "name of the model in the key fingerprint; set it when one model is served "
        "under several paths", text(optional=True), shown="vLLM's model path")
    weights_id: str | None = _key(
        None, "identity of the checkpoint's weights in the key fingerprint (default: a "
        "sha256 of the files vLLM loads, once per file version and host, in the background, "
        "cached in ~/.cache/gemma4-kv; see \"Which requests are cached\"); set it to skip "
        "that hash, and give every other checkpoint another id", text(optional=True),
        shown="the weight files' content")
    stats_file: str | None = _key(
        None, "append one JSON line per lookup, load and save (bytes and blocks per group); "
        "its directory must exist", stats_file)
    lookup_timeout_s: float = _key(
        2.0, "seconds a lookup waits for an L2 tier (twice a fetch's expected time if that "
        "is longer), never longer than the measured prefill time of what it would add",
        number(above=0), shown="2")
    retention_interval: int = _key(
        4096, "tokens between the intermediate hit ends whose sliding-window chunks may be "
        "stored (a multiple of `chunk_size`); 0 = every chunk end", integer(0))
    intermediate_ends: str = _key(
        "branched", "which intermediate ends (`retention_interval`) get their sliding-window "
        "chunks stored: `branched` once a second prompt shares the prefix up to there and "
        "then goes on differently (a third one hits), `always` for every prompt", choice(
            ("branched", "always")))
    staging_mb: int = _key(
        2048, "MiB of GPU memory for staged saves, allocated once per rank outside vLLM's "
        "memory budget (>= 16); saves beyond it write pinned memory directly (slower)",
        integer(16))
    verify_checksums: bool = _key(
        True, "verify each object's checksum when it comes up from an L2 tier", boolean)
    save_decode_tokens: bool = _key(
        True, "also store chunks completed by generated (decode) tokens", boolean)
    lmcache_server: str | None = _key(
        None, "URL (`tcp://HOST:PORT`) of a running `lmcache server` on this host "
        "(LMCache 0.5.6, engine-driven, shared-memory L1) that stores the KV instead of "
        "the embedded tiers, shared by every engine pointed at it; not with `cpu_gb`, "
        "`disk_path`, `disk_gb`, `l2_adapters`; generated tokens are then not stored "
        "(see \"Sharing one cache\")", server_url)
    lmcache_server_timeout_s: float = _key(
        1.0, "seconds one call to `lmcache_server` may wait for an answer before the "
        "server counts as down (misses until it answers again); at most "
        f"{ServerConfig.TIMEOUT_MAX_S:g}", number(above=0), shown="1")
    lmcache_server_read_ttl_s: int = _key(
        300, "the `lmcache server`'s read-lock lifetime (`--l1-read-ttl-seconds`, 300 by "
        "default); at most what the server was started with: a hit is offered to a load "
        "only in the first half of it and pinned again after", integer(2), shown="300")
    lmcache_log_level: str = _key(
        "WARNING", "level of LMCache's own logs (DEBUG/INFO/WARNING/ERROR); its per-request "
        "INFO lines stay out of vLLM's log unless asked", choice(LOG_LEVELS))

    @classmethod
    def from_extra_config(cls, extra: Mapping | None) -> ConnectorSettings:
        """Parse and check every key (no I/O beyond `stat`; host checks are separate)."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise SettingsError(f"gemma4-kv: kv_connector_extra_config must be a JSON object: "
                                f"got {show(extra)}; fix: write e.g. {{\"cpu_gb\": 64}}")
        known = [f.name for f in fields(cls)]
        unknown = [k for k in extra if k not in known]
        if unknown:
            raise _unknown(unknown, known)
        values = {}
        for f in fields(cls):
            if f.name in extra:
                v = extra[f.name]
                try:
                    values[f.name] = f.metadata["check"](v)
                except Bad as bad:
                    got = bad.shown or show(bad.got if bad.sub else v)
                    fix = bad.fix if v is not None else \
                        f"{bad.fix}, or leave the key out (default {json_text(f.default)})"
                    raise error(f'["{f.name}"]{bad.sub}', bad.problem, got, fix) from None
        if values.get("lmcache_server"):
            _check_server(values, extra)
        s = cls(**values)
        s._check_together()
        return s

    def _check_together(self) -> None:
        r, c = self.retention_interval, self.chunk_size
        if r % c:
            near = sorted({max(c, r // c * c), (r // c + 1) * c})
            default = " (the default)" if r == _default("retention_interval") else ""
            raise error('["retention_interval"]', f"must be a multiple of chunk_size ({c}) "
                         "or 0", show(r) + default,
                         f"set retention_interval to {' or '.join(map(str, near))} (or 0)")
        if self.disk_gb and not self.disk_path:
            raise error('["disk_gb"]', "sizes a disk tier but disk_path is not set",
                         show(self.disk_gb), "set disk_path to a directory, or remove disk_gb")
        for i, spec in enumerate(self.l2_adapters):
            base = spec.get("base_path")
            if (self.disk_path and spec["type"] == "fs_native" and isinstance(base, str)
                    and os.path.normpath(base) == self.disk_path):
                raise error(f'["l2_adapters"][{i}]', "is the same directory as disk_path "
                             "(two tiers would evict each other's files)",
                             show(redacted(spec)), "remove this adapter or disk_path")

        self._check_codec()

    def _check_codec(self) -> None:
        """`l2_codec` needs a tier to encode for, and a tier holds one serde: a spec
        with its own `serde` cannot take the codec's."""
        if self.l2_codec == "none":
            return
        if not self.disk_path and not self.l2_adapters:
            raise error('["l2_codec"]', "encodes what L2 tiers store, and there is none",
                         show(self.l2_codec), 'set disk_path or l2_adapters, or write "none"')
        for i, spec in enumerate(self.l2_adapters):
            if "serde" in spec:
                raise error(f'["l2_adapters"][{i}]', 'has its own "serde", and l2_codec '
                             "would be a second (LMCache runs one per tier)",
                             show(redacted(spec)), 'remove "serde", or set l2_codec to "none"')

    @property
    def embedded_store(self) -> bool:
        """The store is LMCache's storage layer in this process (not `lmcache_server`)."""
        return not self.lmcache_server

    def store_config(self, ranks: int = 1) -> StoreConfig | ServerConfig:
        """The store of ONE of `ranks` tensor-parallel ranks: the server's, or the embedded
        one, of which `cpu_gb` and `disk_gb` are per engine (each rank gets 1/ranks)."""
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
        if self.lmcache_server:
            return ServerConfig(self.lmcache_server, self.lmcache_server_timeout_s,
                                self.retention_interval, self.lmcache_server_read_ttl_s)
        return StoreConfig(cpu_bytes=int(self.cpu_gb * GiB) // ranks,
                           disk_path=self.disk_path, disk_gb=self.disk_gb / ranks,
                           l2_adapters=tuple(copy.deepcopy(self.l2_adapters)),
                           verify_checksums=self.verify_checksums,
                           codec=self.l2_codec, codec_frame=self.l2_codec_frame,
                           codec_bits=self.l2_codec_bits,
                           codec_device=self.l2_codec_device)


def _check_server(values: dict, extra: Mapping) -> None:
    """What `lmcache_server` excludes: the embedded tiers, turning verification off where
    the server's store verifies every object (`StoreCapabilities.verifies_always`), and
    a call timeout beyond `ServerConfig.TIMEOUT_MAX_S`."""
    url = values["lmcache_server"]
    given = [k for k in SERVER_EXCLUSIVE if k in extra]
    if given:
        raise error(f'["{given[0]}"]', "cannot be combined with lmcache_server (the "
                     "server's own L1 and L2 tiers store the KV)", show(extra[given[0]]),
                     f"remove {', '.join(given)}, or remove lmcache_server ({json_text(url)}); "
                     "size the server with `lmcache server --l1-size-gb` / `--l2-adapter`")
    if values.get("verify_checksums") is False and ServerConfig.CAPABILITIES.verifies_always:
        raise error('["verify_checksums"]', "cannot be false with lmcache_server: LMCache "
                     "0.5.6 makes a dead client's unfinished writes visible, so every object "
                     "read from the server is verified", show(False),
                     "remove verify_checksums")
    t, most = values.get("lmcache_server_timeout_s", 1.0), ServerConfig.TIMEOUT_MAX_S
    if t > most:
        raise error('["lmcache_server_timeout_s"]', f"must be at most {most:g} "
                     "(the scheduler waits 2 s for a worker rank's lookup answer)", show(t),
                     f"write a number in (0, {most:g}]")


def _unknown(unknown: list, known: list[str]) -> SettingsError:
    def fix(k):
        close = difflib.get_close_matches(str(k), known, n=1, cutoff=0.6)
        return f'rename "{k}" to "{close[0]}"' if close else f'remove "{k}"'

    rest = ", ".join(json_text(str(k)) for k in unknown[1:])
    others = f" (nor {'is' if len(unknown) == 2 else 'are'} {rest})" if rest else ""
    return error(f'["{unknown[0]}"]', "is not a key gemma4-kv knows" + others,
                  ", ".join(json_text(str(k)) for k in unknown),
                  ", ".join(fix(k) for k in unknown) + "; known keys: " + ", ".join(known))


def _default(name: str):
    return next(f.default for f in fields(ConnectorSettings) if f.name == name)
