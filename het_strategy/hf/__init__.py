"""Hugging Face causal LMs at run time: cut into pipeline units along their own ``base_model_pp_plan``
(``pipeline_units``), split by their own ``base_model_tp_plan`` (``tp_mapping``), trained with their own causal-LM
loss (``causal_lm_loss``), found in a LightningModule (``lightning_adapter``); their ``save_pretrained`` directories
read per rank (``checkpoints``) and written back per layer (``checkpoint_export``, ``checkpoint_files``); timed per
pipeline unit for the planner (``layer_profile``: ``planner.profile=measured``).
transformers and safetensors are imported inside the functions that use them (the extra ``hf``)."""

__all__: list[str] = []  # the package's modules are imported one by one
