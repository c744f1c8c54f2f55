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
(resolved by :func:`rlflow.system.plugins.resolve` in every program, so it must be importable
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

from rlflow.system import plugins as plugins_lib
from rlflow.config.validation import FALSE_WORDS, TRUE_WORDS

Message = Dict[str, Any]


class EnvError(ValueError):
    """An environment name that is not registered or cannot be imported, or an environment
    that returned something other than the protocol's types (the message names which)."""


class EnvFailureError(RuntimeError):
    """An environment failed ``env.max_consecutive_errors`` times in a row without one
    success: every prompt's factory / ``reset`` (each such prompt is dropped), or every
    ``step`` (each such episode ends with reward 0). A broken environment or data set, not
    a hard episode; the message names the environment, the count and the last error."""


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
    end-of-turn token removed) -> the environment's answer. For a thinking model
    (``data.reasoning_parser``, :mod:`rlflow.data.reasoning`) the message is its answer part
    only, the text after ``</think>``: a tool call drafted while thinking never reaches the
    environment, and a turn whose reasoning never closed ends the episode (reward 0) without
    a ``step``.

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


def bind_options(factory: EnvFactory, options: Dict[str, str],
                 where: str = "env.options") -> Dict[str, Any]:
    """Convert ``key=value`` option strings to the factory's keyword arguments by the types
    its signature annotates: ``int``, ``float``, ``bool`` (``true/false/1/0/yes/no/on/off``,
    any case), ``str`` and ``Optional[...]`` of those (``none`` / ``null`` -> ``None``).
    An option the factory does not take is refused unless it accepts ``**kwargs`` (then the
    string is passed as is).

    Raises:
      EnvError: an option the factory does not take (the message lists the ones it does) or
        a value that does not convert (names the option, the expected type and the value).
    """
    import inspect
    import typing

    sig = inspect.signature(factory)
    try:
        hints = typing.get_type_hints(factory)
    except Exception:  # noqa: BLE001 - unresolvable annotations: pass strings through
        hints = {}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    named = {n: p for n, p in sig.parameters.items()
             if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    named.pop(next(iter(sig.parameters), None), None)     # the record
    out: Dict[str, Any] = {}
    for key, text in options.items():
        if key not in named:
            if takes_any:
                out[key] = text
                continue
            raise EnvError(f"{where}: {key!r} is not an option of this environment; it "
                           f"takes {sorted(named)}")
        out[key] = _convert(text, hints.get(key, str), f"{where}: {key}")
    return out



def _convert(text: str, hint, where: str):
    import typing

    args = typing.get_args(hint)
    if typing.get_origin(hint) is typing.Union and type(None) in args:
        if text.strip().lower() in ("none", "null"):
            return None
        rest = [a for a in args if a is not type(None)]
        hint = rest[0] if len(rest) == 1 else str
    try:
        if hint is bool:
            low = text.strip().lower()
            if low in TRUE_WORDS or low in FALSE_WORDS:
                return low in TRUE_WORDS
            raise ValueError(text)
        if hint in (int, float):
            return hint(text)
    except ValueError:
        raise EnvError(f"{where}: expected {hint.__name__}, got {text!r}") from None
    return text
