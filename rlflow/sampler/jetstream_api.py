"""JetStream's Engine API (``google-jetstream``), imported without TensorFlow.

``jetstream.engine.engine_api`` imports ``jetstream.engine.token_utils`` at the top for one
default method (``Engine.build_tokenizer``: a SentencePiece tokenizer, which rlflow's engine
overrides with its own Hugging Face tokenizer, :mod:`rlflow.sampler.tokenizer`), and
``token_utils`` imports ``seqio``, which imports TensorFlow: ~6.5 s of CPU on every sampler
start (2-core host: ``import rlflow.sampler.program`` 10.3 s, the learner's 3.7 s), paid by
every replica and every restart. Here ``token_utils`` is registered as a *deferred* module before ``engine_api`` is
imported (:func:`lazy_import`): the module object exists with its ``__file__``, ``__spec__``
and ``__loader__``, and its body (seqio, TensorFlow and all) runs only when one of its own
names is first read; rlflow's engine never reads one. Reads of dunder names do not run it:
``inspect.getmodule`` (so ``inspect.stack()``, which importing torch runs) asks every module
in ``sys.modules`` for ``__file__``. The standard library's
:class:`importlib.util.LazyLoader` loads on any attribute read, so with torch installed (the
test extra) every sampler start imported TensorFlow after all (4.7 s of CPU, measured in the
sampler log with ``PYTHONPROFILEIMPORTTIME=1``).

Every rlflow module takes the JetStream names from here::

    from rlflow.sampler.jetstream_api import engine_api, tokenizer_api, tokenizer_pb2
"""

from __future__ import annotations

import importlib.util
import sys
import types

LAZY_MODULES = ("jetstream.engine.token_utils",)


def lazy_import(name: str) -> types.ModuleType:
    """``name`` registered in ``sys.modules`` without running it; the module itself if it was
    imported already.

    The module body runs, into the registered module object, on the first read of a name it
    defines (PEP 562 module ``__getattr__``); reads of dunder names (``__file__``,
    ``__path__``, ``__wrapped__``, ...) never run it: what the spec gives is set, anything
    else raises ``AttributeError``.

    Raises:
      ModuleNotFoundError: ``name`` cannot be found.
      Whatever the module body raises, on the first name read (a later read tries again).
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"no module named {name!r}", name=name)
    module = importlib.util.module_from_spec(spec)   # sets __file__, __spec__, __loader__

    def __getattr__(attr: str):
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(f"module {name!r} has no attribute {attr!r} (not loaded yet)")
        del module.__dict__["__getattr__"]
        try:
            spec.loader.exec_module(module)
        except BaseException:
            module.__dict__["__getattr__"] = __getattr__
            raise
        return getattr(module, attr)

    module.__dict__["__getattr__"] = __getattr__
    sys.modules[name] = module
    # ``from package import name`` then finds it on the package
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


for _name in LAZY_MODULES:
    lazy_import(_name)

from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2  # noqa: E402

__all__ = ["engine_api", "tokenizer_api", "tokenizer_pb2", "lazy_import"]
