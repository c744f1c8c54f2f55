"""The repository and tests folders, for test files at any depth under tests/ (tests/unit/<package>/,
tests/e2e/): ``REPO`` (the checkout's root, absolute) and ``TESTS_DIR`` (its tests/ folder, where
the shared helper modules live; put on ``sys.path`` by tests/conftest.py)."""

import os

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS_DIR)
