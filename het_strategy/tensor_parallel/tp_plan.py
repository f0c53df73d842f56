"""A layer's tensor-parallel plan: which of its linears split by output columns and which by input rows.

The user contract (Megatron's split, written the way torch's
``parallelize_module`` takes a per-block plan): a pipeline layer that can run
on a tensor-parallel group has a method ``tensor_parallel_plan()`` returning
a ``TensorParallelPlan``::

    def tensor_parallel_plan(self) -> TensorParallelPlan:
        return TensorParallelPlan(
            linears={"attn.qkv": Colwise(fused=3), "attn.out": Rowwise(),
                     "mlp.0": Colwise(), "mlp.2": Rowwise()},
            divide=("attn.num_heads",))

``Colwise`` splits a linear's output features, ``Rowwise`` its input features
(their docstrings say what crosses the group); ``divide`` names integer
attributes divided by tp on each rank (the local head count); ``summed`` names
replicated parameters whose gradient is partial on each rank (a per-head norm).

Every other parameter (LayerNorms, a row-parallel bias, a layer without a
plan) is replicated: computed whole on each rank of the group.  A stage whose
layers have no plan at all cannot run at tp > 1 (``check_layers``).

Pure Python: the runtime (``tensor_parallel.layers``) and the checks read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Union

from het_strategy.core.errors import ConfigError, field_error

__all__ = ["Colwise", "Rowwise", "TensorParallelPlan", "ShardSpec", "tensor_parallel_plan_of", "check_layers"]


@dataclass(frozen=True)
class Colwise:
    """Split a linear's output features (Megatron's column-parallel linear).

    Its input is whole on every rank (the input's gradient is all-reduced over
    the group backward).  ``fused=3``: the output is three projections side by
    side (q, k, v), each split alone.  ``gather_output=True``: the outputs are
    all-gathered (a layer whose output must be whole, such as an LM head).
    """

    fused: int = 1
    """Projections side by side in the output (3 for a fused q, k, v): each is split alone."""
    gather_output: bool = False
    """All-gather the output so it is whole on every rank (only with ``fused == 1``)."""

    def __post_init__(self) -> None:
        if isinstance(self.fused, bool) or not isinstance(self.fused, int) or self.fused < 1:
            raise field_error("Colwise.fused", self.fused, "be an integer >= 1")
        if self.gather_output and self.fused != 1:
            raise field_error("Colwise.gather_output", True, "be False when fused > 1")


@dataclass(frozen=True)
class Rowwise:
    """Split a linear's input features (Megatron's row-parallel linear); the partial outputs are all-reduced.

    The input is the split output of a ``Colwise`` before it, through element-wise
    ops only; the partial outputs are all-reduced forward, then the whole bias is
    added.
    """


@dataclass(frozen=True)
class ShardSpec:
    """How one parameter is split: along ``dim``, as ``fused`` projections each cut into equal parts."""

    dim: int
    fused: int = 1


@dataclass(frozen=True)
class TensorParallelPlan:
    """Which linears of a layer split how (by submodule path), and which attributes are divided by tp."""

    linears: Mapping[str, Union[Colwise, Rowwise]]
    """Submodule path (``"attn.qkv"``, ``"mlp.0"``) -> ``Colwise()`` or ``Rowwise()``."""
    divide: tuple[str, ...] = field(default=())
    """Dotted paths of integer attributes divided by tp (``"attn.num_heads"``)."""
    summed: tuple[str, ...] = field(default=())
    """Dotted names of replicated parameters whose gradient each rank computes in part (a norm applied per head, as
    Hugging Face's ``replicated_with_grad_allreduce``): the group's gradient of each is the sum of the ranks'."""

    def __post_init__(self) -> None:
        for path, split in self.linears.items():
            if not isinstance(split, (Colwise, Rowwise)):
                raise field_error(f"TensorParallelPlan.linears[{path!r}]", split, "be Colwise() or Rowwise()")

    def shard_specs(self) -> dict[str, ShardSpec]:
        """Parameter name -> ``ShardSpec`` for every sharded parameter (the rest are replicated)."""
        out: dict[str, ShardSpec] = {}
        for path, split in self.linears.items():
            if isinstance(split, Colwise):
                out[f"{path}.weight"] = ShardSpec(0, split.fused)
                out[f"{path}.bias"] = ShardSpec(0, split.fused)
            else:
                out[f"{path}.weight"] = ShardSpec(1)
        return out


def tensor_parallel_plan_of(layer: Any) -> TensorParallelPlan | None:
    """The layer's ``tensor_parallel_plan()``, or None when it has none or it returns None (it then runs
    replicated)."""
    method = getattr(layer, "tensor_parallel_plan", None)
    if method is None:
        return None
    plan = method()
    if plan is None:
        return None
    if not isinstance(plan, TensorParallelPlan):
        raise ConfigError(f"{type(layer).__name__}.tensor_parallel_plan() returned {type(plan).__name__}; "
                          "it must return a het_strategy.TensorParallelPlan")
    return plan


def _resolve(layer: Any, path: str) -> Any:
    obj = layer
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() and hasattr(obj, "__getitem__") else getattr(obj, part)
    return obj


def check_layers(layers: list[Any], first: int, tp: int, units: int, field: str) -> None:
    """Refuse a stage at tp > 1 whose layers ``layers`` (global index ``first`` on) cannot split ``units`` ways.

    ``field`` names the plan's tp field.  Rules: at least one layer has a
    plan; every split linear exists and its split features (per fused
    projection) and every divided attribute divide evenly by ``units`` (the
    finest shard any replica of these layers uses) and by ``tp``.
    """
    if tp == 1 and units == 1:
        return
    planned = 0
    for i, layer in enumerate(layers):
        plan = tensor_parallel_plan_of(layer)
        if plan is None:
            continue
        planned += 1
        name = f"layers[{first + i}] ({type(layer).__name__})"
        for path, split in plan.linears.items():
            try:
                linear = _resolve(layer, path)
            except (AttributeError, IndexError, KeyError):
                raise ConfigError(f"{name}.tensor_parallel_plan() names '{path}', which the layer does not have")
            width = linear.out_features // split.fused if isinstance(split, Colwise) else linear.in_features
            what = "output features per projection" if isinstance(split, Colwise) else "input features"
            if width % units:
                raise field_error(field, tp, f"divide {name}.{path}'s {what} ({width}) into {units} equal parts "
                                  f"(the largest tp holding layer {first + i})", "re-plan with a smaller max_tp")
        for path in plan.divide:
            try:
                value = _resolve(layer, path)
            except (AttributeError, IndexError, KeyError):
                raise ConfigError(f"{name}.tensor_parallel_plan() divides '{path}', which the layer does not have")
            if not isinstance(value, int) or value % tp:
                raise field_error(field, tp, f"divide {name}.{path} ({value})", "re-plan with a smaller max_tp")
    if planned == 0 and tp > 1:
        raise field_error(field, tp, f"be 1 for layers [{first}, {first + len(layers)}): none of them has a "
                          "tensor_parallel_plan() (see het_strategy.TensorParallelPlan)",
                          "re-plan with max_tp=1, or give the blocks a tensor-parallel plan")
