"""The ``jax.experimental.transfer`` server both ends of a weight transfer run, and the
errors of a weight pull (:mod:`rlflow.exchange.transfer`: the publisher;
:mod:`rlflow.exchange.subscriber`: the puller)."""

from __future__ import annotations

import jax
from jax.experimental import transfer as jax_transfer

class WeightTransferError(RuntimeError):
    """A weight pull failed after all retries (the message names version, uuid, address)."""


class WeightTransferTimeout(WeightTransferError, TimeoutError):
    """One pull did not complete within the watchdog's timeout."""


class WeightPullCancelled(WeightTransferError):
    """:meth:`WeightSubscriber.cancel` was called (the process is shutting down): the pull
    in progress, or the one asked for, was abandoned. Never retried."""


def start_server(bind_address: str, transports: int | None = None, *,
                  raw_buffers: bool = False):
    """A transfer server with ``transports`` bulk-transport sockets (default: one per local
    device). A puller needs at least as many as the server it pulls from (module doc).
    ``raw_buffers``: serve ``await_pull`` arrays through raw aliases of their buffers (one
    host copy fewer per byte sent, module doc); only for arrays nothing else can delete or
    donate while a pull is pending."""
    host = bind_address if ":" not in bind_address else f"[{bind_address.strip('[]')}]"
    devices = jax.local_devices()
    n = len(devices) if transports is None else transports
    if n < 1:
        raise ValueError(f"a transfer server needs >= 1 transports, got {n}")
    return jax_transfer.start_transfer_server(devices[0].client, f"{host}:0",
                                              [f"{host}:0"] * n,
                                              use_raw_buffers=raw_buffers), n
