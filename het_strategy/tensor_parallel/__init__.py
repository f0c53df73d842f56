"""Tensor parallelism for pipeline stages: a layer's plan (``plan``, pure Python) and its split (``layers``)."""

from het_strategy.tensor_parallel.plan import Colwise, Rowwise, ShardSpec, TensorParallelPlan

__all__ = ["Colwise", "Rowwise", "ShardSpec", "TensorParallelPlan"]
