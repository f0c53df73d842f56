"""What users read: the plan table (``table.py``) and its picture (``picture.py``, matplotlib)."""
