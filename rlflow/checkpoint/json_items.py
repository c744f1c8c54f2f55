"""JSON encodings of the checkpoint's non-array state: RNG keys and the prompt iterator state.

* RNG keys (the ``progress`` item's ``rngs``): ``{name: {"impl": str or None, "shape":
  [int], "data": [uint32 ...]}}``; ``impl`` is the key implementation of a typed key
  (``jax.random.key``), None for raw ``uint32`` key data (``jax.random.PRNGKey``).
* Iterator state (the ``data`` item): ``{"state": grain get_state() dict, or
  {"__bytes_base64__": str} for bytes, or None}``.
"""

from __future__ import annotations

import base64
import json
from typing import Any, Mapping

import jax
import numpy as np

from rlflow.checkpoint.state import CheckpointError

_BYTES_KEY = "__bytes_base64__"


def _host_value(x, where: str) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        if not x.is_fully_replicated:
            raise CheckpointError(f"{where}: must be fully replicated to be saved as JSON")
        return np.asarray(x.addressable_data(0))
    return np.asarray(x)


def encode_rngs(rngs: Mapping[str, jax.Array]) -> dict:
    """Named PRNG keys as JSON (see the module docstring).

    Raises:
      CheckpointError: a key is not fully replicated, or its data is not ``uint32``
        (names the key).
    """
    out = {}
    for name, key in rngs.items():
        where = f"rngs[{name!r}]"
        if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            impl, data = str(jax.random.key_impl(key)), jax.random.key_data(key)
        else:
            impl, data = None, key
        data = _host_value(data, where)
        if data.dtype != np.uint32:
            raise CheckpointError(f"{where}: expected a typed PRNG key or uint32 key data, "
                                  f"got dtype {data.dtype}")
        out[name] = {"impl": impl, "shape": list(data.shape), "data": data.ravel().tolist()}
    return out


def decode_rngs(encoded: Mapping[str, Any]) -> dict:
    """The keys :func:`encode_rngs` wrote: typed keys of their ``impl``, else ``uint32`` arrays."""
    out = {}
    for name, rec in encoded.items():
        data = np.asarray(rec["data"], dtype=np.uint32).reshape(rec["shape"])
        out[name] = (jax.random.wrap_key_data(data, impl=rec["impl"]) if rec["impl"]
                     else jax.numpy.asarray(data))
    return out


def encode_data_state(state) -> dict:
    """The prompt iterator state as the ``data`` item (bytes stored base64).

    Raises:
      CheckpointError: ``state`` is neither None, bytes nor JSON-able.
    """
    if state is None:
        return {"state": None}
    if isinstance(state, (bytes, bytearray)):
        return {"state": {_BYTES_KEY: base64.b64encode(bytes(state)).decode("ascii")}}
    try:
        json.dumps(state)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"data_state: must be bytes or a JSON-able dict (grain "
                              f"get_state()), got {type(state).__name__}: {e}") from None
    return {"state": state}


def decode_data_state(item: Mapping[str, Any]):
    """The state :func:`encode_data_state` wrote (bytes again where bytes were saved)."""
    state = item.get("state")
    if isinstance(state, dict) and set(state) == {_BYTES_KEY}:
        return base64.b64decode(state[_BYTES_KEY])
    return state
