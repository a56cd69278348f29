"""Modules that moved when the library and the apps were put apart (docs/architecture.md).

Importing a module by its old name still works for now: it imports the module at its new place,
under both names, with a ``DeprecationWarning`` that gives the new name. The table maps old
module prefixes to new ones; the longest matching prefix wins.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

MOVED = {
    "gradsync.bench": "gradsync.apps.commands.bench",
    "gradsync.train.launch": "gradsync.apps.commands.train",
    "gradsync.train.loop": "gradsync.apps.train.trainer",
    "gradsync.train": "gradsync.apps.train",
    "gradsync.data": "gradsync.apps.data",
    "gradsync.models": "gradsync.apps.models",
    "gradsync.cluster": "gradsync.apps.cluster",
    "gradsync.whatif_cli": "gradsync.apps.commands.whatif",
    "gradsync.profile_cli": "gradsync.apps.commands.profile",
    "gradsync.trace_cli": "gradsync.apps.commands.trace",
    "gradsync.sync.engine_state": "gradsync.integrate.engine_state",
    "gradsync.sync.engine_costs": "gradsync.planner.engine_costs",
    "gradsync.sync.engine": "gradsync.integrate.engine",
    "gradsync.sync.layout": "gradsync.integrate.engine_layout",
    "gradsync.sync.failure": "gradsync.integrate.engine_failure",
    "gradsync.sync.one_rank": "gradsync.integrate.engine_one_rank",
    "gradsync.sync.planner": "gradsync.planner.decide",
    "gradsync.sync.plan": "gradsync.planner.plan",
    "gradsync.sync.recut": "gradsync.planner.recut",
    "gradsync.sync.closed_loop": "gradsync.planner.closed_loop",
    "gradsync.sync.replan": "gradsync.planner.replan",
    "gradsync.sync.explain": "gradsync.planner.explain",
}


def new_name(old: str) -> str | None:
    """The module's name now, or None if ``old`` did not move."""
    for prefix in sorted(MOVED, key=len, reverse=True):
        if old == prefix or old.startswith(prefix + "."):
            return MOVED[prefix] + old[len(prefix) :]
    return None


class _Loader(importlib.abc.Loader):
    def __init__(self, new: str) -> None:
        self.new = new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{spec.name} is deprecated: it moved to {self.new}", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(self.new)
        sys.modules[spec.name] = module
        return module

    def exec_module(self, module: ModuleType) -> None:
        """The module ran when it was imported under its new name."""


class MovedFinder(importlib.abc.MetaPathFinder):
    """Finds a moved module under its old name (installed once, by ``import gradsync``)."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        new = new_name(fullname) if fullname.startswith("gradsync.") else None
        if new is None:
            return None
        return importlib.machinery.ModuleSpec(fullname, _Loader(new))


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once): an old name inside a moved package
    (``gradsync.data.cache``) would otherwise be found again through the package's new path and
    run a second time as another module."""
    if not any(isinstance(f, MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedFinder())
