"""``HeteroMoE``: a mixture-of-experts feed-forward layer whose ranks hold *unequal* numbers of experts.

DeepSpeed's ``deepspeed.moe.layer.MoE`` needs ``num_experts % ep_size == 0``
and the same experts per rank; a planned placement such as ``[4, 4, 2, 2]``
experts for devices of speeds (1, 1, 0.5, 0.5) cannot run there.  This layer
takes the same arguments plus a placement, and:

1. routes each rank's own tokens (``gating.py``: top-k, capacity, noisy gates,
   GShard's auxiliary loss);
2. sends the kept (token, expert) pairs to the ranks holding their experts
   with ``all_to_all_single`` of *uneven* split sizes (``dispatch.py``,
   differentiable): padded to capacity as DeepSpeed does (``dispatch="capacity"``,
   the default with token dropping), or exactly the routed rows after an
   exchange of per-expert counts (``dispatch="exact"``);
3. runs each local expert on the tokens it received from every rank (on an
   emulated device, padded to the device's expert time, ``padding.py``);
4. sends the outputs back the same way and adds them up, weighted by the gate.

``forward`` returns ``(output, aux_loss, expert_counts)`` as DeepSpeed's layer
does.  Expert ``e`` is initialised from the RNG seeded with ``expert_seed + e``,
whichever rank builds it, so a placement changes where an expert lives, not
its weights.  Expert parameters carry ``allreduce = False`` (DeepSpeed's mark)
and ``het_expert = True``: a data-parallel wrapper must leave them out of its
gradient allreduce (``ddp.py``).  Without a process group the layer is one
rank holding every expert: the single-process reference.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from het_strategy.core.errors import ConfigError, field_error
from het_strategy.moe.dispatch import announce_capacity, dispatch_capacity, dispatch_exact
from het_strategy.moe.gating import NOISY_GATE_POLICIES, expert_capacity, jitter, route_tokens
from het_strategy.moe.padding import ExpertPadding, MoEClock, on_backward
from het_strategy.moe.placement import ExpertPlacement, check_placement, uniform_placement

__all__ = ["HeteroMoE"]


class HeteroMoE(nn.Module):
    """An MoE feed-forward layer with uneven expert placement (see the module docstring).

    Args:
        hidden_size: width of the tokens (last dimension of the input).
        expert: an ``nn.Module`` (copied per expert, parameters re-initialised) or
            a factory ``() -> nn.Module`` mapping ``[n, hidden_size]`` to itself.
        num_experts: experts of the layer (global).
        k: experts per token (top-k).
        capacity_factor: capacity per expert in training, as a multiple of
            ``k x tokens / num_experts`` (``drop_tokens=True``).
        eval_capacity_factor: the same in evaluation.
        min_capacity: capacity floor per expert.
        noisy_gate_policy: ``None``, ``"Jitter"`` (input noise) or ``"RSample"``
            (Gumbel noise on the selection), in training only.
        drop_tokens: drop the choices beyond capacity; ``False`` sends every choice.
        placement: one expert-id list per rank of ``group`` (e.g. from
            ``placements_from_plan``), or ``None`` for uniform.
        group: the expert-parallel process group (default: the whole world).
        expert_seed: seed of expert 0's initialisation (expert e uses
            ``expert_seed + e``); default: one draw of the global RNG.
        dispatch: ``"capacity"`` (with ``drop_tokens``, the default then:
            every expert gets ``capacity`` rows from every rank, zero-padded, as
            in DeepSpeed; only the ranks' capacities are exchanged; expert
            compute fixed by the expert count) or ``"exact"`` (only the routed rows, after an
            exchange of counts; the only layout without ``drop_tokens``).
    """

    def __init__(self, hidden_size: int, expert: nn.Module | Callable[[], nn.Module], num_experts: int = 1,
                 k: int = 1, capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 placement: Any = None, group: Any = None, expert_seed: int | None = None,
                 dispatch: str | None = None) -> None:
        super().__init__()
        _check_int(hidden_size, "moe.hidden_size", 1)
        _check_int(num_experts, "moe.num_experts", 1)
        _check_int(k, "moe.k", 1)
        if k > num_experts:
            raise field_error("moe.k", k, f"be <= moe.num_experts ({num_experts})")
        for name, value in (("moe.capacity_factor", capacity_factor),
                            ("moe.eval_capacity_factor", eval_capacity_factor)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise field_error(name, value, "be a number > 0")
        _check_int(min_capacity, "moe.min_capacity", 0)
        if noisy_gate_policy not in NOISY_GATE_POLICIES:
            raise field_error("moe.noisy_gate_policy", noisy_gate_policy,
                              f"be one of {', '.join(map(str, NOISY_GATE_POLICIES))}")
        if not isinstance(drop_tokens, bool):
            raise field_error("moe.drop_tokens", drop_tokens, "be true or false")
        dispatch = dispatch or ("capacity" if drop_tokens else "exact")
        if dispatch not in ("capacity", "exact") or dispatch == "capacity" and not drop_tokens:
            raise field_error("moe.dispatch", dispatch, "be exact, or capacity with drop_tokens=True (capacity "
                              "padding needs a capacity)")
        if not (isinstance(expert, nn.Module) or callable(expert)):
            raise field_error("moe.expert", type(expert).__name__, "be an nn.Module or a factory () -> nn.Module")
        self.hidden_size, self.num_experts, self.k = hidden_size, num_experts, k
        self.capacity_factor, self.eval_capacity_factor = float(capacity_factor), float(eval_capacity_factor)
        self.min_capacity, self.noisy_gate_policy, self.drop_tokens = min_capacity, noisy_gate_policy, drop_tokens
        self.group, self.dispatch = group, dispatch
        self._expert_source = expert
        self.expert_seed = int(torch.randint(0, 2 ** 31, (1,)).item()) if expert_seed is None else int(expert_seed)
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = nn.ModuleDict()
        self.placement: ExpertPlacement | None = None
        self.padding: ExpertPadding | None = None
        """Set by the runtime on an emulated device: pads the local experts' compute."""
        self.clock: MoEClock | None = None
        """Set by the runtime: collects the time spent inside this layer per batch."""
        self._trained = False
        world = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        self.place(placement if placement is not None else uniform_placement(num_experts, world, "moe.num_experts"))

    # -- placement ----------------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This rank's index in the placement (0 for a one-rank placement: every expert here, replicated)."""
        return self._rank

    @property
    def local_experts(self) -> list[int]:
        """The global ids of the experts this rank holds, in its local order."""
        assert self.placement is not None
        return list(self.placement.ranks[self.rank])

    def place(self, placement: Any) -> None:
        """Hold the experts ``placement`` gives this rank (before training: moving trained experts is refused).

        A one-rank placement (``[[0, ..., E-1]]``) keeps every expert on every rank:
        replicated experts, which data parallelism then averages like dense weights.
        """
        world = dist.get_world_size(self.group) if dist.is_available() and dist.is_initialized() else 1
        lists = placement.ranks if isinstance(placement, ExpertPlacement) else placement
        if isinstance(lists, (list, tuple)) and len(lists) == 1:
            world = 1
        checked = check_placement(placement, self.num_experts, world, "moe.placement")
        if self._trained and checked != self.placement:
            raise ConfigError("`moe.placement` cannot change after training steps: moving trained experts (and "
                              "their optimizer state) between ranks is not supported in this version")
        rank = dist.get_rank(self.group) if world > 1 else 0
        keep = {str(e): self.experts[str(e)] for e in checked.ranks[rank] if str(e) in self.experts}
        self.experts = nn.ModuleDict({str(e): keep[str(e)] if str(e) in keep else self._build_expert(e)
                                      for e in checked.ranks[rank]})
        self.placement, self._rank = checked, rank
        self._owner_slot = torch.tensor(checked.slots(), dtype=torch.long)

    def _build_expert(self, expert_id: int) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.expert_seed + expert_id)
            if isinstance(self._expert_source, nn.Module):
                module = copy.deepcopy(self._expert_source)
                for sub in module.modules():
                    if hasattr(sub, "reset_parameters"):
                        sub.reset_parameters()
            else:
                module = self._expert_source()
                if not isinstance(module, nn.Module):
                    raise field_error("moe.expert", type(module).__name__, "build an nn.Module")
        device = self.gate.weight.device
        module = module.to(device=device, dtype=self.gate.weight.dtype)
        for p in module.parameters():
            p.allreduce = False  # DeepSpeed's mark for expert parameters
            p.het_expert = True
        return module

    @property
    def params_per_expert(self) -> int:
        """Parameters of one expert (every expert is built alike)."""
        return sum(p.numel() for p in next(iter(self.experts.values())).parameters())

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for m in self.experts.values() for p in m.parameters()]

    # -- forward ------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if hidden_states.shape[-1] != self.hidden_size:
            raise field_error("input.hidden_size", hidden_states.shape[-1], f"be moe.hidden_size ({self.hidden_size})")
        if self.training and torch.is_grad_enabled():
            self._trained = True
        entered = time.perf_counter()
        box = [0.0]
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, self.hidden_size)
        clock = self.clock if self.training else None  # the batch padding times training batches only
        if clock is not None:  # on the input: the layer's backward is over
            x = on_backward(x, lambda: clock.add(time.perf_counter() - box[0]))
        capacity, announced = None, None
        if self.drop_tokens:
            factor = self.capacity_factor if self.training else self.eval_capacity_factor
            capacity = expert_capacity(x.shape[0], self.num_experts, self.k, factor, self.min_capacity)
            if self.dispatch == "capacity":
                assert self.placement is not None
                announced = announce_capacity(capacity, self.placement, self.rank, self.group)
        gate_in = jitter(x) if self.training and self.noisy_gate_policy == "Jitter" else x
        logits = self.gate(gate_in)
        routing = route_tokens(logits, self.k, capacity, self.training and self.noisy_gate_policy == "RSample")
        out = self._dispatch_and_combine(x, routing, capacity, announced)
        if clock is not None:  # on the output: the layer's backward begins
            out = on_backward(out, lambda: box.__setitem__(0, time.perf_counter()))
            clock.add(time.perf_counter() - entered)
        return out.reshape(shape), routing.aux_loss, routing.counts

    def _dispatch_and_combine(self, x: torch.Tensor, routing: Any, capacity: int | None,
                              announced: Any = None) -> torch.Tensor:
        kept = routing.kept.reshape(-1)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.k)[kept]
        expert = routing.expert.reshape(-1)[kept]
        weight = routing.weight.reshape(-1)[kept]
        slot = self._owner_slot.to(x.device)[expert]
        assert self.placement is not None
        if capacity is not None and self.dispatch == "capacity":
            position = routing.position.reshape(-1)[kept]
            sent = dispatch_capacity(x[token], slot, position, capacity, self.placement, self.rank, self.group,
                                     announced)
        else:
            order = torch.argsort(slot, stable=True)  # by holder rank, then its local expert order, then token
            token, weight, slot = token[order], weight[order], slot[order]
            sent = dispatch_exact(x[token], slot, self.placement, self.rank, self.group)
        grouped = sent.rows
        rows_here = int(grouped.shape[0])
        pbox = [0.0]
        padding = self.padding if self.training else None
        if padding is not None:  # the experts' backward is over: pad it to the emulated device's time
            grouped = on_backward(grouped, lambda: padding.pad(rows_here, time.perf_counter() - pbox[0], True))
        started = time.perf_counter()
        outputs, start = [], 0
        for e, n in zip(self.local_experts, sent.sizes):
            outputs.append(self.experts[str(e)](grouped[start:start + n]))
            start += n
        y = torch.cat(outputs)
        if padding is not None:
            padding.pad(rows_here, time.perf_counter() - started)
            y = on_backward(y, lambda: pbox.__setitem__(0, time.perf_counter()))  # the experts' backward begins
        contributions = sent.back(y) * weight[:, None].to(y.dtype)
        return x.new_zeros(x.shape).index_add(0, token, contributions)


def _check_int(value: Any, field: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise field_error(field, value, f"be an integer >= {minimum}")
