"""The uneven all-gather and reduce-scatter of ``het_strategy.fsdp`` on 3 gloo ranks: equal sizes against gloo's
own collectives, unequal sizes (one rank holding nothing) against the concatenation and sum of every rank's
inputs."""

from __future__ import annotations

import _fsdp_worker as worker
import pytest
import torch

from het_strategy.core.errors import ConfigError
from het_strategy.core.shard_sizes import shard_offsets
from het_strategy.emulation.local_ranks import run_local_ranks

CASES = [[4, 4, 4], [7, 0, 3], [0, 5, 1], [0, 0, 0]]


@pytest.mark.multiprocess
def test_uneven_collectives_equal_gloo_and_the_reference() -> None:
    got = run_local_ranks(worker.collectives, 3, CASES, timeout_s=60)
    for c, sizes in enumerate(CASES):
        ranks = [g[c] for g in got]
        concatenated = torch.cat([r["shard"] for r in ranks])
        summed = torch.stack([r["full"] for r in ranks]).sum(0)
        for rank, (at, size, r) in enumerate(zip(shard_offsets(sizes), sizes, ranks)):
            assert torch.equal(r["gathered"], concatenated), (sizes, rank)
            assert torch.equal(r["gathered_async"], concatenated), (sizes, rank)
            assert torch.equal(r["piece"], summed[at:at + size]), (sizes, rank)
            assert torch.equal(r["piece_async"], summed[at:at + size]), (sizes, rank)
            if len(set(sizes)) == 1 and sizes[0] > 0:
                assert torch.equal(r["gathered"], r["gloo_gathered"])
                assert torch.equal(r["piece"], r["gloo_piece"])


def _wrong_shard(rank: int, world: int) -> str:
    from het_strategy.fsdp import all_gather_uneven

    try:
        all_gather_uneven(torch.zeros(3), [2, 2])
    except ConfigError as exc:
        return str(exc)
    return "no error"


@pytest.mark.multiprocess
def test_a_shard_of_the_wrong_size_names_the_rank_and_its_size() -> None:
    messages = run_local_ranks(_wrong_shard, 2, timeout_s=60)
    assert "`all_gather_uneven.shard` is (3,)" in messages[0] and "sizes[0] = 2" in messages[0]
    assert "sizes[1] = 2" in messages[1]
