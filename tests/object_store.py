"""A local stand-in for Google Cloud Storage: ``gs://bucket/path`` read and written through
``etils.epath``'s real fsspec backend, which this module points at a local folder (no
network). epath prefers TensorFlow's ``tf.io.gfile`` for ``gs://`` when TensorFlow is
installed; :func:`install` makes it take its fsspec backend, as on a machine without it,
and registers :class:`LocalGCS` as fsspec's ``gs`` / ``gcs`` file system."""

from __future__ import annotations

import os

from fsspec.implementations.local import LocalFileSystem

ROOT_ENV = "RLFLOW_TEST_GCS_ROOT"


class LocalGCS(LocalFileSystem):
    """``gs://bucket/key`` -> ``$RLFLOW_TEST_GCS_ROOT/bucket/key``; like an object store,
    a write needs no parent folder (``auto_mkdir``)."""

    protocol = ("gs", "gcs")

    def __init__(self, *args, **kwargs):
        kwargs.pop("finalize_on_close", None)
        super().__init__(auto_mkdir=True)

    @classmethod
    def _strip_protocol(cls, path):
        path = os.fspath(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                return os.path.join(os.environ[ROOT_ENV], path[len(prefix):]).rstrip("/")
        return super()._strip_protocol(path)


def install(monkeypatch, root) -> None:
    """Route ``gs://`` to ``root`` for this test: epath's fsspec backend (its cache cleared),
    ``LocalGCS`` registered for ``gs`` / ``gcs`` until the test ends (then :func:`uninstall`)."""
    import importlib

    from etils.epath import backend, gpath

    # the module (``from fsspec import registry`` gives its read-only mapping instead)
    fsspec_registry = importlib.import_module("fsspec.registry")

    monkeypatch.setenv(ROOT_ENV, str(root))
    monkeypatch.setattr(gpath, "_is_tf_installed", lambda: False)
    for name in ("gs", "gcs"):
        monkeypatch.setitem(fsspec_registry._registry, name, LocalGCS)
    backend.fsspec_backend._get_filesystem.cache_clear()


def uninstall() -> None:
    """Forget the stand-in cached by epath (after the test's monkeypatch is undone)."""
    from etils.epath import backend

    backend.fsspec_backend._get_filesystem.cache_clear()
