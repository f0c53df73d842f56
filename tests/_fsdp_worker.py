"""Rank functions of the ``hetero_fsdp`` runtime tests (run by ``run_local_ranks``: forked gloo ranks), and the
small model and data they share with the one-process reference.

``collectives``: the uneven all-gather / reduce-scatter on given sizes, beside gloo's own list collectives.
``train``: a 3-block MLP with a root (input and head Linear layers) sharded by ``FRACTIONS``, trained ``STEPS``
steps on uneven batch shares (each rank's loss weighted by ``n_r * world / N``, so the reduced gradient is the
global batch's mean), returning the full state dict and what the run observed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from het_strategy.fsdp import FLAT_SHARD, all_gather_uneven, reduce_scatter_uneven, shard_model

FRACTIONS = [4 / 7, 2 / 7, 1 / 7]
"""Shard fractions of ranks 0, 1, 2 (memories 4:2:1)."""
SHARES = [4, 4, 2]
"""Per-rank batch shares (speeds 1:1:0.5) of the global batch ``N``."""
N = 10
STEPS = 5
WIDTH = 8


class Block(nn.Module):
    """A residual MLP block (counting its forward runs: activation checkpointing runs each twice)."""

    forward_calls = 0

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.forward_calls += 1
        return x + self.fc2(torch.tanh(self.fc1(x)))


class MLP(nn.Module):
    """Root parameters (``inp``, ``head``) around three blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(5, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def build_model(dtype: torch.dtype = torch.float64, seed: int = 0) -> MLP:
    """The same initial model (float64 unless told) in every process (``seed``: another one)."""
    torch.manual_seed(seed)
    return MLP().to(dtype)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: ``N`` inputs and targets."""
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(N, 5, generator=g, dtype=torch.float64), torch.randn(N, 2, generator=g, dtype=torch.float64))


def optimizer_for(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def reference(opt: str, dtype: torch.dtype = torch.float64, clip: float | None = None,
              frozen: bool = False) -> dict[str, torch.Tensor]:
    """One process, the whole batch, ``STEPS`` steps: the state dict the sharded run must reach (``frozen``: the
    middle block's parameters not trained)."""
    model = build_model(dtype)
    model.blocks[1].requires_grad_(not frozen)
    optimizer = optimizer_for(opt, model.parameters())
    for step in range(STEPS):
        x, y = batch(step)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def collectives(rank: int, world: int, cases: list[list[int]]) -> list[dict]:
    """Per sizes case: this rank's inputs (integer-valued float64, so sums are exact) and what each collective
    returned, with gloo's own ``all_gather`` / ``reduce_scatter`` where the sizes are equal."""
    out = []
    for c, sizes in enumerate(cases):
        g = torch.Generator().manual_seed(10 * c + rank)
        shard = torch.randint(-50, 50, (sizes[rank],), generator=g).double()
        full = torch.randint(-50, 50, (sum(sizes),), generator=g).double()
        got = {"shard": shard, "full": full, "gathered": all_gather_uneven(shard, sizes),
               "piece": reduce_scatter_uneven(full, sizes, rank)}
        tensor, work = all_gather_uneven(shard, sizes, async_op=True)
        work.wait()
        got["gathered_async"] = tensor.clone()
        piece, work = reduce_scatter_uneven(full, sizes, rank, async_op=True)
        work.wait()
        got["piece_async"] = piece.clone()
        if len(set(sizes)) == 1:
            pieces = [torch.empty_like(shard) for _ in range(world)]
            dist.all_gather(pieces, shard)
            got["gloo_gathered"] = torch.cat(pieces)
            own = torch.empty_like(shard)
            dist.reduce_scatter(own, list(full.split(sizes)))
            got["gloo_piece"] = own
        out.append(got)
    return out


def train(rank: int, world: int, opt: str, fractions: list[float], prefetch: bool, checkpoint: bool,
          micro_batches: int, model_dtype: torch.dtype = torch.float64,
          param_dtypes: list[torch.dtype] | None = None, clip: float | None = None, frozen: bool = False,
          pattern: str = "fb", sync: bool = False) -> dict:
    """``STEPS`` sharded steps on this rank's share (in ``micro_batches`` pieces each: each forward then its
    backward (``pattern`` ``fb``), or every forward, then every backward (``ffbb``); computing in
    ``param_dtypes[rank]`` when given), then the full state dict (every rank's and rank 0's form) and what the run
    saw.  ``sync``: each rank starts from a model of its own (seed ``rank``) and ``shard_model`` takes rank 0's."""
    Block.forward_calls = 0  # the forked parent's own count (its reference runs) does not belong here
    model = build_model(model_dtype, seed=rank if sync else 0)
    model.blocks[1].requires_grad_(not frozen)
    compute = param_dtypes[rank] if param_dtypes else model_dtype
    sharded = shard_model(model, list(model.blocks), fractions, rank, world, prefetch=prefetch,
                          checkpoint_activations=checkpoint, param_dtype=param_dtypes[rank] if param_dtypes else None,
                          sync_module_states=sync)
    seen: dict[str, torch.dtype] = {}

    def see(module: nn.Module, args: tuple) -> None:  # the weight a layer of a block computes with
        seen.setdefault("weight", module.weight.dtype)

    model.blocks[0].fc1.register_forward_pre_hook(see)
    names = [name for name, _ in model.named_parameters()]
    optimizer = optimizer_for(opt, model.parameters())
    start = sum(SHARES[:rank])
    rows = SHARES[rank]
    held_after_forward = {}
    norms: list[float] = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[start:start + rows], y[start:start + rows]
        optimizer.zero_grad()
        losses = []
        for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches)):
            out = sharded(xm.to(compute)).to(model_dtype)
            losses.append(nn.functional.mse_loss(out, ym.to(model_dtype)) * (xm.shape[0] * world / N))
            if not held_after_forward:  # which units hold gathered memory between forward and backward
                held_after_forward = {u.name: u.full.untyped_storage().nbytes() for u in sharded.units}
            if pattern == "fb":
                losses.pop().backward()
        for loss in losses:
            loss.backward()
        grad_dtypes = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
        if clip is not None:
            norms.append(float(sharded.clip_grad_norm_(clip)))
        optimizer.step()
    held_after_step = {u.name: u.full.untyped_storage().nbytes() for u in sharded.units}
    with torch.no_grad():
        sharded(batch(0)[0].to(compute))
    held_after_eval = {u.name: u.full.untyped_storage().nbytes() for u in sharded.units}
    return {
        "compute_dtype": str(seen["weight"]),
        "norms": norms,
        "shard_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "grad_dtypes": sorted(grad_dtypes),
        "wire_dtypes": sorted({(str(u.gather_dtype), str(u.reduce_dtype)) for u in sharded.units}),
        "held_after_forward": held_after_forward,
        "held_after_eval": held_after_eval,
        "block_forward_calls": Block.forward_calls,
        "num_gathers": sharded.num_gathers,
        "num_prefetched": sharded.num_prefetched,
        "names": names,
        "shard_numels": [p.numel() for p in model.parameters()],
        "sizes": {u.name: u.sizes for u in sharded.units},
        "states": {u.name: u.state for u in sharded.units},
        "held_after_step": held_after_step,
        "flat_shard_name": FLAT_SHARD,
        "comm_wait_s": sharded.comm_wait_s,
        "full_everywhere": sharded.full_state_dict(rank0_only=False),
        "full_rank0": sharded.full_state_dict(),
    }
