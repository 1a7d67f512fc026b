"""Checkers of `kv_connector_extra_config` values: each takes what the user wrote and
returns the value to use, or raises `Bad` (problem, fix), to which `settings` adds the
key's name. They are strict about types, because JSON and Python coerce silently:
`true` is not 1, `"4"` is not 4, `256.0` is not 256, NaN is not a size. L2 adapter specs
are checked by LMCache's own `lmcache server --l2-adapter` parser (`stores.lmcache`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from collections.abc import Callable

from ..stores import lmcache


class SettingsError(ValueError):
    """A `kv_connector_extra_config` value the connector cannot start with."""


def error(where: str, problem: str, got: str, fix: str) -> SettingsError:
    return SettingsError(f"gemma4-kv: kv_connector_extra_config{where} {problem}: "
                         f"got {got}; fix: {fix}")


class Bad(Exception):
    """Raised by a checker; `from_extra_config` adds the key's name."""

    def __init__(self, problem: str, fix: str, *, sub: str = "", got=None, shown=None):
        super().__init__(problem)
        self.problem, self.fix, self.sub, self.got, self.shown = problem, fix, sub, got, shown


def json_text(v) -> str:
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


def show(v) -> str:
    """A value as the user wrote it (JSON) and its Python type: `"4" (str)`, `true (bool)`."""
    return f"{json_text(v)} ({type(v).__name__})"


# -- checkers: value -> normalised value, or raise Bad --------------------------------

def integer(minimum: int, maximum: int | None = None) -> Callable:
    span = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"

    def check(v):
        if isinstance(v, bool):
            raise Bad("must be an integer, not a boolean", f"write a whole number {span}")
        if isinstance(v, float):
            if math.isfinite(v) and v.is_integer():
                raise Bad("must be an integer", f"write {int(v)} (no decimal point)")
            raise Bad("must be an integer", f"write a whole number {span}")
        if isinstance(v, str):
            hint = f"drop the quotes: {v.strip()}" if re.fullmatch(r"\s*-?\d+\s*", v) \
                else f"write a whole number {span}, unquoted"
            raise Bad("must be an integer, not a string", hint)
        if not isinstance(v, int):
            raise Bad("must be an integer", f"write a whole number {span}")
        if v < minimum or (maximum is not None and v > maximum):
            raise Bad(f"must be {span}", f"write a whole number {span}")
        return v
    return check


def number(*, above: float | None = None, at_least: float | None = None) -> Callable:
    span = f"> {above:g}" if above is not None else f">= {at_least:g}"

    def check(v):
        if isinstance(v, bool):
            raise Bad("must be a number, not a boolean", f"write a number {span}")
        if isinstance(v, str):
            try:
                float(v)
                hint = f"drop the quotes: {v.strip()}"
            except ValueError:
                hint = f"write a number {span}, unquoted"
            raise Bad("must be a number, not a string", hint)
        if not isinstance(v, (int, float)):
            raise Bad("must be a number", f"write a number {span}")
        if not math.isfinite(v):
            raise Bad("must be a finite number", f"write a number {span}")
        if (above is not None and v <= above) or (at_least is not None and v < at_least):
            raise Bad(f"must be {span}", f"write a number {span}")
        return v
    return check


def fraction(v):
    """A number in (0, 1]."""
    v = number(above=0)(v)
    if v > 1:
        raise Bad("must be at most 1", "write a number in (0, 1], e.g. 0.9")
    return float(v)


def boolean(v):
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        raise Bad("must be a boolean, not a string", f"drop the quotes: {v.strip().lower()}")
    raise Bad("must be a boolean", "write true or false")


def text(*, optional: bool) -> Callable:
    def check(v):
        if v is None and optional:
            return None
        if not isinstance(v, str) or not v.strip():
            what = "a non-empty string" + (" or null" if optional else "")
            raise Bad(f"must be {what}", "write the name as a quoted string"
                       + (", or leave the key out" if optional else ""))
        return v
    return check


def choice(options: tuple[str, ...]) -> Callable:
    def check(v):
        if isinstance(v, str) and v in options:
            return v
        close = [o for o in options if isinstance(v, str) and o == v.strip().upper()]
        fix = f'write "{close[0]}"' if close else "write one of " + ", ".join(
            f'"{o}"' for o in options)
        raise Bad("must be one of " + "/".join(options), fix)
    return check


