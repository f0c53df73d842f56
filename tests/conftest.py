"""Shared fixtures."""

import pytest

from het_strategy.emulation.local_ranks import free_port


@pytest.fixture
def fresh_master_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new MASTER_PORT per test: Lightning keeps the first port it picks in os.environ, and the previous
    test's processes may still hold it."""
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
