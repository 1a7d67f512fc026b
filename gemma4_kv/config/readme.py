"""The README's `kv_connector_extra_config` table, generated from the declarations in
`settings` (a test keeps the README equal to it)."""

from __future__ import annotations

from dataclasses import fields

from .checks import json_text
from .settings import ConnectorSettings


def readme_table() -> str:
    """The README's `kv_connector_extra_config` table, generated from the declarations."""
    rows = ["| key | default | meaning |", "| --- | --- | --- |"]
    for f in fields(ConnectorSettings):
        d = f.metadata["shown"]
        if d is None:
            d = "none" if f.default is None else json_text(f.default)
            d = d if f.default is None or isinstance(f.default, (int, float)) else f"`{d}`"
        rows.append(f"| `{f.name}` | {d} | {f.metadata['meaning']} |")
    return "\n".join(rows)
