"""The environment protocol for multi-turn (agentic) episodes, and its registry.

An *episode* is one sample of a group: the policy writes an assistant message, the
environment answers with new messages (tool results, user turns) or ends the episode, and
so on until the end, a turn limit or a token limit. The reward comes from the environment
(outcome reward per episode); GRPO groups are the ``G`` episodes of one prompt.

An environment is created per episode from a prompt record (the dataset row, a ``dict``)
by a factory registered by name, like rewards (:mod:`rlflow.data.rewards`)::

    @register_environment("guess_digit")
    def make(record: dict, **options) -> Environment: ...   # options: the config's env options

or named ``"package.module:function"`` / ``"path/to/file.py:function"`` in the config
(resolved by :func:`rlflow.plugins.resolve` in every program, so it must be importable
there: a module listed in the top-level ``plugins`` field, or a module path).

Messages are chat-template dicts: ``{"role": "system"|"user"|"assistant"|"tool",
"content": str}`` (the roles the model's chat template renders). The sampler never
re-tokenizes past turns: it keeps the exact ids it sampled and appends the ids of the
environment's new messages rendered by the chat template (``rlflow.envs.chat``).

Environments run in worker processes with a wall-clock timeout (the sampler keeps decoding
other slots meanwhile), so ``reset`` and ``step`` must be side-effect-contained calls whose
results pickle; an exception or a timeout in ``step`` ends the episode with reward 0 and
is counted (``sampler/env_errors``), it never stops the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, runtime_checkable

from rlflow import plugins as plugins_lib

Message = Dict[str, Any]


class EnvError(ValueError):
    """An environment name that is not registered or cannot be imported, or an environment
    that returned something other than the protocol's types (the message names which)."""


@dataclass(frozen=True)
class EnvStep:
    """What :meth:`Environment.step` returns.

    Attributes:
      messages: the new messages to append (tool results, a user turn); empty when ``done``.
      done: the episode ends after this step.
      reward: the episode's outcome reward, read when ``done`` (float; ``None`` means 0.0).
      info: free-form counters for metrics (e.g. ``{"tool_errors": 1}``); numbers only.
        Counts of this step: an episode's counters are their sums over its steps.
    """

    messages: List[Message] = field(default_factory=list)
    done: bool = False
    reward: Optional[float] = None
    info: Dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (created per episode by a registered factory).

    ``reset() -> list[Message]``: the first messages (system / user), rendered with the
    chat template and the generation prompt as the episode's prompt.
    ``step(assistant: str) -> EnvStep``: the policy's last assistant message (decoded text,
    end-of-turn token removed) -> the environment's answer.

    Optional attribute ``tools``: a list of JSON-schema tool descriptions passed to the chat
    template as ``tools=`` for the whole episode (Qwen-style templates render them in the
    system turn); absent or None: no ``tools=``.
    """

    def reset(self) -> List[Message]: ...

    def step(self, assistant: str) -> EnvStep: ...


EnvFactory = Callable[..., Environment]
_REGISTRY: Dict[str, EnvFactory] = {}


def register_environment(name: str):
    """Decorator: register ``factory(record: dict, **options) -> Environment`` as ``name``.

    Raises:
      EnvError: ``name`` is already registered to another factory.
    """

    def wrap(factory: EnvFactory) -> EnvFactory:
        old = _REGISTRY.get(name)
        if old is not None and old is not factory:
            raise EnvError(f"environment {name!r} is already registered "
                                    f"({old.__module__}.{old.__qualname__})")
        _REGISTRY[name] = factory
        return factory

    return wrap


def get_environment(name: str) -> EnvFactory:
    """The factory registered as ``name``, or imported from ``"module:function"`` /
    ``"path/to/file.py:function"``.

    Raises:
      EnvError: unknown name (the message lists the registered ones) or an import
        reference that does not resolve.
    """
    _load_builtin()
    if name in _REGISTRY:
        return _REGISTRY[name]
    if ":" in name:
        try:
            return plugins_lib.resolve(name)
        except Exception as e:  # noqa: BLE001 - re-raised with the name
            raise EnvError(f"environment {name!r}: {e}") from e
    raise EnvError(f"unknown environment {name!r}; registered: {sorted(_REGISTRY)} "
                            f"(or use 'package.module:function')")


def registered_environments() -> List[str]:
    """Names of the registered environments (built-in ones included), sorted."""
    _load_builtin()
    return sorted(_REGISTRY)


#: Modules of the built-in environments, imported on the first registry lookup.
BUILTIN_MODULES = ("rlflow.envs.guess_digit", "rlflow.envs.gsm8k_calculator")


def _load_builtin() -> None:
    import importlib

    for module in BUILTIN_MODULES:
        importlib.import_module(module)
