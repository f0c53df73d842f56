"""Hugging Face causal LMs at run time: cut into pipeline units along their own ``base_model_pp_plan``
(``pipeline_units``), split by their own ``base_model_tp_plan`` (``tp_mapping``), trained with their own causal-LM
loss (``causal_lm_loss``), found in a LightningModule (``lightning_adapter``).  transformers is imported inside the
functions that use it (the extra ``hf``)."""

__all__: list[str] = []  # the package's modules are imported one by one
