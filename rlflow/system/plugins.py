"""User code plugged into rlflow: modules every program imports, and ``module:attr`` names.

rlflow runs as several processes (the launcher, the learner, the sampler, the sampler's
reward workers); each rebuilds the config from JSON and never runs the user's ``--config``
file. User code (a reward function, later environments) therefore reaches every program in
one of two ways, both resolved in each process:

  * ``plugins`` (a top-level config field): modules imported by every program before any
    registry is read, e.g. ``("my_project.rewards", "rewards/extra.py")``. Importing one
    runs its ``@register_reward("name")`` decorators, so ``reward.functions`` may then list
    ``"name"``.
  * a ``module:attr`` name wherever a registry name is accepted, e.g.
    ``reward.functions=("my_project.rewards:score",)``: the module is imported and the
    attribute used directly, no registration needed.

A module is a dotted name importable from ``sys.path`` (the current folder included, as in
``python -m``) or a path to a ``.py`` file (relative to the current folder). Both are checked
when ``rlflow train`` resolves the config, before any program starts
(:func:`rlflow.console.checks.check_runnable`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Sequence


class PluginError(ImportError):
    """A plugin module or ``module:attr`` name cannot be loaded (the message says which)."""


def _is_file(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec


def import_module(spec: str) -> ModuleType:
    """Import ``spec``: a dotted module name or a ``.py`` file path (loaded once per process).

    Raises:
      PluginError: no such module or file, or importing it raised (the message has the cause;
        any exception, ``SystemExit`` included, except ``KeyboardInterrupt``).
    """
    if not _is_file(spec):
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.append(os.getcwd())          # `python -m` semantics for user modules
        try:
            return importlib.import_module(spec)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - SystemExit too: re-raised with the name
            raise PluginError(f"cannot import module {spec!r}: {_what(e)}") from e
    path = os.path.abspath(spec)
    if not os.path.isfile(path):
        raise PluginError(f"plugin file {spec!r} not found (resolved to {path})")
    name = "rlflow_plugin_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except KeyboardInterrupt:
        del sys.modules[name]
        raise
    except BaseException as e:  # noqa: BLE001 - SystemExit too: re-raised with the name
        del sys.modules[name]
        raise PluginError(f"importing plugin file {spec!r} raised {_what(e)}") from e
    return module


def _what(e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return (f"SystemExit({e.code!r}) (a plugin module is imported by every program; it "
                f"must not exit)")
    return f"{type(e).__name__}: {e}"


def import_plugins(specs: Sequence[str]) -> None:
    """Import every module of the ``plugins`` config field, in order.

    Raises:
      PluginError: as :func:`import_module`.
    """
    for spec in specs:
        import_module(spec)


def is_reference(name: str) -> bool:
    """Whether ``name`` is a ``module:attr`` reference rather than a registry name."""
    return ":" in name


def resolve(reference: str) -> Any:
    """The object named by ``"module:attr"`` (``attr`` may be dotted, e.g. ``Class.method``).

    Raises:
      PluginError: malformed reference, the module cannot be imported, or has no such attribute.
    """
    module_spec, _, attr = reference.rpartition(":")
    if not module_spec or not attr:
        raise PluginError(f"{reference!r}: expected 'package.module:name' or 'file.py:name'")
    obj: Any = import_module(module_spec)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PluginError(f"{reference!r}: module {module_spec!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def importable_elsewhere(module_name: str) -> bool:
    """Whether a module loaded here can be loaded by name in another process: not
    ``__main__`` and not a ``--config`` file (``rlflow_config_*``, run by the launcher only)."""
    return module_name != "__main__" and not module_name.startswith("rlflow_config_")
