"""The package's layers, as docs/architecture.md draws them: no module imports from a
layer above its own, and LMCache is reached through one adapter module only
(`stores/lmcache.py`), by its public names."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gemma4_kv"
LAYERS = ["layout", "keys", "stores", "config", "transfer", "lookup", "connector", "tools"]
"""Lowest first: a module may import from its own layer and those before it."""
ADAPTER = "gemma4_kv.stores.lmcache"


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def imports(name: str, tree: ast.Module) -> list[tuple[str, int]]:
    """(absolute module, line) of every import in `tree`, relative ones resolved."""
    package = name.split(".") if name in PACKAGES else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.append((mod, node.lineno))
            out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]
    return out


MODULES = modules()
PACKAGES = {n for n in MODULES if (PACKAGE.parent / n.replace(".", "/") / "__init__.py").exists()}


def layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "gemma4_kv" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def test_every_module_sits_in_a_layer():
    loose = [n for n in MODULES if n != "gemma4_kv" and layer(n) is None
             and not n.startswith(("gemma4_kv.configs", "gemma4_kv.kernels"))]
    assert not loose, f"modules outside the layers: {loose}"


def test_no_module_imports_from_a_layer_above_its_own():
    upward = []
    for name, tree in MODULES.items():
        mine = layer(name)
        for mod, line in imports(name, tree):
            theirs = layer(mod)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{name}:{line} imports {mod}")
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import():
    """Negative control: the same check on a made-up module of the stores layer that
    imports the connector."""
    tree = ast.parse("from ..connector.metadata import Gemma4KVMetadata\n")
    found = [m for m, _ in imports("gemma4_kv.stores.made_up", tree)
             if layer(m) is not None and layer(m) > layer("gemma4_kv.stores.made_up")]
    assert found == ["gemma4_kv.connector.metadata",
                     "gemma4_kv.connector.metadata.Gemma4KVMetadata"]


def test_lmcache_is_imported_by_the_adapter_only():
    users = sorted({f"{n}:{line}" for n, tree in MODULES.items() if n != ADAPTER
                    for mod, line in imports(n, tree) if mod.split(".")[0] == "lmcache"})
    assert not users, users


def test_the_adapter_uses_no_private_lmcache_name():
    """No `_name` is imported from LMCache, and no `x._name` is read of anything but the
    adapter's own objects (`self`)."""
    tree = MODULES[ADAPTER]
    private = [f"line {node.lineno}: {a.name}" for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lmcache")
               for a in node.names if a.name.startswith("_")]
    private += [f"line {node.lineno}: .{node.attr}" for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert not private, private
