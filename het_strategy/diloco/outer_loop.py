"""The outer loop: the outer parameters and optimizer, the inner steps of the round, the outer step.

Every rank keeps the outer (global) parameters and the outer optimizer, in
the same state on every rank.  Each inner optimizer step adds its group's
samples to the round; after ``inner_steps`` of them the outer step runs:

1. ``delta = outer - local`` per parameter (flat): the group's pseudo-gradient;
2. the exchange averages ``samples x delta`` over the groups, weighted by
   their samples (``outer_exchange.py``);
3. the average is the outer parameters' gradient; the outer optimizer (Nesterov
   SGD by default) steps on it;
4. the model's parameters are set to the new outer parameters: every group
   starts the next round from them.  The inner optimizers keep their state.

The outer parameters are kept in fp32, or in the model's dtype where it is wider.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from het_strategy.core.log import logger
from het_strategy.diloco.outer_exchange import OuterExchange

__all__ = ["OuterRecord", "OuterLoop"]


@dataclass(frozen=True)
class OuterRecord:
    """What one outer step did (the loggers get it)."""

    round: int
    """Outer steps taken so far, this one included."""
    inner_steps: int
    """Inner steps of the round (``inner_steps``, fewer for a run's last, partial round)."""
    samples: int
    """Samples of the round over every group."""
    bytes_sent: int
    """Payload bytes this rank sent in the exchange."""
    pseudo_gradient_norm: float
    """L2 norm of the averaged pseudo-gradient."""


def _outer_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype == torch.float64 else torch.float32


class OuterLoop:
    """The outer parameters and optimizer of this rank (module docstring).

    The outer parameters are taken from the model when the loop is built (every group starts from them);
    ``run`` gives it the plan's inner steps and the exchange before the first inner step.

    Args:
        params: the model's trainable parameters, in the model's order (the same on every rank).
        make_optimizer: builds the outer optimizer over the outer parameters.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter],
                 make_optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer]) -> None:
        self.params = list(params)
        self.inner_steps = 0
        """H, inner optimizer steps per outer step (0 until ``run``)."""
        self.exchange: OuterExchange | None = None
        self.outer = [p.detach().to(_outer_dtype(p.dtype), copy=True).requires_grad_(True) for p in self.params]
        """The outer (global) parameters."""
        self.optimizer = make_optimizer(self.outer)
        self.step_in_round = 0
        """Inner steps taken in the current round."""
        self.round_samples = 0
        """This group's samples in the current round."""
        self.rounds = 0
        """Outer steps taken."""
        self.records: list[OuterRecord] = []
        """Every outer step of this run (the last 10 000)."""
        self._swapped: list[torch.Tensor] | None = None
        self._restored: tuple[int, str, torch.Tensor | None] | None = None

    # -- the round --------------------------------------------------------------------------------
    def run(self, inner_steps: int, exchange: OuterExchange) -> None:
        """Rounds of ``inner_steps`` through ``exchange`` from now on; a restored residual goes to ``exchange``
        when it was made in the same codec (else it starts from zero, logged)."""
        if self._restored is not None:
            saved_steps, codec, residual = self._restored
            if saved_steps != inner_steps:
                logger.info("hetero_diloco: the checkpoint's rounds were of %d inner steps, this run's are %d",
                            saved_steps, inner_steps)
            if residual is not None and codec == str(exchange.spec.token):
                exchange.residual = residual.to(self.outer[0].device)
            elif residual is not None:
                logger.info("hetero_diloco: the checkpoint's outer codec was %s, this run's is %s: the "
                            "error-feedback residual starts from zero", codec, exchange.spec.token)
            self._restored = None
        self.inner_steps, self.exchange = inner_steps, exchange

    def inner_step_done(self, group_samples: int) -> OuterRecord | None:
        """An inner step of ``group_samples`` (this group's) is done; the outer step when the round is full."""
        if self.exchange is None:
            raise RuntimeError("OuterLoop.run was not called before the first inner step")
        self.step_in_round += 1
        self.round_samples += group_samples
        if self.step_in_round < self.inner_steps:
            return None
        return self.outer_step()

    def outer_step(self) -> OuterRecord | None:
        """The outer step over the round so far (a collective over every rank); None when the round is empty."""
        if self.step_in_round == 0 or self.exchange is None:
            return None
        with torch.no_grad():
            delta = torch.cat([(o - p.to(o.dtype)).reshape(-1) for o, p in zip(self.outer, self.params)])
            done = self.exchange.average(delta * self.round_samples, self.round_samples)
            start = 0
            for o in self.outer:
                o.grad = done.average[start:start + o.numel()].view_as(o).clone()
                start += o.numel()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for o, p in zip(self.outer, self.params):
                p.copy_(o.to(p.dtype))
        self.rounds += 1
        record = OuterRecord(self.rounds, self.step_in_round, done.samples, done.bytes_sent,
                             float(done.average.norm()))
        self.records = self.records[-9_999:] + [record]
        self.step_in_round, self.round_samples = 0, 0
        return record

    # -- the outer parameters in the model ---------------------------------------------------------
    @contextmanager
    def outer_in_model(self) -> Iterator[None]:
        """The model holds the outer parameters inside the block, its own after (validation, checkpoints)."""
        if self._swapped is not None:  # already swapped in
            yield
            return
        with torch.no_grad():
            self._swapped = [p.detach().clone() for p in self.params]
            for o, p in zip(self.outer, self.params):
                p.copy_(o.to(p.dtype))
        try:
            yield
        finally:
            with torch.no_grad():
                for saved, p in zip(self._swapped, self.params):
                    p.copy_(saved)
            self._swapped = None

    def local_flat(self) -> torch.Tensor:
        """This rank's own parameters, flat (its group's, also while the outer ones are swapped in)."""
        local = self._swapped if self._swapped is not None else [p.detach() for p in self.params]
        return torch.cat([t.reshape(-1) for t in local]).cpu()


    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state every rank shares: outer parameters and optimizer, the position in the round (a group's
        own part, its parameters, inner optimizer, samples and residual, is ``GroupState``'s)."""
        return {"outer": [o.detach().cpu() for o in self.outer], "optimizer": self.optimizer.state_dict(),
                "inner_steps": self.inner_steps, "step_in_round": self.step_in_round, "rounds": self.rounds}

    def load_state_dict(self, state: dict[str, Any], group_samples: int, residual: torch.Tensor | None,
                        codec: str) -> None:
        """Restore ``state_dict``'s figures, this group's samples of the unfinished round and its leader's
        residual in ``codec`` (handed to the exchange by ``run``)."""
        with torch.no_grad():
            for o, saved in zip(self.outer, state["outer"]):
                o.copy_(saved.to(o.device, o.dtype))
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_in_round, self.rounds, self.round_samples = state["step_in_round"], state["rounds"], group_samples
        self._restored = (int(state["inner_steps"]), codec, residual)
