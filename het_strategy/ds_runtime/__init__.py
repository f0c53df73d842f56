"""The DeepSpeed runtime: a Plan as DeepSpeed config files and pipeline parts (``config.py``)."""
