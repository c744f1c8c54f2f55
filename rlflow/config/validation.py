"""The config error type and the small checks every section's ``__post_init__`` uses.

Every float field of every section (``float``, ``Optional[float]``, ``Tuple[float, ...]``)
is checked for finiteness here, by :func:`_finite_floats` at the top of each section's
``__post_init__``: NaN is always refused, infinity too unless the section lists the field in
its class attribute ``FLOATS_MAY_BE_INF`` (no field does today). The ranges of each field
are checked by the section's ``__post_init__`` after that, on finite values.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing


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


@functools.lru_cache(maxsize=None)
def float_fields(cls) -> typing.Tuple[str, ...]:
    """Names of the fields of dataclass ``cls`` whose type holds ``float`` (``float``,
    ``Optional[float]``, ``Tuple[float, ...]``), in declaration order."""
    hints = typing.get_type_hints(cls)

    def holds_float(tp) -> bool:
        return tp is float or any(holds_float(a) for a in typing.get_args(tp)
                                  if not isinstance(a, str))

    return tuple(f.name for f in dataclasses.fields(cls) if holds_float(hints[f.name]))


def _finite_floats(cfg, section: str) -> None:
    """Refuse NaN and infinity in every float field of the dataclass ``cfg`` (elements of a
    tuple field too), naming ``<section>.<field>``; infinity passes only for a field listed
    in ``type(cfg).FLOATS_MAY_BE_INF``.

    Raises:
      ConfigError: a non-finite value (names the field and the value).
    """
    may_be_inf = getattr(type(cfg), "FLOATS_MAY_BE_INF", ())
    for name in float_fields(type(cfg)):
        value = getattr(cfg, name)
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, numbers.Real) and not math.isfinite(v):
                allowed = name in may_be_inf and not math.isnan(v)
                _check(allowed, f"{section}.{name}",
                       f"must be a finite number, got {v!r}")


def _one_of(value, allowed, where: str) -> None:
    _check(value in allowed, where, f"must be one of {sorted(allowed)}, got {value!r}")


DTYPES = ("float32", "bfloat16")

# Words a bool takes from the command line or an ``env.options`` string (any case).
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")
