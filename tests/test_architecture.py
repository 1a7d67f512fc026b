"""The package's layers, as docs/architecture.md draws them: no module imports from a
layer above its own, and LMCache is reached through one adapter package only
(`stores/lmcache/`), by its public names. Its classes meet as objects: none uses an
attribute or method that only another class defines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gemma4_kv"
LAYERS = ["layout", "keys", "stores", "config", "transfer", "lookup", "connector", "tools"]
"""Lowest first: a module may import from its own layer and those before it."""
ADAPTER = "gemma4_kv.stores.lmcache"
"""The adapter package: it and its modules alone import LMCache."""


def in_adapter(module: str) -> bool:
    return module == ADAPTER or module.startswith(ADAPTER + ".")


def modules() -> dict[str, ast.Module]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


def imports(name: str, tree: ast.Module) -> list[tuple[str, int]]:
    """(absolute module, line) of every import in `tree`, relative ones resolved."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = source(name, node)
            out.append((mod, node.lineno))
            out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]
    return out


def source(name: str, node: ast.ImportFrom) -> str:
    """The absolute module a `from ... import` in module `name` imports from."""
    if not node.level:
        return node.module
    package = name.split(".") if name in PACKAGES else name.split(".")[:-1]
    base = package[:len(package) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


MODULES = modules()
PACKAGES = {n for n in MODULES if (PACKAGE.parent / n.replace(".", "/") / "__init__.py").exists()}


def layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] != "gemma4_kv" or len(parts) < 2 or parts[1] not in LAYERS:
        return None
    return LAYERS.index(parts[1])


def test_every_module_sits_in_a_layer():
    loose = [n for n in MODULES if n != "gemma4_kv" and layer(n) is None
             and not n.startswith(("gemma4_kv.model_shapes", "gemma4_kv.kernels"))]
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


STORE_SEAMS = {"gemma4_kv.stores.config", "gemma4_kv.stores.lmcache"}
"""What of `stores/` the settings may import: the store configs with their capabilities,
and the LMCache adapter (which knows what an L2 adapter spec may hold), never a store's
implementation."""


def reaches_into_stores(modules: dict[str, ast.Module]) -> list[str]:
    """`module:line imports x` wherever a `config/` module imports a `stores/` module
    other than `STORE_SEAMS`."""
    return [f"{n}:{line} imports {mod}" for n, tree in modules.items()
            if n.startswith("gemma4_kv.config")
            for mod, line in imports(n, tree)
            if mod.startswith("gemma4_kv.stores.") and mod not in STORE_SEAMS
            and mod.rsplit(".", 1)[0] not in STORE_SEAMS]


def test_config_reads_stores_only_through_their_seams():
    problems = reaches_into_stores(MODULES)
    assert not problems, "\n".join(problems)


def test_the_check_sees_config_reaching_into_a_store():
    """Negative control: a made-up settings module importing the embedded store's module
    (as `config/settings.py` once did for `StoreConfig`) is reported; one importing the
    seams is not."""
    tree = ast.parse("from ..stores.embedded import StoreConfig\n"
                     "from ..stores.config import ServerConfig\n"
                     "from ..stores import lmcache\n")
    assert reaches_into_stores({"gemma4_kv.config.made_up": tree}) == [
        "gemma4_kv.config.made_up:1 imports gemma4_kv.stores.embedded",
        "gemma4_kv.config.made_up:1 imports gemma4_kv.stores.embedded.StoreConfig"]


def _imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=PACKAGE.parent)
    return out.stdout.strip() == "True"


def test_store_configs_import_without_torch():
    """The scheduler half and the settings read a store's config and capabilities without
    opening a store: that module (and the interface it names) needs no torch. Negative
    control: the embedded store's module does."""
    assert not _imports_torch("gemma4_kv.stores.config")
    assert _imports_torch("gemma4_kv.stores.embedded")


def test_lmcache_is_imported_by_the_adapter_only():
    users = sorted({f"{n}:{line}" for n, tree in MODULES.items() if not in_adapter(n)
                    for mod, line in imports(n, tree) if mod.split(".")[0] == "lmcache"})
    assert not users, users


def test_the_adapter_uses_no_private_lmcache_name():
    """No `_name` is imported from LMCache, and no `x._name` is read of anything but the
    adapter's own objects (`self`)."""
    trees = [tree for n, tree in MODULES.items() if in_adapter(n)]
    private = [f"line {node.lineno}: {a.name}" for tree in trees for node in ast.walk(tree)
               if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lmcache")
               for a in node.names if a.name.startswith("_")]
    private += [f"line {node.lineno}: .{node.attr}" for tree in trees for node in ast.walk(tree)
                if isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert not private, private


def raw_wire_uses(modules: dict[str, ast.Module]) -> list[str]:
    """`module:line` wherever a server store module reaches LMCache's request client
    (`ServerWire.client`) instead of the facade's typed methods."""
    return [f"{n}:{node.lineno}" for n, tree in modules.items()
            if n.startswith("gemma4_kv.stores.server")
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr == "client"]


def test_the_server_store_calls_the_server_through_the_facade_only():
    problems = raw_wire_uses(MODULES)
    assert not problems, problems


def test_the_check_sees_a_raw_rpc_call():
    """Negative control: a made-up server module calling LMCache's RPC by name."""
    tree = ast.parse("def f(conn, key):\n    return conn.wire.client.lookup(key, 1)\n")
    assert raw_wire_uses({"gemma4_kv.stores.server.made_up": tree}) == [
        "gemma4_kv.stores.server.made_up:2"]


# -- classes: each uses only what it or its bases define ---------------------------------
PLAIN_BASES = {"object", "ABC", "abc.ABC"}
"""Bases outside the package that give an instance no attributes a subclass might use:
a class with any other outside base (an exception, an enum, a vLLM or msgspec class) is
not checked, since what it inherits cannot be read here."""


def _methods(cls: ast.ClassDef):
    """(method, name of its instance or class argument) of every method not static."""
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.args.args \
                and not any(ast.unparse(d) == "staticmethod" for d in node.decorator_list):
            yield node, node.args.args[0].arg


def _names(target: ast.expr) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for t in target.elts for n in _names(t)]
    return []


