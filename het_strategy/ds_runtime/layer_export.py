"""A ``hetero_deepspeed`` checkpoint of one plan as a Hugging Face ``save_pretrained`` directory, without a run.

The per-layer files a checkpoint keeps beside DeepSpeed's own (``<checkpoint>/layers/``, ``layer_state``: each
layer's fp32 values, whole, by their names in the pipeline unit) name every tensor of a Hugging Face causal LM
through its units' ``hf_names()``, whatever plan wrote them.  ``layer_checkpoint_to_hf`` reads them one layer at a
time (as data: ``checkpoint_files.load_as_data``) and writes them through ``hf.checkpoint_export.write_layer_values``;
from a shell::

    python -c "from het_strategy.ds_runtime.layer_export import layer_checkpoint_to_hf as c; c('ckpt', 'cfg', 'out')"

A checkpoint of a plan with tensor-parallel stages keeps no per-layer files and is refused in one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from het_strategy.core.errors import field_error
from het_strategy.ds_runtime.checkpoint_files import load_as_data
from het_strategy.ds_runtime.layer_state import LAYERS_DIR, read_manifest

__all__ = ["layer_checkpoint_to_hf"]


def _layer_values(checkpoint: Path, num_layers: int) -> Iterator[dict[str, Any]]:
    for layer in range(num_layers):
        file = checkpoint / LAYERS_DIR / f"layer_{layer:03d}.pt"
        if not file.is_file():
            raise field_error("checkpoint", str(checkpoint), f"hold {LAYERS_DIR}/{file.name} (layer {layer})")
        yield {name: entry["value"] for name, entry in load_as_data(file, "checkpoint").items()}


def layer_checkpoint_to_hf(checkpoint: str | Path, config: Any, directory: str | Path, dtype: Any = None) -> Path:
    """Write the per-layer files of the ``hetero_deepspeed`` checkpoint directory ``checkpoint`` as a
    ``save_pretrained`` directory for the model of ``config`` (a ``PretrainedConfig``, a ``config.json`` or a
    directory holding one: the config the run's model was built from); ``dtype``: a torch dtype to cast to
    (default: as stored, fp32)."""
    from het_strategy.hf.checkpoint_export import write_layer_values

    manifest = read_manifest(checkpoint, "checkpoint")
    if manifest is None:
        raise field_error("checkpoint", str(checkpoint), f"hold per-layer files ({LAYERS_DIR}/manifest.json: a "
                          "hetero_deepspeed checkpoint of a plan without tensor-parallel stages)")
    num_layers = int(manifest["num_layers"])
    return write_layer_values(config, _layer_values(Path(checkpoint), num_layers), directory, dtype,
                              num_layers=num_layers)
