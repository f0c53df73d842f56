"""Gradient compression for DDP: hooks, their checkpointable state, the adaptive per-layer controller.

- ``config.py``      what the user asks (``CompressionConfig``: ``adaptive`` or one codec token)
- ``quantize.py``    bucketed 2-8 bit quantization and bit packing
- ``torch_codecs.py`` each codec's torch encoder and decoder (``TORCH_CODECS``), its bound and wire bytes; the
  codecs themselves (tokens, exchange, wire bytes, bound) are ``core/codecs.py``'s table
- ``duplex.py``      all-to-all and all-gather that run both directions of a link at once (on gloo: every
  receive posted before any send)
- ``exchange.py``    the collective behind each codec's exchange (flat fp32 in, world mean out)
- ``controller.py``  the per-layer choice: L-GreCo's dynamic program, link model (pure)
- ``adaptive.py``    ``AdaptiveController``, the controller at run time: measure layers, time the link, solve,
  agree across ranks (its schedule and measurements are its public fields)
- ``state.py``       ``CompressionState``: what the hook remembers between steps, owns the controller,
  checkpoints (``state_dict``)
- ``hook.py``        ``compression_hook`` (register on any DDP model with a ``CompressionState``)
- ``hierarchical.py`` ``hierarchical_hook``: uncompressed inside a node, compressed among node leaders
- ``wire_count.py``  ``counted_comm_hook``: any hook's bytes on the wire per rank, into a ``WireBytes``

Imports point one way: quantize <- config <- torch_codecs <- exchange; duplex <- exchange; controller;
adaptive <- state <- hook <- hierarchical; wire_count alone.
"""

from het_strategy.core.codecs import CODECS, Codec
from het_strategy.compression.config import METHODS, CompressionConfig, Scope, compression_config
from het_strategy.compression.torch_codecs import TORCH_CODECS, wire_bytes
from het_strategy.compression.controller import LayerOption, LinkModel, solve_layer_methods
from het_strategy.compression.adaptive import AdaptiveController, format_decisions
from het_strategy.compression.state import CompressionState
from het_strategy.compression.hook import compression_hook
from het_strategy.compression.wire_count import WireBytes, counted_comm_hook

__all__ = ["Codec", "CODECS", "TORCH_CODECS", "METHODS", "CompressionConfig", "Scope", "compression_config",
           "CompressionState", "compression_hook", "AdaptiveController", "format_decisions", "LayerOption",
           "LinkModel", "solve_layer_methods", "wire_bytes", "WireBytes", "counted_comm_hook"]
