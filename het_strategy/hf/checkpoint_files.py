"""A Hugging Face ``save_pretrained`` directory as files: read by tensor name, written one layer at a time.

``PretrainedDirectory(path)`` checks a directory holds ``config.json`` and its weights (``model.safetensors``, or
the shards a ``model.safetensors.index.json`` names) and reads one tensor, or one slice of it
(``safe_open(...).get_slice``: only those bytes), by its name in the model's ``state_dict()``; ``check_config``
refuses a model whose config differs from the directory's in a field that shapes the weights.

``DirectoryWriter`` writes a directory that ``from_pretrained`` loads: one safetensors file per pipeline layer
(``model-00001-of-000NN.safetensors``, so at most one layer's tensors are in memory at a time), the index
naming the file of each tensor, and ``config.json``.  It writes under a hidden temporary directory beside the
target, renamed into place when complete: a reader never sees a half-written directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Mapping

from het_strategy.core.errors import field_error

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "INDEX_FILE", "SHAPING_FIELDS", "PretrainedDirectory", "check_config",
           "DirectoryWriter"]

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHAPING_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings",
                  "num_local_experts", "num_experts", "moe_intermediate_size", "n_embd", "n_layer", "n_head")
"""Config fields that decide the weights' names and shapes: a model and a directory must agree on each."""


class PretrainedDirectory:
    """A local ``save_pretrained`` directory: its config and where each tensor is (``field``: how errors name it)."""

    def __init__(self, path: str | Path, field: str = "pretrained") -> None:
        self.path = Path(path)
        self.field = field
        if not (self.path / CONFIG_FILE).is_file():
            raise field_error(field, str(path), f"be a save_pretrained directory holding {CONFIG_FILE}",
                              "save the model with model.save_pretrained(dir)")
        self.config: dict[str, Any] = json.loads((self.path / CONFIG_FILE).read_text())
        """The directory's ``config.json``."""
        self.files: dict[str, str] = self._weight_map()
        """Tensor name -> the safetensors file (in the directory) that holds it."""
        self.bytes_read = 0
        """Bytes of the tensors (or slices) ``read`` has returned."""
        self._open: dict[str, Any] = {}

    def _weight_map(self) -> dict[str, str]:
        from safetensors import safe_open

        if (self.path / INDEX_FILE).is_file():
            return dict(json.loads((self.path / INDEX_FILE).read_text())["weight_map"])
        if (self.path / WEIGHTS_FILE).is_file():
            with safe_open(str(self.path / WEIGHTS_FILE), framework="pt") as f:
                return {k: WEIGHTS_FILE for k in f.keys()}
        raise field_error(self.field, str(self.path), f"hold its weights as {WEIGHTS_FILE} or {INDEX_FILE} "
                          "(safetensors)", "save with model.save_pretrained(dir, safe_serialization=True)")

    def _handle(self, name: str) -> Any:
        from safetensors import safe_open

        if name not in self.files:
            raise field_error(self.field, str(self.path), f"hold tensor `{name}` (its weights have "
                              f"{len(self.files)} tensors, none of that name)")
        file = self.files[name]
        if file not in self._open:
            self._open[file] = safe_open(str(self.path / file), framework="pt")
        return self._open[file]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape of tensor ``name`` (read from the file's header only)."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, dim: int | None = None, ranges: tuple[tuple[int, int], ...] = ()) -> Any:
        """Tensor ``name`` whole, or (``dim`` given) the concatenation along ``dim`` of its ``ranges`` there: only
        those bytes are read (``get_slice``)."""
        import torch

        handle = self._handle(name)
        if dim is None:
            out = handle.get_tensor(name)
        else:
            part = handle.get_slice(name)
            index = (slice(None),) * dim
            out = torch.cat([part[index + (slice(a, b),)] for a, b in ranges], dim=dim)
        self.bytes_read += out.numel() * out.element_size()
        return out

    def close(self) -> None:
        """Close the files opened for reading."""
        self._open.clear()


def check_config(directory: PretrainedDirectory, config: Mapping[str, Any], what: str = "the model") -> None:
    """Refuse ``config`` (the model's ``config.to_dict()``) where it differs from the directory's in a field of
    ``SHAPING_FIELDS``, naming the field and both values."""
    for key in SHAPING_FIELDS:
        saved, mine = directory.config.get(key), config.get(key)
        if key in directory.config and key in config and saved != mine:
            raise field_error(f"{directory.path / CONFIG_FILE}.{key}", saved, f"equal {what}'s {key} ({mine!r})",
                              "build the model from this directory's config (AutoConfig.from_pretrained(dir))")


class DirectoryWriter:
    """Writes a ``save_pretrained`` directory at ``path``, one safetensors file per layer, then renames it in place.

    ``add_layer(tensors)`` once per layer in order (tensors by their Hugging Face name, on the CPU), then
    ``finish(config)``; ``abort()`` removes what was written.  An existing directory at ``path`` is replaced only
    when the new one is complete.
    """

    def __init__(self, path: str | Path, num_layers: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.path.parent, prefix=f".{self.path.name}."))
        self.num_layers = num_layers
        self.weight_map: dict[str, str] = {}
        self.total_size = 0
        self._layer = 0

    def add_layer(self, tensors: Mapping[str, Any]) -> None:
        """Write one layer's tensors (a name already written is refused: each tensor has one file)."""
        from safetensors.torch import save_file

        self._layer += 1
        file = f"model-{self._layer:05d}-of-{self.num_layers:05d}.safetensors"
        repeated = sorted(set(tensors) & set(self.weight_map))
        if repeated:
            raise field_error("tensors", repeated, "be named once in the directory")
        save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(self.tmp / file),
                  metadata={"format": "pt"})
        for k, v in tensors.items():
            self.weight_map[k] = file
            self.total_size += v.numel() * v.element_size()

    def finish(self, config: Any) -> Path:
        """Write the index and ``config`` (a ``PretrainedConfig``), then rename the directory into place."""
        index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.weight_map.items()))}
        (self.tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        config.to_json_file(str(self.tmp / CONFIG_FILE))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(self.tmp, 0o777 & ~umask)
        old = None
        if self.path.exists():
            old = self.path.with_name(f".{self.path.name}.old-{os.getpid()}")
            os.replace(self.path, old)
        os.replace(self.tmp, self.path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return self.path

    def abort(self) -> None:
        """Remove the temporary directory (the target is left as it was)."""
        shutil.rmtree(self.tmp, ignore_errors=True)
