"""Weight transfer through a checkpoint folder, for set-ups where the transfer server
cannot connect (``runtime.weight_transfer="orbax"``).

The learner saves version ``v`` to ``<run>/weights/<v>`` with an orbax ``CheckpointManager``
(atomic: orbax writes a temporary folder and renames it when complete, so a reader never
sees a half-written version; the newest ``keep_last`` versions are kept). The sampler polls
the folder and restores the newest version directly onto its own shardings.

Saved items: ``params`` (the leaves as ``{"00000": array, ...}`` in ``jax.tree_util``
flatten order) and ``layout`` (JSON: the leaves' paths, shapes, dtypes), so any pytree
(e.g. an ``nnx.State``) round-trips and a structure mismatch is a named error.
"""

from __future__ import annotations

import logging
import os

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from rlflow.exchange import layout as layout_lib

log = logging.getLogger(__name__)


def weights_dir(run_dir: str) -> str:
    """``<run>/weights``: where the fallback publishes versions."""
    return os.path.join(os.path.abspath(run_dir), "weights")


def _key(i: int) -> str:
    return f"{i:05d}"


class OrbaxWeightPublisher:
    """Learner side: ``publish(version, params)`` saves to ``<run>/weights/<version>``.

    Args:
      run_dir: the run folder.
      keep_last: versions kept on disk (older ones are deleted).
    """

    def __init__(self, run_dir: str, *, keep_last: int = 2):
        self.directory = weights_dir(run_dir)
        self._mngr = ocp.CheckpointManager(
            self.directory, item_names=("params", "layout"),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep_last, create=True,
                                                 enable_async_checkpointing=False))
        latest = self._mngr.latest_step()
        self.version = -1 if latest is None else int(latest)

    def publish(self, version: int, params) -> None:
        """Save ``params`` (pytree of ``jax.Array``) as ``version``.

        Raises:
          ValueError: ``version`` is not greater than the newest saved one.
        """
        if version <= self.version:
            raise ValueError(f"weight versions never go backwards: publishing {version} after "
                             f"{self.version}")
        paths, leaves, _ = layout_lib.flatten(params)
        meta = [{"path": p, "shape": list(x.shape), "dtype": str(x.dtype)}
                for p, x in zip(paths, leaves)]
        self._mngr.save(version, args=ocp.args.Composite(
            params=ocp.args.StandardSave({_key(i): x for i, x in enumerate(leaves)}),
            layout=ocp.args.JsonSave({"leaves": meta})))
        self._mngr.wait_until_finished()
        self.version = version

    def close(self) -> None:
        self._mngr.close()


class OrbaxWeightSubscriber:
    """Sampler side: ``poll()`` restores the newest version newer than ``self.version``.

    Args:
      run_dir: the run folder the learner publishes into.
      target: pytree with the publisher's structure whose leaves are arrays or
        ``ShapeDtypeStruct`` with shardings: shapes to check and where the weights go.
    """

    def __init__(self, run_dir: str, *, target):
        self.directory = weights_dir(run_dir)
        self.target = target
        self._mngr = None
        self.version = -1

    def _manager(self):
        if self._mngr is None and os.path.isdir(self.directory):
            self._mngr = ocp.CheckpointManager(
                self.directory, item_names=("params", "layout"),
                options=ocp.CheckpointManagerOptions(read_only=True))
        return self._mngr

    def poll(self, *, attempts: int = 3) -> tuple[int, object] | None:
        """Restore the newest published version if it is newer than ``self.version``.

        Returns:
          ``(version, params)`` on ``target``'s shardings, or None when nothing newer.

        Raises:
          layout.LayoutError: the saved leaves differ from ``target`` (names the leaf).
          Exception: orbax's error when every attempt failed (a version deleted while being
            read is retried with the next newest).
        """
        mngr = self._manager()
        if mngr is None:
            return None
        for attempt in range(attempts):
            mngr.reload()
            step = mngr.latest_step()
            if step is None or step <= self.version:
                return None
            try:
                return self._restore(mngr, int(step))
            except layout_lib.LayoutError:
                raise
            except Exception as e:  # noqa: BLE001 - e.g. deleted by keep_last mid-read
                if attempt == attempts - 1:
                    raise
                log.warning("weights: restoring version %d failed (%s); retrying", step, e)
        return None

    def cancel(self) -> None:
        """Shutdown hook of the subscriber interface (``WeightSubscriber.cancel``): a
        restore is file reads on the calling thread, with nothing in flight to abandon."""

    def _restore(self, mngr, step: int):
        meta = mngr.restore(step, args=ocp.args.Composite(layout=ocp.args.JsonRestore()))
        leaves_meta = meta["layout"]["leaves"]
        shardings, treedef = layout_lib.target_shardings(self.target, leaves_meta)
        abstract = {_key(i): jax.ShapeDtypeStruct(tuple(m["shape"]), jnp.dtype(m["dtype"]),
                                                sharding=s)
                    for i, (m, s) in enumerate(zip(leaves_meta, shardings))}
        out = mngr.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore(abstract)))["params"]
        params = jax.tree_util.tree_unflatten(treedef, [out[_key(i)]
                                                        for i in range(len(leaves_meta))])
        self.version = step
        return step, params

    def close(self) -> None:
        if self._mngr is not None:
            self._mngr.close()
