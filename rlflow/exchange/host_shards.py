"""Weights out of a multi-host learner: each learner host serves its own shards.

On a learner slice of several hosts a parameter is a global ``jax.Array`` whose shards live
on different hosts; no host can publish it whole (``layout.describe`` refuses arrays that span
processes). Instead each host publishes a *transfer unit*: the distinct shards it holds
(:func:`host_units`), each a single-device array named by the parameter's position in
``jax.tree_util`` flatten order and its index in the global array::

    "00003:0-32_0-8"      leaf 3, rows 0..32, columns 0..8 (half-open)
    "00007:"              leaf 7, a scalar

A shard replicated on several devices (or hosts) is published once, by the device holding
replica 0, so the hosts' units partition every parameter. Each host runs its own
:class:`rlflow.exchange.transfer.WeightPublisher` (and coordinator) for its unit; a sampler
pulls every host's unit (one ``WeightSubscriber`` per learner host, ``target=None``) and
:func:`assemble` lays the parameters onto its own shardings, checking that the units cover
every element exactly once.
"""

from __future__ import annotations

import hashlib
import os
from typing import Mapping, Sequence

import jax
import numpy as np

from rlflow.exchange import layout as layout_lib
from rlflow.exchange.layout import LayoutError

ENV_WEIGHT_DIGESTS = "RLFLOW_WEIGHT_DIGESTS"   # "1": a sampler logs each version's digest


def unit_key(leaf: int, index: Sequence[tuple[int, int]]) -> str:
    """The name of one shard: ``"{leaf:05d}:{start}-{stop}_..."`` (see module doc)."""
    return f"{leaf:05d}:" + "_".join(f"{a}-{b}" for a, b in index)


def parse_unit_key(key: str) -> tuple[int, tuple[tuple[int, int], ...]]:
    """``(leaf, ((start, stop), ...))`` of a :func:`unit_key`, also when given as a pulled
    path ``"['00003:0-32_0-8']"``.

    Raises: LayoutError: not a unit key (names it).
    """
    raw = key[2:-2] if key.startswith("['") and key.endswith("']") else key
    try:
        leaf, _, spans = raw.partition(":")
        index = tuple(tuple(int(v) for v in s.split("-")) for s in spans.split("_")) \
            if spans else ()
        if not all(len(s) == 2 and 0 <= s[0] < s[1] for s in index):
            raise ValueError
        return int(leaf), index
    except ValueError:
        raise LayoutError(f"{key!r} is not a host-shard unit key (expected "
                          "'LEAF:start-stop_start-stop...')") from None


def _span(s: slice, size: int) -> tuple[int, int]:
    return (s.start or 0, size if s.stop is None else s.stop)


def host_units(params) -> dict[str, jax.Array]:
    """This process's transfer unit: ``{unit_key: single-device jax.Array}``.

    Args:
      params: pytree of ``jax.Array`` (global arrays of a multi-host mesh, or local ones).

    Returns: each distinct shard this process holds whose ``replica_id`` is 0 (the data is
    not copied: each value is the shard's own device buffer).

    Raises: LayoutError: a leaf is not a ``jax.Array``.
    """
    paths, leaves, _ = layout_lib.flatten(params)
    out = {}
    for i, (path, x) in enumerate(zip(paths, leaves)):
        if not isinstance(x, jax.Array):
            raise LayoutError(f"leaf {path}: expected a jax.Array, got {type(x).__name__}")
        for shard in x.addressable_shards:
            if shard.replica_id != 0:
                continue
            index = tuple(_span(s, n) for s, n in zip(shard.index, x.shape))
            out[unit_key(i, index)] = shard.data
    return out


