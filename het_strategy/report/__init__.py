"""What users read: the plan table (``table.py``), the low-communication plan beside the synchronous one
(``low_communication_report.py``), its picture (``picture.py``, matplotlib), the run's record (``run_record.py``)
and its wandb view (``wandb_view.py``)."""

__all__: list[str] = []  # the package's modules are imported one by one
