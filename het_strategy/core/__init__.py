"""The planning core: what the cluster is, what the model costs, what a plan is and what it costs.

- ``errors.py``              ``ConfigError`` and the field/value/rule messages
- ``shipped.py``             finding a config shipped in ``het_strategy.configs``
- ``atomic_file.py``         write a file whole or not at all
- ``catalog.py`` + ``catalog.yaml``  device types and their datasheet figures
- ``cluster.py``             ``ClusterSpec``: nodes, devices, links (YAML schema)
- ``workload.py``            ``WorkloadSpec``: per-layer FLOPs, parameters, activations; measured profiles
- ``reference_profiles.py``  Sailor's published profiles as workloads
- ``plan.py``                ``Plan``: pipelines, stages, shares, experts (JSON schema)
- ``train_settings.py``      ``TrainSettings``: batch, dtype, ZeRO stage (and what ZeRO shards), search bounds
- ``cost_model.py``          ``CostModel``: a plan's step time and memory

Pure Python + numpy + PyYAML: no torch, no Lightning, no DeepSpeed.
"""