def assemble(units: Sequence[Mapping[str, object]], target):
    """The parameters from every learner host's unit, on ``target``'s shardings.

    Args:
      units: one mapping per learner host, ``{unit key or pulled path: array}`` (jax or
        numpy; e.g. what ``WeightSubscriber.poll`` returns with ``target=None``).
      target: pytree with the learner's parameter structure whose leaves are arrays or
        ``ShapeDtypeStruct`` with shardings (global shape and dtype come from it).

    Returns: ``target``'s structure of ``jax.Array`` on its shardings.

    Raises:
      LayoutError: a shard names a leaf the target lacks, lies outside the leaf's shape, has
        the wrong dtype or shape, overlaps another shard, or some element of a leaf is in no
        shard (names the leaf path and the learner host).
    """
    paths, leaves, treedef = layout_lib.flatten(target, targets=True)
    hosts = [np.empty(tuple(x.shape), np.dtype(x.dtype)) for x in leaves]
    filled = [np.zeros(tuple(x.shape), np.uint8) for x in leaves]
    for host, unit in enumerate(units):
        for key, arr in unit.items():
            leaf, index = parse_unit_key(key)
            if leaf >= len(leaves):
                raise LayoutError(f"learner host {host}: shard {key} names leaf {leaf}, the "
                                  f"target has {len(leaves)} leaves")
            want = leaves[leaf]
            path = paths[leaf]
            if len(index) != len(want.shape) or any(
                    b > n for (_, b), n in zip(index, want.shape)):
                raise LayoutError(f"learner host {host}: shard {key} lies outside {path} of "
                                  f"shape {tuple(want.shape)}")
            data = np.asarray(arr)
            sl = tuple(slice(a, b) for a, b in index)
            if data.dtype != np.dtype(want.dtype) or data.shape != filled[leaf][sl].shape:
                raise LayoutError(f"learner host {host}: shard {key} of {path} is "
                                  f"{data.dtype}{list(data.shape)}, expected "
                                  f"{np.dtype(want.dtype)}{list(filled[leaf][sl].shape)}")
            if filled[leaf][sl].any():
                raise LayoutError(f"learner host {host}: shard {key} of {path} overlaps a "
                                  "shard already received")
            hosts[leaf][sl] = data
            filled[leaf][sl] = 1
    for path, f in zip(paths, filled):
        if not f.all():
            first = tuple(int(i) for i in np.argwhere(f == 0)[0])
            raise LayoutError(f"{path}: {int((f == 0).sum())} elements in no learner host's "
                              f"shards (first at index {first})")
    shardings, _ = layout_lib.target_shardings(
        target, [{"path": p, "shape": list(x.shape), "dtype": str(np.dtype(x.dtype))}
                 for p, x in zip(paths, leaves)])
    out = [jax.make_array_from_callback(h.shape, s, lambda idx, h=h: h[idx])
           for h, s in zip(hosts, shardings)]
    return jax.tree_util.tree_unflatten(treedef, out)


class HostShardPuller:
    """Sampler side: pulls every learner host's unit and assembles a version once all hosts
    have offered it (hosts publish one after another, so a poll may find only some new).

    Args:
      subscribers: one :class:`rlflow.exchange.transfer.WeightSubscriber` (``target=None``)
        per learner host, in host order.
      target: as :func:`assemble`.
    """

    def __init__(self, subscribers: Sequence, target):
        self.subscribers, self.target = list(subscribers), target
        self._units: list = [None] * len(self.subscribers)   # (version, unit) per host
        self.version = -1

    def poll(self):
        """``(version, params)`` when every host holds a version newer than ``self.version``
        (the same one), else None.

        Raises:
          LayoutError: from :func:`assemble`.
          WeightTransferError: a pull failed (from the subscriber).
        """
        for i, sub in enumerate(self.subscribers):
            got = sub.poll()
            if got is not None:
                self._units[i] = got
        versions = {None if u is None else u[0] for u in self._units}
        if len(versions) != 1 or None in versions:
            return None
        version = versions.pop()
        if version <= self.version:
            return None
        params = assemble([u[1] for u in self._units], self.target)
        self.version = version
        return version, params

    def cancel(self) -> None:
        """Abandon every host's pull in progress (``WeightSubscriber.cancel``; shutdown)."""
        for sub in self.subscribers:
            sub.cancel()

    def close(self) -> None:
        for sub in self.subscribers:
            sub.close()


def weights_digest(params) -> str:
    """sha256 (hex) of a parameter pytree: each leaf's ``keystr`` path, dtype, shape and
    bytes, in flatten order (equal digests = bitwise equal parameters of one structure)."""
    h = hashlib.sha256()
    paths, leaves, _ = layout_lib.flatten(params)
    for path, x in zip(paths, leaves):
        a = np.ascontiguousarray(np.asarray(x))
        h.update(f"{path}|{a.dtype}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def log_weights_digest(log, version: int, params, env=None) -> None:
    """With ``RLFLOW_WEIGHT_DIGESTS=1``: log ``weights version V digest D`` (a check that a
    sampler holds exactly the learner's parameters; it copies every leaf to host memory, so
    it is off by default)."""
    env = os.environ if env is None else env
    if env.get(ENV_WEIGHT_DIGESTS) == "1":
        log.info("weights version %d digest %s", version, weights_digest(params))


def host_shard_puller(coordinator: str, weight_hosts: Sequence[str], target, *,
                      num_hosts: int, **subscriber):
    """A :class:`HostShardPuller` over learner host 0's coordinator (``tcp://host:port``) and
    hosts 1..N-1's (``weight_hosts``: ``host:port``, from the run control's reply);
    ``subscriber``: keyword arguments of every ``WeightSubscriber`` (``target=None``).

    Raises: ValueError: ``weight_hosts`` does not name ``num_hosts - 1`` hosts.
    """
    from rlflow.exchange.transfer import WeightSubscriber
    from rlflow.exchange.wire import tcp_endpoint

    if len(weight_hosts) != num_hosts - 1:
        raise ValueError(f"the learner named {len(weight_hosts)} other learner hosts' weight "
                         f"servers {list(weight_hosts)}; learner.num_hosts={num_hosts}")

    addresses = [coordinator] + [tcp_endpoint(*a.rsplit(":", 1)) for a in weight_hosts]
    return HostShardPuller([WeightSubscriber(a, target=None, **subscriber)
                            for a in addresses], target)
