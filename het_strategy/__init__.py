"""het_strategy: heterogeneity-aware planning (and, next, training) for Lightning and DeepSpeed.

The planning core — ``cluster``, ``workload``, ``cost_model``, ``plan``,
``planning`` — imports neither torch nor Lightning nor DeepSpeed; runtime
modules (``profiling``, ``deepspeed_config``'s module factory) import them
where used.
"""

__version__ = "0.1.0"