def _writable_dir(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def disk_path(v):
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise Bad("must be a directory path (a string) or null",
                   'write an absolute path such as "/var/cache/gemma4-kv"')
    if not os.path.isabs(v):
        fix = (f'write it in full: "{os.path.expanduser(v)}"' if v.startswith("~")
               else f'write an absolute path, e.g. "{os.path.abspath(v)}"')
        raise Bad("must be an absolute path (every worker resolves it alike)", fix)
    path = os.path.normpath(v)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise Bad("is not a directory", "point it at a directory (or a path to create)")
        if not _writable_dir(path):
            raise Bad("is not writable by this user", f"chmod u+rwx {path} or pick another")
        return path
    parent = os.path.dirname(path)
    if not _writable_dir(parent):
        why = "does not exist" if not os.path.isdir(parent) else "is not writable"
        raise Bad(f"cannot be created: its parent {parent} {why}",
                   f"mkdir -p {path} first, or pick a path under a writable directory")
    return path


def stats_file(v):
    if v is None:
        return None
    if not isinstance(v, str) or not v:
        raise Bad("must be a file path (a string) or null", 'write a path such as '
                   '"/tmp/gemma4-kv-stats.jsonl", or leave the key out')
    if os.path.isdir(v):
        raise Bad("is a directory", f'name a file in it, e.g. "{os.path.join(v, "stats.jsonl")}"')
    parent = os.path.dirname(os.path.abspath(v))
    if not _writable_dir(parent):
        why = "does not exist" if not os.path.isdir(parent) else "is not writable"
        raise Bad(f"cannot be written: its directory {parent} {why}",
                   f"mkdir -p {parent}, or pick a file in a writable directory")
    return v


def server_url(v):
    if v is None:
        return None
    if not isinstance(v, str) or not v.strip():
        raise Bad("must be a URL string or null", 'write e.g. "tcp://127.0.0.1:5555", or '
                   "leave the key out")
    m = re.fullmatch(r"tcp://([^:/\s\[\]]+|\[[0-9a-fA-F:]+\]):(\d{1,5})", v.strip())
    if m and 0 < int(m.group(2)) < 65536:
        return v.strip()
    if re.fullmatch(r"[^:/\s]+:\d{1,5}", v.strip()):
        raise Bad("must name its transport", f'write "tcp://{v.strip()}"')
    raise Bad("must be tcp://HOST:PORT (the address `lmcache server --host --port` "
               "listens on)", 'write e.g. "tcp://127.0.0.1:5555"')


# -- l2_adapters: each spec checked by `stores.lmcache` (LMCache's own parser) ----------

_EXAMPLE = '[{"type": "valkey", "startup_nodes": "redis.local:6379", "request_timeout": 0.5}]'
_SECRET = re.compile(r"pass|secret|token|credential|auth", re.I)


def redacted(spec):
    if isinstance(spec, dict):
        return {k: "***" if isinstance(k, str) and _SECRET.search(k) else redacted(x)
                for k, x in spec.items()}
    if isinstance(spec, list):
        return [redacted(x) for x in spec]
    return spec


def _adapter(spec, i: int) -> dict:
    sub = f"[{i}]"
    if not isinstance(spec, dict):
        fix = (f'write {{"type": "{spec}", ...that adapter\'s fields}}' if isinstance(spec, str)
               else f"write each adapter as an object, e.g. {_EXAMPLE[1:-1]}")
        raise Bad('must be a JSON object with a "type"', fix, sub=sub, got=spec)
    try:
        lmcache.check_l2_adapter(spec)
    except lmcache.L2AdapterRejected as e:
        raise Bad(e.problem, e.fix, sub=sub, shown=show(redacted(spec))) from None
    return copy.deepcopy(spec)


def adapters(v):
    if isinstance(v, str):
        try:
            parsed = json.loads(v)
        except ValueError:
            parsed = None
        fix = ("that is JSON text inside a string: give the list itself, unquoted"
               if isinstance(parsed, (list, dict)) else f"write a list of objects, e.g. {_EXAMPLE}")
        raise Bad("must be a list of JSON objects, not a string", fix)
    if isinstance(v, dict):
        raise Bad("must be a list of JSON objects", f"wrap the object in a list: [{json_text(v)}]",
                   shown=show(redacted(v)))
    if not isinstance(v, (list, tuple)):
        raise Bad("must be a list of JSON objects", f"write e.g. {_EXAMPLE}")
    if v:
        try:
            lmcache.l2_adapter_types()
        except ImportError as e:
            raise Bad(f"needs LMCache, which does not import here ({e})",
                       "pip install 'gemma4-kv[lmcache]'") from None
    return tuple(_adapter(spec, i) for i, spec in enumerate(v))
