"""Fixtures shared by the kernel tests."""

import pytest

from normfold import ops


@pytest.fixture
def fresh_library(monkeypatch):
    """Let a test change the environment and rebuild/reload the library; restored afterwards."""
    ops.reload_environment()
    yield
    monkeypatch.undo()
    ops.reload_environment()
