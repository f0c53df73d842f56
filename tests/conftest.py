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
def no_process_state_left_behind():
    """What an in-process Trainer leaves in the pytest process is undone after every test: the environment
    (Lightning sets ``MASTER_PORT``, ``LOCAL_RANK``, ``WORLD_SIZE``...; a later test's subprocess that inherits
    ``LOCAL_RANK`` takes itself for an externally launched rank and waits for peers nobody starts) and the default
    process group (a one-rank Trainer that failed in setup keeps it; a later test's forked ranks would inherit it
    and wait forever on a group whose gloo threads did not survive the fork)."""
    import os
    import sys

    environ = dict(os.environ)
    yield
    for key in set(os.environ) - set(environ):
        del os.environ[key]
    for key, value in environ.items():
        if os.environ.get(key) != value:
            os.environ[key] = value
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
