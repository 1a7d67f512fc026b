"""The connector's settings: every `kv_connector_extra_config` key, declared once, checked
at start-up before anything is allocated.

Each key is one field of `ConnectorSettings` with its default, a one-line meaning (the
README table is generated from it: `readme_table()`) and a checker that is strict about
types, because JSON and Python coerce silently: `true` is not 1, `"4"` is not 4, `256.0`
is not 256, NaN is not a size. A bad value raises `SettingsError`, one line that names the
key, what was given and the fix.

`from_extra_config` only parses (it runs in the scheduler, the API server and every worker).
What depends on this host is checked by the worker at start-up: `check_host_resources`
(memory for `cpu_gb`, disk for `disk_gb`; creates `disk_path`) and `check_tiers_reachable`
(a TCP connect to each network tier).
"""

from __future__ import annotations

import copy
import difflib
import json
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields

from ..stores.embedded import StoreConfig

logger = logging.getLogger(__name__)

GiB = 1 << 30
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class SettingsError(ValueError):
    """A `kv_connector_extra_config` value the connector cannot start with."""


def _error(where: str, problem: str, got: str, fix: str) -> SettingsError:
    return SettingsError(f"gemma4-kv: kv_connector_extra_config{where} {problem}: "
                         f"got {got}; fix: {fix}")


class _Bad(Exception):
    """Raised by a checker; `from_extra_config` adds the key's name."""

    def __init__(self, problem: str, fix: str, *, sub: str = "", got=None, shown=None):
        super().__init__(problem)
        self.problem, self.fix, self.sub, self.got, self.shown = problem, fix, sub, got, shown


def _json(v) -> str:
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def _show(v) -> str:
    """A value as the user wrote it (JSON) and its Python type: `"4" (str)`, `true (bool)`."""
    return f"{_json(v)} ({type(v).__name__})"


# -- checkers: value -> normalised value, or raise _Bad --------------------------------

def _integer(minimum: int, maximum: int | None = None) -> Callable:
    span = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"

    def check(v):
        if isinstance(v, bool):
            raise _Bad("must be an integer, not a boolean", f"write a whole number {span}")
        if isinstance(v, float):
            if math.isfinite(v) and v.is_integer():
                raise _Bad("must be an integer", f"write {int(v)} (no decimal point)")
            raise _Bad("must be an integer", f"write a whole number {span}")
        if isinstance(v, str):
            hint = f"drop the quotes: {v.strip()}" if re.fullmatch(r"\s*-?\d+\s*", v) \
                else f"write a whole number {span}, unquoted"
            raise _Bad("must be an integer, not a string", hint)
        if not isinstance(v, int):
            raise _Bad("must be an integer", f"write a whole number {span}")
        if v < minimum or (maximum is not None and v > maximum):
            raise _Bad(f"must be {span}", f"write a whole number {span}")
        return v
    return check


def _number(*, above: float | None = None, at_least: float | None = None) -> Callable:
    span = f"> {above:g}" if above is not None else f">= {at_least:g}"

    def check(v):
        if isinstance(v, bool):
            raise _Bad("must be a number, not a boolean", f"write a number {span}")
        if isinstance(v, str):
            try:
                float(v)
                hint = f"drop the quotes: {v.strip()}"
            except ValueError:
                hint = f"write a number {span}, unquoted"
            raise _Bad("must be a number, not a string", hint)
        if not isinstance(v, (int, float)):
            raise _Bad("must be a number", f"write a number {span}")
        if not math.isfinite(v):
            raise _Bad("must be a finite number", f"write a number {span}")
        if (above is not None and v <= above) or (at_least is not None and v < at_least):
            raise _Bad(f"must be {span}", f"write a number {span}")
        return v
    return check


