"""Tensor parallelism for pipeline stages: a layer's plan (``tp_plan``, pure Python) and its split (``layers``)."""

from het_strategy.tensor_parallel.tp_plan import Colwise, Rowwise, ShardSpec, TensorParallelPlan

__all__ = ["Colwise", "Rowwise", "ShardSpec", "TensorParallelPlan"]
