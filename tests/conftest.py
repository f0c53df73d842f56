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


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """A test that initialised the default process group in the pytest process (a one-rank Trainer that failed in
    setup keeps it) would hand it to a later test's forked ranks, which then wait forever on a group whose gloo
    threads did not survive the fork: destroy it after every test."""
    yield
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
