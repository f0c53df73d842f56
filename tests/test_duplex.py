"""``compression/duplex.py`` on real gloo ranks: its receive-first all-to-all and all-gather deliver what gloo's
own collectives deliver, over the world and over a subgroup, and post every receive before any send."""

import pytest
import torch
import torch.distributed as dist

from het_strategy.compression import duplex
from het_strategy.emulation.local_ranks import run_local_ranks

pytestmark = pytest.mark.multiprocess


def _rows(rank: int, world: int, width: int) -> torch.Tensor:
    """Rank ``rank``'s input: row j is meant for rank j, every entry says where it came from and went."""
    return torch.tensor([[100 * rank + 10 * j + k for k in range(width)] for j in range(world)],
                        dtype=torch.float32)


def _both(rank: int, world: int) -> dict:
    out = {}
    for name, group in (("world", dist.group.WORLD), ("odd", dist.new_group([1, 2]))):
        if group == dist.GroupMember.NON_GROUP_MEMBER:
            continue
        size, me = group.size(), group.rank()
        send = _rows(me, size, 3)
        mine, native = torch.empty_like(send), torch.empty_like(send)
        got = duplex.all_to_all(mine, send, group).wait()
        dist.all_to_all_single(native, send, group=group)
        piece = torch.arange(5, dtype=torch.float32) + 10 * me
        gathered, gathered_native = torch.empty(size * 5), torch.empty(size * 5)
        gathered_got = duplex.all_gather(gathered, piece, group).wait()
        dist.all_gather_into_tensor(gathered_native, piece, group=group)
        out[name] = {"a2a": mine, "a2a_native": native, "a2a_returned": got is mine, "ag": gathered,
                     "ag_native": gathered_native, "ag_returned": gathered_got is gathered}
    return out


def test_receive_first_collectives_equal_gloos_own_over_the_world_and_a_subgroup() -> None:
    results = run_local_ranks(_both, 3)
    for rank, result in enumerate(results):
        world = result["world"]
        assert torch.equal(world["a2a"], world["a2a_native"])
        # row i came from rank i, and was its row for this rank
        assert torch.equal(world["a2a"][:, 0], torch.tensor([100.0 * i + 10 * rank for i in range(3)]))
        assert torch.equal(world["ag"], world["ag_native"])
        assert torch.equal(world["ag"], torch.cat([torch.arange(5.0) + 10 * i for i in range(3)]))
        assert world["a2a_returned"] and world["ag_returned"]
        assert ("odd" in result) == (rank in (1, 2))
        if "odd" in result:
            odd = result["odd"]
            assert torch.equal(odd["a2a"], odd["a2a_native"]) and torch.equal(odd["ag"], odd["ag_native"])
            assert torch.equal(odd["ag"], torch.cat([torch.arange(5.0), torch.arange(5.0) + 10]))


class _Op:
    """Stands in for ``dist.P2POp``: what ``duplex`` asks to post, and in which order."""

    def __init__(self, op, tensor: torch.Tensor, peer: int, group=None, tag: int = 0) -> None:
        self.kind, self.peer = ("recv" if op is dist.irecv else "send"), peer


class _Group:
    def size(self) -> int:
        return 3

    def rank(self) -> int:
        return 1


def test_on_gloo_every_receive_is_posted_before_any_send(monkeypatch: pytest.MonkeyPatch) -> None:
    posted: list[tuple[str, int]] = []
    monkeypatch.setattr(dist, "get_backend", lambda group: dist.Backend.GLOO)
    monkeypatch.setattr(dist, "get_global_rank", lambda group, rank: 10 + rank)
    monkeypatch.setattr(dist, "P2POp", _Op)
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: posted.extend((op.kind, op.peer) for op in ops) or [])
    duplex.all_to_all(torch.empty(3, 2), torch.zeros(3, 2), _Group())
    duplex.all_gather(torch.empty(6), torch.zeros(2), _Group())
    assert posted == [("recv", 10), ("recv", 12), ("send", 10), ("send", 12)] * 2
