"""The house rules of docs/architecture.md, read from the source itself (no import needed):

- each library package imports only the packages below it, and none imports ``gradsync.apps``;
- no module uses another module's private name (``from m import _x`` or ``m._x``);
- no module re-exports what a split moved to another module: a module's ``__all__`` lists what
  it defines (a package's ``__init__`` and the public facades ``gradsync.fsdp``,
  ``gradsync.lightning`` and the deprecated ``gradsync.cli`` excepted).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src" / "gradsync"

# What each package of the library may import (besides itself). The order is the layering of
# docs/architecture.md: codecs, collectives, sync, planner, observe, integrate, optim, outer, whatif
# (the simulator follows the outer loop's own schedule rules, gradsync.outer.schedule).
ALLOWED = {
    "codecs": set(),
    "collectives": {"codecs"},
    "sync": {"codecs", "collectives"},
    "planner": {"codecs", "collectives", "sync"},
    "observe": {"collectives", "sync"},
    "integrate": {"codecs", "collectives", "sync", "planner", "observe"},
    "optim": {"codecs", "collectives"},
    "whatif": {"codecs", "collectives", "sync", "planner", "observe", "optim", "units", "outer"},
    "outer": {"codecs", "collectives", "sync", "observe", "integrate", "optim"},
}


LEAVES = ("_native", "version")
"""Modules of the top level that import nothing of gradsync: every layer may read them."""

PACKAGES = {*ALLOWED, "units", "apps"}
"""What ``from gradsync import X`` may name below the facade: a package or module, not one of
the facade's own names (``from gradsync import wrap`` in the library is an arrow back up)."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _imports(tree: ast.AST) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of every gradsync import, at module level or inside functions."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "gradsync":
            found.append((node.module, [a.name for a in node.names], node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "gradsync"]
    return found


def test_each_library_package_imports_only_the_layers_below_it():
    bad = []
    for name, path in _modules().items():
        parts = name.split(".")
        if len(parts) < 2 or parts[1] not in ALLOWED:
            continue
        own = parts[1]
        for module, names, line in _imports(ast.parse(path.read_text())):
            if module == "gradsync" and not names:  # a bare ``import gradsync``: the facade, above all
                bad.append(f"{path.relative_to(SRC)}:{line} imports the gradsync facade")
                continue
            targets = [f"{module}.{n}" for n in names] if module == "gradsync" else [module]
            for target in targets:
                pkg = target.split(".")[1]
                if pkg in (own, *LEAVES):
                    continue
                if module == "gradsync" and pkg not in PACKAGES:  # a name of the facade itself
                    bad.append(f"{path.relative_to(SRC)}:{line} imports {target} from the gradsync facade")
                elif pkg not in ALLOWED[own]:
                    bad.append(f"{path.relative_to(SRC)}:{line} imports {target}")
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_no_module_uses_another_modules_private_names():
    modules = _modules()
    bad = []
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        aliases: dict[str, str] = {}
        for module, names, line in _imports(tree):
            for n in names:
                if n.startswith("_") and not n.startswith("__") and n != "_native" and module != name:
                    bad.append(f"{name}:{line} imports {module}.{n}")
                if f"{module}.{n}" in modules:
                    aliases[n] = f"{module}.{n}"
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    if f"{node.module}.{a.name}" in modules:
                        aliases[a.asname or a.name] = f"{node.module}.{a.name}"
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.asname:
                        aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name)
                and aliases.get(node.value.id, name) != name
            ):
                bad.append(f"{name}:{node.lineno} uses {aliases[node.value.id]}.{node.attr}")
    assert not bad, "private names used across modules:\n" + "\n".join(bad)


def test_the_library_never_imports_the_apps():
    bad = []
    for name, path in _modules().items():
        if name.startswith("gradsync.apps") or name in (
            "gradsync.cli",
            "gradsync.__main__",
        ):
            continue
        for module, names, line in _imports(ast.parse(path.read_text())):
            if module.startswith("gradsync.apps") or (module == "gradsync" and "apps" in names):
                bad.append(f"{name}:{line} imports {module}")
    assert not bad, "the library imports the apps:\n" + "\n".join(bad)


FACADES = {"gradsync.fsdp", "gradsync.lightning", "gradsync.cli"}


def test_no_module_re_exports_what_another_module_defines():
    bad = []
    for name, path in _modules().items():
        if path.name == "__init__.py" or name in FACADES:
            continue
        tree = ast.parse(path.read_text())
        imported = {
            a.asname or a.name
            for node in tree.body
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradsync")
            for a in node.names
        }
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                listed = [e.value for e in getattr(node.value, "elts", []) if isinstance(e, ast.Constant)]
                bad += [f"{name}.__all__ lists {n}, defined elsewhere" for n in listed if n in imported]
    assert not bad, "re-exports:\n" + "\n".join(bad)


def test_old_module_names_are_gone_but_the_cli_module():
    """Names that moved inside the 0.x package are not kept behind an import finder (CHANGELOG.md):
    the old name fails plainly; ``gradsync.cli`` stays, as a module of its own, with a warning."""
    import importlib
    import sys

    import pytest

    import gradsync

    assert not any("Moved" in type(f).__name__ for f in sys.meta_path), "a global import finder"
    for old in ("gradsync.sync.engine", "gradsync.data.cache", "gradsync.bench.world"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(old)
    for name in ("SyncEngine", "Plan"):
        assert not hasattr(gradsync.sync, name)
    sys.modules.pop("gradsync.cli", None)
    with pytest.warns(DeprecationWarning, match="gradsync.cli is deprecated"):
        cli = importlib.import_module("gradsync.cli")
    assert cli.main is importlib.import_module("gradsync.apps.commands").main
