"""JetStream's Engine API (``google-jetstream``), imported without TensorFlow.

``jetstream.engine.engine_api`` imports ``jetstream.engine.token_utils`` at the top for one
default method (``Engine.build_tokenizer``: a SentencePiece tokenizer, which rlflow's engine
overrides with its own Hugging Face tokenizer, :mod:`rlflow.sampler.tokenizer`), and
``token_utils`` imports ``seqio``, which imports TensorFlow: ~6.5 s of CPU on every sampler
start (2-core host: ``import rlflow.sampler.program`` 10.3 s, the learner's 3.7 s), paid by
every replica and every restart. Here ``token_utils`` is registered with the standard
library's :class:`importlib.util.LazyLoader` before ``engine_api`` is imported: the module
exists, and runs (seqio, TensorFlow and all) only when one of its attributes is first read.
rlflow's engine never reads one.

Every rlflow module takes the JetStream names from here::

    from rlflow.sampler.jetstream_api import engine_api, tokenizer_api, tokenizer_pb2
"""

from __future__ import annotations

import importlib.util
import sys
import types

LAZY_MODULES = ("jetstream.engine.token_utils",)


def lazy_import(name: str) -> types.ModuleType:
    """``name`` registered in ``sys.modules`` without running it (the module body runs on the
    first attribute read); the module itself if it was imported already.

    Raises:
      ModuleNotFoundError: ``name`` cannot be found.
    """
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"no module named {name!r}", name=name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    # ``from package import name`` then finds it on the package without going through the
    # import machinery, which reads ``module.__spec__`` (an attribute read: it would load)
    parent, _, child = name.rpartition(".")
    if parent:
        setattr(sys.modules[parent], child, module)
    return module


for _name in LAZY_MODULES:
    lazy_import(_name)

from jetstream.engine import engine_api, tokenizer_api, tokenizer_pb2  # noqa: E402

__all__ = ["engine_api", "tokenizer_api", "tokenizer_pb2", "lazy_import"]
