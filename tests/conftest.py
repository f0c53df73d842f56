"""Shared fixtures."""

import pytest

from het_strategy.emulation.local_ranks import free_port


@pytest.fixture
def fresh_master_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """A new MASTER_PORT per test: Lightning keeps the first port it picks in os.environ, and the previous
    test's processes may still hold it."""
    monkeypatch.setenv("MASTER_PORT", str(free_port()))


@pytest.fixture
def no_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a run (and so any worker) were started."""
    import het_strategy.cli.train_cli as train_cli

    def refuse(job: object) -> None:
        raise AssertionError("run_train was reached: the bad input was not caught before the workers")

    monkeypatch.setattr(train_cli, "run_train", refuse)