def defined(cls: ast.ClassDef) -> set[str]:
    """What `cls` itself defines: class attributes, methods and properties, dataclass
    fields (a bare annotation counts only in a dataclass), and every `self.x` its methods
    assign."""
    dataclass = any("dataclass" in ast.unparse(d) for d in cls.decorator_list)
    out = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.Assign):
            out.update(n for t in node.targets for n in _names(t))
        elif isinstance(node, ast.AnnAssign) and (node.value is not None or dataclass):
            out.update(_names(node.target))
    for method, me in _methods(cls):
        for node in ast.walk(method):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id == me and isinstance(node.ctx, (ast.Store, ast.Del)):
                out.add(node.attr)
    return out


def used(cls: ast.ClassDef) -> list[tuple[str, int]]:
    """(x, line) of every `self.x` (or `cls.x`) its methods read or call."""
    return [(node.attr, node.lineno) for method, me in _methods(cls)
            for node in ast.walk(method)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load)
            and isinstance(node.value, ast.Name) and node.value.id == me
            and not (node.attr.startswith("__") and node.attr.endswith("__"))]


def undefined_uses(modules: dict[str, ast.Module]) -> list[str]:
    """`module.Class:line uses self.x` wherever x is defined neither by the class nor by
    a base of it in the package."""
    found: dict[tuple[str, str], ast.ClassDef] = {}
    for mod, tree in modules.items():
        found.update(((mod, n.name), n) for n in tree.body if isinstance(n, ast.ClassDef))
    bases: dict[tuple[str, str], list] = {}
    for mod, tree in modules.items():
        scope: dict = {name: (mod, name) for m, name in found if m == mod}
        for node in ast.walk(tree):  # a class by its local name, a module by its alias
            if isinstance(node, ast.ImportFrom):
                head = source(mod, node)
                for a in node.names:
                    if (head, a.name) in found:
                        scope[a.asname or a.name] = (head, a.name)
                    elif f"{head}.{a.name}" in modules:
                        scope[a.asname or a.name] = f"{head}.{a.name}"

        def resolve(base: ast.expr):
            """A base as (module, class) in the package, or its source text."""
            base = base.value if isinstance(base, ast.Subscript) else base
            if isinstance(base, ast.Name) and isinstance(scope.get(base.id), tuple):
                return scope[base.id]
            if isinstance(base, ast.Attribute) and isinstance(base.value, ast.Name) \
                    and (scope.get(base.value.id), base.attr) in found:
                return scope[base.value.id], base.attr
            return ast.unparse(base)

        for (m, name), cls in found.items():
            if m == mod:
                bases[(m, name)] = [resolve(b) for b in cls.bases]

    def lineage(key) -> list | None:
        out = [key]
        for b in bases[key]:
            if isinstance(b, str):
                if b not in PLAIN_BASES:
                    return None
                continue
            above = lineage(b)
            if above is None:
                return None
            out += above
        return out

    problems = []
    for key, cls in found.items():
        line = lineage(key)
        if line is None:
            continue
        mine = set().union(*(defined(found[k]) for k in line))
        problems += [f"{key[0]}.{key[1]}:{n} uses self.{attr}"
                     for attr, n in used(cls) if attr not in mine]
    return sorted(set(problems))


def test_no_class_uses_what_only_another_class_defines():
    """A class reads and calls only what it or its bases in the package define: no mixin
    that works on attributes its subclass sets up, no base that calls what only a
    subclass defines. Objects are handed what they need instead."""
    problems = undefined_uses(MODULES)
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_mixin_on_another_class_state():
    """Negative control: a mixin reading `self.foo` and calling `self._bar()`, which only
    the class mixing it in (in another module) defines, is reported, and so is a class
    that reaches its base through the base's module; the class itself, a subclass using
    its base's attributes and a dataclass's fields are not."""
    mixin = ast.parse(
        "from dataclasses import dataclass\n"
        "class Mixin:\n"
        "    def size(self):\n"
        "        return len(self.foo) + self._bar()\n"
        "@dataclass\n"
        "class Record:\n"
        "    n: int\n"
        "    def twice(self):\n"
        "        return 2 * self.n\n")
    store = ast.parse(
        "from . import made_up\n"
        "from .made_up import Mixin as Base\n"
        "class Store(Base):\n"
        "    def __init__(self):\n"
        "        self.foo = []\n"
        "    def _bar(self):\n"
        "        return len(self.foo) + self.size()\n"
        "class Sub(Store):\n"
        "    def more(self):\n"
        "        return self.size() + len(self.foo)\n"
        "class Other(made_up.Mixin):\n"
        "    def more(self):\n"
        "        return self.size() + self.baz\n")
    assert undefined_uses({"gemma4_kv.stores.made_up": mixin,
                           "gemma4_kv.stores.made_up_store": store}) == [
        "gemma4_kv.stores.made_up.Mixin:4 uses self._bar",
        "gemma4_kv.stores.made_up.Mixin:4 uses self.foo",
        "gemma4_kv.stores.made_up_store.Other:13 uses self.baz"]
