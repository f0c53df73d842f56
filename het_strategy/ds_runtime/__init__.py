"""The DeepSpeed runtime: a Plan as DeepSpeed config files and pipeline parts (``ds_config.py``), and one rank of
the plan run on unpatched DeepSpeed with the update of a single process on the whole global batch
(``engine.py``: ``PlanRunner``, ``init_deepspeed_distributed``, ``check_runnable``)."""

__all__: list[str] = []  # the package's modules are imported one by one
