"""The planning core: what the cluster is, what the model costs, what a plan is and what it costs.

- ``errors.py``              ``ConfigError`` and the field/value/rule messages
- ``shipped.py``             finding a config shipped in ``het_strategy.configs``
- ``files.py``               reading a file a user names: one ConfigError per failure, naming field and file
- ``atomic_file.py``         write a file whole or not at all
- ``catalog.py`` + ``catalog.yaml``  device types, their datasheet figures and list prices
- ``device_spec.py``         ``DeviceSpec``: one device, and the cluster YAML's device entry that builds it
- ``cluster.py``             ``ClusterSpec``: nodes, devices, links (YAML schema)
- ``pricing.py``             a plan's money: its used devices' $/hour and $/iteration
- ``workload.py``            ``WorkloadSpec``: per-layer FLOPs, parameters, activations; measured profiles
- ``plan.py``                ``Plan``: pipelines, stages, shares, experts (JSON schema)
- ``train_settings.py``      ``TrainSettings``: batch, dtype, ZeRO stage (and what ZeRO shards), search bounds
- ``dtypes.py``              the dtype tables: ``Dtype``, element sizes, Lightning's precision strings
- ``network.py``             what moving bytes costs: links, the ring allreduce, tensor-parallel allreduces
- ``runtime_rules.py``       what each runtime runs (the rule table), and the decisions its parts share
- ``codecs.py``              the gradient codecs (``Codec``, ``CODECS``): exchange, wire bytes per dtype, bound
- ``compressed_sync.py``     the price of a gradient sync whose inter-node hop is compressed
- ``cost_model.py``          ``CostModel``: a plan's step time and memory
- ``outer_sync_cost.py``     the price of low-communication rounds: inner steps and outer exchanges

Pure Python + numpy + PyYAML: no torch, no Lightning, no DeepSpeed.
"""

__all__: list[str] = []  # the package's modules are imported one by one
