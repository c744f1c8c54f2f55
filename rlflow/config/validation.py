"""The config error type and the small checks every section's ``__post_init__`` uses."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and the allowed values."""


def _check(ok: bool, where: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{where}: {msg}")


def _positive(value, where: str) -> None:
    _check(value > 0, where, f"must be > 0, got {value!r}")


def _timeout(value, where: str) -> None:
    """A timeout in seconds: finite and > 0 (an infinite one would let one hung call, peer
    or replica stall the run with no message)."""
    _check(value > 0 and value != float("inf"), where,
           f"must be a finite number of seconds > 0, got {value!r}")


def _one_of(value, allowed, where: str) -> None:
    _check(value in allowed, where, f"must be one of {sorted(allowed)}, got {value!r}")


DTYPES = ("float32", "bfloat16")

# Words a bool takes from the command line or an ``env.options`` string (any case).
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
