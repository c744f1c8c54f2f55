"""Request seeds: the one derivation the learner's prompt ledger (each prompt's seed), the
evaluation (each held-out prompt's seed) and the tests share."""

from __future__ import annotations

import numpy as np


def derive_seed(base_seed: int, *keys: int) -> int:
    """A 32-bit request seed from a base seed and non-negative integer keys (e.g. the
    request's position in the prompt stream), by ``numpy.random.SeedSequence``:
    distinct keys give unrelated streams, so a prompt seen again in a later epoch is not
    drawn with the same uniforms."""
    return int(np.random.SeedSequence([int(base_seed), *map(int, keys)]).generate_state(1)[0])
