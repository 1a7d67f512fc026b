"""L2 adapter specs (what `lmcache server --l2-adapter JSON` accepts): parsed by
LMCache's own parser (`parse_l2_adapters`), and checked for what 0.5.6 gets wrong about
a spec (`check_l2_adapter`) before a tier is built from one.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import json
import logging
import math
import re
from collections.abc import Sequence

from .registration import RESP_TYPE, built_as, built_type, l2_config

def parse_l2_adapters(specs: Sequence[dict]):
    """LMCache's parsed configuration of these adapter specs, through the same argument
    parser as `lmcache server --l2-adapter JSON` (raises what LMCache raises); a `resp`
    spec is built as `RESP_TYPE`."""
    l2 = l2_config()
    parser = l2.add_l2_adapters_args(argparse.ArgumentParser(add_help=False))
    args = parser.parse_args([a for s in specs
                              for a in ("--l2-adapter", json.dumps(built_as(s)))])
    return l2.parse_args_to_l2_adapters_config(args)


def l2_adapter_types() -> list[str]:
    return list(l2_config().get_registered_l2_adapter_types())


def l2_adapter_class(type_name: str):
    """LMCache's config class of an adapter type (ImportError / ValueError if none)."""
    l2 = l2_config()
    type_name = built_type(type_name)
    # LMCache's loader imports every adapter module before this one until the name
    # registers; importing `<type>_l2_adapter` first (its naming rule) saves seconds.
    module = f"{l2.__name__.rsplit('.', 1)[0]}.{type_name.replace('-', '_')}_l2_adapter"
    if type_name.replace("-", "_").isidentifier() and importlib.util.find_spec(module):
        importlib.import_module(module)
    return l2.get_l2_adapter_config_class(type_name)


class L2AdapterRejected(ValueError):
    """An adapter spec that cannot be used here: what is wrong (`problem`) and what to
    write instead (`fix`), phrased for the user (the settings add where it sits)."""

    def __init__(self, problem: str, fix: str):
        super().__init__(problem)
        self.problem, self.fix = problem, fix


_ONE_TENSOR_SERDES = ("fp8", "turboquant")
"""LMCache 0.5.6 serdes whose serializer reads an object as one tensor: on our objects
(KV and checksum trailer) it raises, so every store into that tier fails."""
_GENERIC_BOOLS = ("shared", "persist_enabled")  # read with bool() by LMCache: "false" is True


def check_l2_adapter(spec: dict) -> None:
    """Refuse an adapter spec (a JSON object) that LMCache 0.5.6's own parser rejects,
    that it would misread (values it coerces or checks no range of), or whose tier would
    store nothing of ours; raises `L2AdapterRejected`. Needs LMCache only for a spec
    that passes gemma4-kv's own checks."""
    type_name = spec.get("type")
    if not isinstance(type_name, str) or not type_name:
        raise L2AdapterRejected('needs a "type" string (the LMCache adapter type)',
                                'add "type": "valkey" (or "fs_native", "p2p", ...)')
    serde = spec.get("serde")
    serde_type = serde.get("type") if isinstance(serde, dict) else None
    if serde_type in _ONE_TENSOR_SERDES:
        raise L2AdapterRejected(
            f'(type "{type_name}") field "serde" (type "{serde_type}") cannot be used: '
            f"LMCache 0.5.6's {serde_type} serde reads an object as one tensor, and "
            "gemma4-kv's objects carry their checksum trailer as a second one: every "
            "store into this tier fails, so nothing is ever stored (and a lossy copy "
            "could not pass the checksum)", 'remove "serde"')
    if serde_type == "gemma4_kv":
        raise L2AdapterRejected(
            f'(type "{type_name}") field "serde" (type "gemma4_kv") is set by l2_codec, '
            "which also puts the codec in the key fingerprint", 'remove "serde" and set '
            '"l2_codec" instead')
    where = _non_finite(spec)
    if where is not None:
        raise L2AdapterRejected(f'(type "{type_name}") holds a NaN or infinity at {where}',
                                "write a finite number")
    for k in _GENERIC_BOOLS:
        if k in spec and not isinstance(spec[k], bool):
            raise L2AdapterRejected(f'(type "{type_name}") field "{k}" must be true or '
                                    "false (LMCache reads any non-empty value as true)",
                                    f'write "{k}": true or false, unquoted')
    eviction = spec.get("eviction")
    if isinstance(eviction, dict):
        for k in ("trigger_watermark", "eviction_ratio"):
            x = eviction.get(k, 0.5)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not 0 < x <= 1:
                raise L2AdapterRejected(
                    f'(type "{type_name}") field "eviction"["{k}"] must be a number in '
                    "(0, 1] (LMCache converts it with float() and checks no range)",
                    f'write e.g. "{k}": 0.8')
    try:
        json.dumps(spec, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise L2AdapterRejected(f'(type "{type_name}") is not JSON ({e})',
                                "use only JSON values") from None
    _parsed(spec, type_name)


def l2_adapter_endpoints(spec: dict) -> tuple[list[tuple[str, int]], bool]:
    """(host, port) pairs a checked network adapter spec connects to, as LMCache parses
    them, and whether one reachable pair is enough (a Valkey cluster finds the rest from
    any seed); ([], True) for a tier that is not on the network."""
    kind = spec.get("type")
    if kind == "resp":
        cfg = _parsed(spec, kind)
        return [(cfg.host, cfg.port)], False
    if kind != "valkey":
        return [], True
    cfg = _parsed(spec, kind)
    if cfg.cluster_mode:
        return list(cfg.startup_nodes), True
    return list(cfg.startup_nodes[:1]), False  # standalone Valkey uses the first node only


def _parsed(spec: dict, type_name: str):
    """LMCache's parsed config of one adapter (the `lmcache server --l2-adapter`
    parser), or `L2AdapterRejected` with LMCache's reason and its help for the fields."""
    config_cls = _adapter_class(type_name)
    quiet = logging.getLogger(l2_config().__name__)
    was, quiet.disabled = quiet.disabled, True  # it logs the error and help; we raise them
    try:
        return parse_l2_adapters([spec]).adapters[0]
    except Exception as e:  # LMCache raises ValueError, and TypeError/KeyError from fields
        msg = re.sub(r"^--l2-adapter #\d+ \([^)]*\): ", "", str(e)) or type(e).__name__
        fields_help = " ".join(config_cls.help().split())
        raise L2AdapterRejected(f'(type "{type_name}") is rejected by LMCache: {msg}',
                                f"correct that field; {fields_help}") from None
    finally:
        quiet.disabled = was


def _adapter_class(type_name: str):
    """LMCache's config class for an adapter type, or `L2AdapterRejected` saying why
    there is none."""
    try:
        return l2_adapter_class(type_name)
    except ImportError as e:
        raise L2AdapterRejected(
            f'(type "{type_name}") cannot be used here: LMCache\'s adapter module fails '
            f"to import ({e})", f"install what it needs (pip install "
            f"{e.name or 'the missing package'}) or remove this adapter") from None
    except ValueError:
        pass
    known = [t for t in l2_adapter_types() if t != RESP_TYPE]
    close = ["valkey"] if type_name.lower() == "redis" else \
        difflib.get_close_matches(type_name, known, n=2, cutoff=0.6)
    hint = f'did you mean "{close[0]}"? ' if close else ""
    raise L2AdapterRejected(f'has an adapter type LMCache does not know: "{type_name}"',
                            f"{hint}types available here: {', '.join(known)}")


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


def _json(v) -> str:
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)
