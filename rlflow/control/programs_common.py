"""What the learner program, the sampler program and the launcher share.

* The resolved :class:`~rlflow.config.ExperimentConfig` travels to each program as a JSON
  file (``config_to_dict`` / ``config_from_dict``: plain types, no pickle).
* :class:`Endpoints` are the addresses one program needs to reach the other: the learner
  serves the rollout ring buffer and the weight coordinator, the samplers connect to both.
  They come from environment variables (set by ``rlflow.launcher.supervisor`` on one machine, or by the
  Cloud TPU scripts on a pod: see ``rlflow/launcher/launch.py``).
* ``install_signal_handlers`` turns SIGTERM (the launcher's stop request) into
  :class:`Stopped`, so a program's ``finally`` blocks close sockets and servers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import sys
import typing
from dataclasses import dataclass
from typing import Any

from rlflow import config as config_mod
from rlflow.config.secrets import redact_config, resolve_secrets

ENV_ROLE = "RLFLOW_ROLE"                      # "learner" | "sampler"
ENV_CONFIG = "RLFLOW_CONFIG"                  # path of the resolved config JSON
ENV_BUFFER = "RLFLOW_BUFFER_ADDRESS"          # host:port the learner's ring buffer binds
ENV_COORDINATOR = "RLFLOW_COORDINATOR_ADDRESS"  # host:port of the weight coordinator
ENV_INSTANCE = "RLFLOW_INSTANCE"              # restart count of this program (0 first start)
ENV_DIST_COORDINATOR = "RLFLOW_JAX_COORDINATOR"  # jax.distributed coordinator of this slice
ENV_NUM_PROCESSES = "RLFLOW_NUM_PROCESSES"    # hosts in this program's slice
ENV_PROCESS_ID = "RLFLOW_PROCESS_ID"          # this host's index in its slice
ENV_REPLICA = "RLFLOW_REPLICA"                # sampler replica index (0..num_replicas-1)
ENV_PARENT_PID = "RLFLOW_LAUNCHER_PID"        # set by rlflow.launcher.supervisor: die with the launcher
ENV_CPUS = "RLFLOW_CPUS"                      # comma-separated CPU ids this program runs on
ENV_PROFILE = "RLFLOW_PROFILE"                # folder: each program writes <role>.prof (cProfile)

ROLES = ("learner", "sampler")


class Stopped(BaseException):
    """Raised inside a program when the launcher asks it to stop (SIGTERM).

    A ``BaseException`` (like ``KeyboardInterrupt``), so that ``except Exception`` guards in
    library code (reward functions, closers) do not swallow the stop request."""


STOPPED_EXIT_CODE = 143   # exit code of a program stopped by SIGTERM (128 + 15), not a finished one


def config_to_dict(cfg) -> dict:
    """A frozen config dataclass as plain JSON types (tuples become lists)."""
    return dataclasses.asdict(cfg)


def config_from_dict(cls, data: dict):
    """Rebuild config dataclass ``cls`` from :func:`config_to_dict` output.

    Validation runs again (each dataclass's ``__post_init__``).

    Raises:
      rlflow.config.ConfigError: an unknown field (named) or an invalid value.
    """
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise config_mod.ConfigError(f"{cls.__name__}: unknown field(s) {unknown}")
    kwargs = {}
    for name, value in data.items():
        hint = hints[name]
        if dataclasses.is_dataclass(hint):
            value = config_from_dict(hint, value)
        elif typing.get_origin(hint) is tuple and isinstance(value, list):
            value = tuple(value)
        kwargs[name] = value
    return cls(**kwargs)


def save_config(cfg, path: str) -> None:
    """Write ``cfg`` as JSON, secrets redacted (:func:`rlflow.config.secrets.redact_config`)."""
    from rlflow.run import files

    if not files.is_url(path):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    files.write_atomic(path, json.dumps(redact_config(config_to_dict(cfg)), indent=2,
                                        sort_keys=True))


def load_config(path: str, env=None):
    """Read a resolved config JSON written by :func:`save_config`; redacted secrets come
    back from their source (``RLFLOW_BUFFER_TOKEN`` or ``buffer.token_file``,
    :func:`rlflow.config.secrets.resolve_secrets`), and its ``plugins`` are imported (so this
    program's registries hold the user's functions, :mod:`rlflow.system.plugins`)."""
    from rlflow.system.plugins import import_plugins

    from rlflow.run import files

    cfg = config_from_dict(config_mod.ExperimentConfig, json.loads(files.read_text(path)))
    cfg = resolve_secrets(cfg, env)
    import_plugins(cfg.plugins)
    return cfg


@contextlib.contextmanager
def deferred_stop():
    """Hold a SIGTERM stop request (:class:`Stopped`) until the block ends.

    For work that must not be cut in half, e.g. a learner step and the metrics of the
    version it made (a checkpoint of a version always has its metrics record). A SIGTERM
    received inside the block raises :class:`Stopped` when the block exits; outside the main
    thread (where Python runs no signal handlers) the block runs unchanged.
    """
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: pending.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
    if pending:
        _stop_requested.extend(pending)
        raise Stopped(f"received {signal.Signals(pending[0]).name}")
    raise_if_stopped()


@dataclass(frozen=True)
class Endpoints:
    """Addresses ``host:port`` of the learner's ring buffer and weight coordinator."""

    buffer: str
    coordinator: str
    instance: int = 0

    @classmethod
    def from_env(cls, env=None) -> "Endpoints":
        """Read the addresses from ``RLFLOW_BUFFER_ADDRESS`` / ``RLFLOW_COORDINATOR_ADDRESS``.

        Raises:
          KeyError: a variable is missing (the message names it).
        """
        env = os.environ if env is None else env
        missing = [k for k in (ENV_BUFFER, ENV_COORDINATOR) if not env.get(k)]
        if missing:
            raise KeyError(f"environment variable(s) {missing} must hold host:port addresses "
                           "(set by rlflow train, rlflow.launcher.supervisor, or scripts/tpu)")
        return cls(env[ENV_BUFFER], env[ENV_COORDINATOR], int(env.get(ENV_INSTANCE, "0")))

    def to_env(self) -> dict[str, str]:
        return {ENV_BUFFER: self.buffer, ENV_COORDINATOR: self.coordinator,
                ENV_INSTANCE: str(self.instance)}


def split_address(address: str) -> tuple[str, int]:
    """``"127.0.0.1:5555"`` -> ``("127.0.0.1", 5555)``; ``[::1]:5`` keeps the brackets off."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


_stop_requested: list[int] = []     # signal numbers received (see raise_if_stopped)


def install_signal_handlers() -> None:
    """SIGTERM raises :class:`Stopped` in the main thread (clean shutdown on the launcher's
    request); SIGINT is left to the launcher, which runs the programs in their own session.

    The request is also remembered: Python runs the handler wherever the main thread is,
    and an exception raised inside a finaliser (e.g. a ZeroMQ frame's ``__dealloc__``) is
    printed and dropped. Program loops call :func:`raise_if_stopped` so such a request
    still stops the program (with its exit checkpoint) instead of waiting for SIGKILL.

    Only the first request raises: later ones are recorded and ignored, so they cannot cut
    the exit checkpoint short. A launcher killed with SIGKILL sends several (Linux sends
    ``PR_SET_PDEATHSIG`` again each time the child is handed to the next thread of the dying
    parent), and the second used to abort the learner's final save half-written."""

    def _stop(signum, frame):
        first = not _stop_requested
        _stop_requested.append(signum)
        if first:
            raise Stopped(f"received {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, _stop)


EXIT_GRACE_S = 10.0     # seconds a program's process may linger after its program ended


def arm_exit_watchdog(grace_s: float = EXIT_GRACE_S) -> None:
    """End this process if it is still alive ``grace_s`` seconds from now (call it when the
    program has ended, returned or raised): the interpreter's exit joins every non-daemon
    thread and runs atexit handlers, and a library thread stuck there (e.g. orbax's commit
    threads waiting forever for a save that a SIGTERM interrupted) would leave the process
    running for good, an orphan holding its run folder once the launcher is gone.

    Uses ``faulthandler.dump_traceback_later(exit=True)``: a C watchdog thread that needs no
    GIL; when it fires it writes "Timeout (0:00:10)!" and every thread's stack to stderr
    (the program's log: what hung) and exits with code 1.
    """
    import faulthandler

    faulthandler.dump_traceback_later(grace_s, exit=True, file=sys.stderr)


def raise_if_stopped() -> None:
    """Raise :class:`Stopped` when a stop request arrived (even one whose exception was
    swallowed where the handler happened to run)."""
    if _stop_requested:
        raise Stopped(f"received {signal.Signals(_stop_requested[0]).name}")


def setup_logging(role: str) -> logging.Logger:
    """Log lines ``[role] message`` to stderr (the launcher keeps them in ``logs/<role>.log``)."""
    logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                        format=f"%(asctime)s [{role}] %(levelname)s %(name)s: %(message)s")
    for noisy in ("absl", "jax", "orbax", "grain"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    return logging.getLogger(f"rlflow.{role}")


def jsonable(value: Any) -> Any:
    """Scalars of numpy / jax arrays as Python floats and ints (for JSON metrics)."""
    if hasattr(value, "item") and getattr(value, "size", 1) == 1:
        return value.item()
    return value


def run_tokenizer(cfg):
    """The tokenizer both programs use (a ``transformers`` tokenizer).

    ``model.path`` holding tokenizer files: that one. Otherwise, for a built-in task, the
    task's character tokenizer (built locally into a temporary folder, deterministic).

    Raises:
      FileNotFoundError: no tokenizer can be found (names ``model.path``).
    """
    import tempfile

    from rlflow.data.tokenizer import load_tokenizer

    if cfg.model.path:
        return load_tokenizer(cfg.model.path)
    if cfg.data.source == "builtin":
        from rlflow.data.tasks import get_task

        return get_task(cfg.data.task).build_tokenizer(tempfile.mkdtemp(prefix="rlflow-tok-"))
    raise FileNotFoundError("model.path: a Hugging Face folder with tokenizer files is "
                            f"required for data.source={cfg.data.source!r}")


def accuracy_threshold(reward_cfg) -> float:
    """Reward at or above which a sample counts as correct for ``reward/accuracy``: half the
    best total reward (the sum of the positive weights, each function scoring at most 1)."""
    return 0.5 * sum(w for w in reward_cfg.weights if w > 0)