def _boolean(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        raise _Bad("must be a boolean, not a string", f"drop the quotes: {v.strip().lower()}")
    raise _Bad("must be a boolean", "write true or false")


def _text(*, optional: bool) -> Callable:
    def check(v):
        if v is None and optional:
            return None
        if not isinstance(v, str) or not v.strip():
            what = "a non-empty string" + (" or null" if optional else "")
            raise _Bad(f"must be {what}", "write the name as a quoted string"
                       + (", or leave the key out" if optional else ""))
        return v
    return check


def _choice(options: tuple[str, ...]) -> Callable:
    def check(v):
        if isinstance(v, str) and v in options:
            return v
        close = [o for o in options if isinstance(v, str) and o == v.strip().upper()]
        fix = f'write "{close[0]}"' if close else "write one of " + ", ".join(
            f'"{o}"' for o in options)
        raise _Bad("must be one of " + "/".join(options), fix)
    return check


def _writable_dir(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def _disk_path(v):
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise _Bad("must be a directory path (a string) or null",
                   'write an absolute path such as "/var/cache/gemma4-kv"')
    if not os.path.isabs(v):
        fix = (f'write it in full: "{os.path.expanduser(v)}"' if v.startswith("~")
               else f'write an absolute path, e.g. "{os.path.abspath(v)}"')
        raise _Bad("must be an absolute path (every worker resolves it alike)", fix)
    path = os.path.normpath(v)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise _Bad("is not a directory", "point it at a directory (or a path to create)")
        if not _writable_dir(path):
            raise _Bad("is not writable by this user", f"chmod u+rwx {path} or pick another")
        return path
    parent = os.path.dirname(path)
    if not _writable_dir(parent):
        why = "does not exist" if not os.path.isdir(parent) else "is not writable"
        raise _Bad(f"cannot be created: its parent {parent} {why}",
                   f"mkdir -p {path} first, or pick a path under a writable directory")
    return path


def _stats_file(v):
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise _Bad("must be a file path (a string) or null", 'write a path such as '
                   '"/tmp/gemma4-kv-stats.jsonl", or leave the key out')
    if os.path.isdir(v):
        raise _Bad("is a directory", f'name a file in it, e.g. "{os.path.join(v, "stats.jsonl")}"')
    parent = os.path.dirname(os.path.abspath(v))
    if not _writable_dir(parent):
        why = "does not exist" if not os.path.isdir(parent) else "is not writable"
        raise _Bad(f"cannot be written: its directory {parent} {why}",
                   f"mkdir -p {parent}, or pick a file in a writable directory")
    return v


def _server_url(v):
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip():
        raise _Bad("must be a URL string or null", 'write e.g. "tcp://127.0.0.1:5555", or '
                   "leave the key out")
    m = re.fullmatch(r"tcp://([^:/\s\[\]]+|\[[0-9a-fA-F:]+\]):(\d{1,5})", v.strip())
    if m and 0 < int(m.group(2)) < 65536:
        return v.strip()
    if re.fullmatch(r"[^:/\s]+:\d{1,5}", v.strip()):
        raise _Bad("must name its transport", f'write "tcp://{v.strip()}"')
    raise _Bad("must be tcp://HOST:PORT (the address `lmcache server --host --port` "
               "listens on)", 'write e.g. "tcp://127.0.0.1:5555"')


def server_endpoint(url: str) -> tuple[str, int]:
    """(host, port) of an `lmcache_server` URL (checked by `_server_url`)."""
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    return host.strip("[]"), int(port)


SERVER_TIMEOUT_MAX_S = 1.5
"""`lmcache_server_timeout_s` stays below the scheduler's 2 s wait for a worker rank
(scheduler.RANK_TIMEOUT_S): a lookup that finds the server gone still answers in time."""
SERVER_EXCLUSIVE = ("cpu_gb", "disk_path", "disk_gb", "l2_adapters")
"""Tiers of the embedded store: with `lmcache_server` the server's own tiers serve."""


# -- l2_adapters: each one checked by LMCache's own `lmcache server --l2-adapter` parser --

_EXAMPLE = '[{"type": "valkey", "startup_nodes": "redis.local:6379", "request_timeout": 0.5}]'
_RESP_REFUSED = (
    "LMCache 0.5.6's resp adapter never reconnects after a server restart and keeps only "
    "one group of each chunk for models whose groups differ in object size")
_SECRET = re.compile(r"pass|secret|token|credential|auth", re.I)
_GENERIC_BOOLS = ("shared", "persist_enabled")  # read with bool() by LMCache: "false" is True


def _redacted(spec):
    if isinstance(spec, dict):
        return {k: "***" if isinstance(k, str) and _SECRET.search(k) else _redacted(x)
                for k, x in spec.items()}
    if isinstance(spec, list):
        return [_redacted(x) for x in spec]
    return spec


def _non_finite(v, path: str = "") -> str | None:
    """Where inside `v` a NaN or infinity sits (LMCache's range checks let them through)."""
    if isinstance(v, float) and not math.isfinite(v):
        return path
    items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
    for k, x in items:
        found = _non_finite(x, f"{path}[{_json(k)}]")
        if found is not None:
            return found
    return None


def _l2():
    from lmcache.v1.distributed.l2_adapters import config

    return config


def _adapter_class(type_name: str):
    """LMCache's config class for an adapter type, or _Bad saying why there is none."""
    import importlib
    import importlib.util

    l2 = _l2()
    # LMCache's loader imports every adapter module before this one until the name
    # registers; importing `<type>_l2_adapter` first (its naming rule) saves seconds.
    module = f"{l2.__name__.rsplit('.', 1)[0]}.{type_name.replace('-', '_')}_l2_adapter"
    exists = type_name.replace("-", "_").isidentifier() and importlib.util.find_spec(module)
    if exists:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise _Bad(f'(type "{type_name}") cannot be used here: LMCache\'s adapter module '
                       f"fails to import ({e})",
                       f"install what it needs (pip install {e.name or 'the missing package'})"
                       " or remove this adapter") from None
    try:
        return l2.get_l2_adapter_config_class(type_name)
    except (ImportError, ValueError):
        pass
    known = [t for t in l2.get_registered_l2_adapter_types() if t != "resp"]
    close = ["valkey"] if type_name.lower() == "redis" else \
        difflib.get_close_matches(type_name, known, n=2, cutoff=0.6)
    hint = f'did you mean "{close[0]}"? ' if close else ""
    raise _Bad(f'has an adapter type LMCache does not know: "{type_name}"',
               f"{hint}types available here: {', '.join(known)}")


def _lmcache_parse(spec: dict, type_name: str, config_cls):
    """LMCache's parsed config of one adapter (the `lmcache server --l2-adapter` parser)."""
    import argparse

    l2 = _l2()
    quiet = logging.getLogger(l2.__name__)
    was, quiet.disabled = quiet.disabled, True  # it logs the error and help; we raise them
    try:
        return l2.parse_args_to_l2_adapters_config(argparse.Namespace(
            **{l2._L2_ADAPTER_ARG_DEST: [json.dumps(spec)]})).adapters[0]
    except Exception as e:  # LMCache raises ValueError, and TypeError/KeyError from fields
        msg = re.sub(r"^--l2-adapter #\d+ \([^)]*\): ", "", str(e)) or type(e).__name__
        fields_help = " ".join(config_cls.help().split())
        raise _Bad(f'(type "{type_name}") is rejected by LMCache: {msg}',
                   f"correct that field; {fields_help}") from None
    finally:
        quiet.disabled = was


def _adapter(spec, i: int) -> dict:
    sub = f"[{i}]"
    if not isinstance(spec, dict):
        fix = (f'write {{"type": "{spec}", ...that adapter\'s fields}}' if isinstance(spec, str)
               else f"write each adapter as an object, e.g. {_EXAMPLE[1:-1]}")
        raise _Bad('must be a JSON object with a "type"', fix, sub=sub, got=spec)
    shown = _show(_redacted(spec))
    type_name = spec.get("type")
    if not isinstance(type_name, str) or not type_name:
        raise _Bad('needs a "type" string (the LMCache adapter type)',
                   'add "type": "valkey" (or "fs_native", "p2p", ...)',
                   sub=sub, shown=shown)
    if type_name == "resp":
        raise _Bad(f'(type "resp") is not supported: {_RESP_REFUSED}', _valkey_for(spec),
                   sub=sub, shown=shown)
    where = _non_finite(spec)
    if where is not None:
        raise _Bad(f'(type "{type_name}") holds a NaN or infinity at {where}',
                   "write a finite number", sub=sub, shown=shown)
    for k in _GENERIC_BOOLS:
        if k in spec and not isinstance(spec[k], bool):
            raise _Bad(f'(type "{type_name}") field "{k}" must be true or false '
                       "(LMCache reads any non-empty value as true)",
                       f'write "{k}": true or false, unquoted', sub=sub, shown=shown)
    eviction = spec.get("eviction")
    for k in ("trigger_watermark", "eviction_ratio") if isinstance(eviction, dict) else ():
        x = eviction.get(k, 0.5)
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x <= 1:
            raise _Bad(f'(type "{type_name}") field "eviction"["{k}"] must be a number in '
                       "(0, 1] (LMCache converts it with float() and checks no range)",
                       f'write e.g. "{k}": 0.8', sub=sub, shown=shown)
    try:
        json.dumps(spec, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise _Bad(f'(type "{type_name}") is not JSON ({e})', "use only JSON values",
                   sub=sub, shown=shown) from None
    try:
        config_cls = _adapter_class(type_name)
        _lmcache_parse(spec, type_name, config_cls)
    except _Bad as bad:
        bad.sub, bad.shown = sub, shown
        raise
    return copy.deepcopy(spec)


def _valkey_for(resp: dict) -> str:
    """The fix for a refused `resp` spec: the same server through the `valkey` adapter."""
    host, port = resp.get("host"), resp.get("port")
    node = f"{host}:{port}" if isinstance(host, str) and host and isinstance(port, int) \
        else "HOST:PORT"
    auth = "".join(f', "{k}": ...' for k in ("username", "password") if resp.get(k))
    return (f'use valkey: {{"type": "valkey", "startup_nodes": "{node}", "request_timeout": '
            f'0.5, "connection_timeout": 1.0{auth}}} (the same Redis or Valkey server)')


def _adapters(v):
    if isinstance(v, str):
        try:
            parsed = json.loads(v)
        except ValueError:
            parsed = None
        fix = ("that is JSON text inside a string: give the list itself, unquoted"
               if isinstance(parsed, (list, dict)) else f"write a list of objects, e.g. {_EXAMPLE}")
        raise _Bad("must be a list of JSON objects, not a string", fix)
    if isinstance(v, dict):
        raise _Bad("must be a list of JSON objects", f"wrap the object in a list: [{_json(v)}]",
                   shown=_show(_redacted(v)))
    if not isinstance(v, (list, tuple)):
        raise _Bad("must be a list of JSON objects", f"write e.g. {_EXAMPLE}")
    if v:
        try:
            _l2()
        except ImportError as e:
            raise _Bad(f"needs LMCache, which does not import here ({e})",
                       "pip install 'gemma4-kv[lmcache]'") from None
    return tuple(_adapter(spec, i) for i, spec in enumerate(v))


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
        "size (checked when the layout is known)", _integer(1))
    cpu_gb: float = _key(
        4.0, "GiB of the embedded LMCache CPU tier for the whole engine (pinned when CUDA is "
        "present), LRU eviction; each of N tensor-parallel ranks gets `cpu_gb` / N; "
        "start-up fails if it does not fit in free memory", _number(above=0), shown="4")
    disk_path: str | None = _key(
        None, "absolute path of a local-disk tier (LMCache `fs_native`) behind the CPU tier; "
        "created with mode 0700 if missing (its parent must exist)", _disk_path)
    disk_gb: float = _key(
        0.0, "GiB of the disk tier for the whole engine (`disk_gb` / N per rank), LRU "
        "eviction; 0 = unbounded; needs `disk_path`", _number(at_least=0), shown="0")
    l2_adapters: tuple = _key(
        (), "more LMCache tiers, a list of `lmcache server --l2-adapter` JSON objects: "
        "`valkey` (a Redis or Valkey server shared by engines; `resp` is refused), `fs_native` "
        "on a shared mount with `\"shared\": true`, `p2p`, ...; each checked by LMCache's "
        "parser, network tiers by a connect at start-up",
        _adapters, shown="`[]`")
    num_programs: int = _key(
        32, "SM budget (programs, 1-1024) of the kernel that loads straight from pinned "
        "memory, layer by layer beside the forward", _integer(1, 1024))
    model_id: str | None = _key(
        None, "name of the model in the key fingerprint; set it when one model is served "
        "under several paths", _text(optional=True), shown="vLLM's model path")
    weights_id: str | None = _key(
        None, "identity of the checkpoint's weights in the key fingerprint (default: the "
        "weight files' names, sizes and modification times); set it to share KV between "
        "copies of one checkpoint", _text(optional=True), shown="the weight files' stat")
    stats_file: str | None = _key(
        None, "append one JSON line per lookup, load and save (bytes and blocks per group); "
        "its directory must exist", _stats_file)
    lookup_timeout_s: float = _key(
        2.0, "seconds a lookup may wait for an L2 tier before it gives up on that tier",
        _number(above=0), shown="2")
    retention_interval: int = _key(
        4096, "tokens between stored sliding-window chunks (a multiple of `chunk_size`); "
        "0 = store sliding-window chunks for every chunk", _integer(0))
    staging_mb: int = _key(
        2048, "MiB of GPU memory for staged saves, allocated once per rank outside vLLM's "
        "memory budget (>= 16); saves beyond it write pinned memory directly (slower)",
        _integer(16))
    verify_checksums: bool = _key(
        True, "verify each object's checksum when it comes up from an L2 tier", _boolean)
    save_decode_tokens: bool = _key(
        True, "also store chunks completed by generated (decode) tokens", _boolean)
    lmcache_server: str | None = _key(
        None, "URL (`tcp://HOST:PORT`) of a running `lmcache server` on this host "
        "(LMCache 0.5.6, engine-driven, shared-memory L1) that stores the KV instead of "
        "the embedded tiers, shared by every engine pointed at it; not with `cpu_gb`, "
        "`disk_path`, `disk_gb`, `l2_adapters`; sliding-window chunks are then stored "
        "for every chunk (see \"Sharing one cache\")", _server_url)
    lmcache_server_timeout_s: float = _key(
        1.0, "seconds one call to `lmcache_server` may wait for an answer before the "
        "server counts as down (misses until it answers again); at most "
        f"{SERVER_TIMEOUT_MAX_S:g}", _number(above=0), shown="1")
    lmcache_log_level: str = _key(
        "WARNING", "level of LMCache's own logs (DEBUG/INFO/WARNING/ERROR); its per-request "
        "INFO lines stay out of vLLM's log unless asked", _choice(LOG_LEVELS))

    @classmethod
    def from_extra_config(cls, extra: Mapping | None) -> ConnectorSettings:
        """Parse and check every key (no I/O beyond `stat`; host checks are separate)."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise SettingsError(f"gemma4-kv: kv_connector_extra_config must be a JSON object: "
                                f"got {_show(extra)}; fix: write e.g. {{\"cpu_gb\": 64}}")
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
                except _Bad as bad:
                    got = bad.shown or _show(bad.got if bad.sub else v)
                    fix = bad.fix if v is not None else \
                        f"{bad.fix}, or leave the key out (default {_json(f.default)})"
                    raise _error(f'["{f.name}"]{bad.sub}', bad.problem, got, fix) from None
        if values.get("lmcache_server"):
            values.update(_with_server(values, extra))
        s = cls(**values)
        s._check_together()
        return s

    def _check_together(self) -> None:
        r, c = self.retention_interval, self.chunk_size
        if r % c:
            near = sorted({max(c, r // c * c), (r // c + 1) * c})
            default = " (the default)" if r == _default("retention_interval") else ""
            raise _error('["retention_interval"]', f"must be a multiple of chunk_size ({c}) "
                         "or 0", _show(r) + default,
                         f"set retention_interval to {' or '.join(map(str, near))} (or 0)")
        if self.disk_gb and not self.disk_path:
            raise _error('["disk_gb"]', "sizes a disk tier but disk_path is not set",
                         _show(self.disk_gb), "set disk_path to a directory, or remove disk_gb")
        for i, spec in enumerate(self.l2_adapters):
            base = spec.get("base_path")
            if (self.disk_path and spec["type"] == "fs_native" and isinstance(base, str)
                    and os.path.normpath(base) == self.disk_path):
                raise _error(f'["l2_adapters"][{i}]', "is the same directory as disk_path "
                             "(two tiers would evict each other's files)",
                             _show(_redacted(spec)), "remove this adapter or disk_path")

    @property
    def embedded_store(self) -> bool:
        """The store is LMCache's storage layer in this process (not `lmcache_server`)."""
        return not self.lmcache_server

    def store_config(self, ranks: int = 1) -> StoreConfig:
        """The store of ONE of `ranks` tensor-parallel ranks: `cpu_gb` and `disk_gb` are per
        engine, so each rank gets 1/ranks of them."""
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks must be a positive integer, got {ranks!r}")
        return StoreConfig(cpu_bytes=int(self.cpu_gb * GiB) // ranks,
                           disk_path=self.disk_path, disk_gb=self.disk_gb / ranks,
                           l2_adapters=tuple(copy.deepcopy(self.l2_adapters)),
                           verify_checksums=self.verify_checksums)


def _with_server(values: dict, extra: Mapping) -> dict:
    """What `lmcache_server` changes: no embedded tiers, sliding-window chunks stored for
    every chunk (LMCache 0.5.6 reports only the leading run of stored chunks of each
    group, so a sliding group past an unstored chunk could never hit), and checksums
    always verified (0.5.6 makes a dead client's unfinished writes visible)."""
    url = values["lmcache_server"]
    given = [k for k in SERVER_EXCLUSIVE if k in extra]
    if given:
        raise _error(f'["{given[0]}"]', "cannot be combined with lmcache_server (the "
                     "server's own L1 and L2 tiers store the KV)", _show(extra[given[0]]),
                     f"remove {', '.join(given)}, or remove lmcache_server ({_json(url)}); "
                     "size the server with `lmcache server --l1-size-gb` / `--l2-adapter`")
    r = values.get("retention_interval", 0)
    if "retention_interval" in extra and r != 0:
        raise _error('["retention_interval"]', "must be 0 with lmcache_server: LMCache 0.5.6 "
                     "reports only the leading run of stored chunks of each group, so "
                     "sliding-window chunks are stored for every chunk", _show(r),
                     "remove retention_interval (or write 0)")
    if values.get("verify_checksums") is False:
        raise _error('["verify_checksums"]', "cannot be false with lmcache_server: LMCache "
                     "0.5.6 makes a dead client's unfinished writes visible, so every object "
                     "read from the server is verified", _show(False),
                     "remove verify_checksums")
    t = values.get("lmcache_server_timeout_s", 1.0)
    if t > SERVER_TIMEOUT_MAX_S:
        raise _error('["lmcache_server_timeout_s"]', f"must be at most {SERVER_TIMEOUT_MAX_S:g} "
                     "(the scheduler waits 2 s for a worker rank's lookup answer)", _show(t),
                     f"write a number in (0, {SERVER_TIMEOUT_MAX_S:g}]")
    return {"retention_interval": 0}


def _unknown(unknown: list, known: list[str]) -> SettingsError:
    def fix(k):
        close = difflib.get_close_matches(str(k), known, n=1, cutoff=0.6)
        return f'rename "{k}" to "{close[0]}"' if close else f'remove "{k}"'

    rest = ", ".join(_json(str(k)) for k in unknown[1:])
    others = f" (nor {'is' if len(unknown) == 2 else 'are'} {rest})" if rest else ""
    return _error(f'["{unknown[0]}"]', "is not a key gemma4-kv knows" + others,
                  ", ".join(_json(str(k)) for k in unknown),
                  ", ".join(fix(k) for k in unknown) + "; known keys: " + ", ".join(known))


def _default(name: str):
    return next(f.default for f in fields(ConnectorSettings) if f.name == name)


def readme_table() -> str:
    """The README's `kv_connector_extra_config` table, generated from the declarations."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for f in fields(ConnectorSettings):
        d = f.metadata["shown"]
        if d is None:
            d = "none" if f.default is None else _json(f.default)
            d = d if f.default is None or isinstance(f.default, (int, float)) else f"`{d}`"
        rows.append(f"| `{f.name}` | {d} | {f.metadata['meaning']} |")
    return "\n".join(rows)
