"""Other projects' results, rebuilt on our types, to check the cost model against (benchmarks and tests).

- ``sailor_profiles.py``   Sailor's vendored measurements (SOSP'25; ``data/sailor``) as our types: per-layer
                           times as a ``MeasuredProfile``, the bandwidth fits as ``SailorNetwork``
- ``sailor_simulator.py``  Sailor's runtime simulator, re-implemented to score our ``Plan`` objects with them
- ``sailor_memory.py``     Sailor's per-device memory of a pipeline stage (its planner's fit check: model state,
                           activations in flight, Megatron's overhead) from the vendored ``layer_memory.json``
- ``amp_plans.py``         AMP's measured plans on its V100 + T4 cluster (NeurIPS'22), as our ``Plan`` objects,
                           with AMP's measured iteration times (``data/amp/measured_plans.json``)
- ``amp_profile.py``       AMP's measured per-layer GPT-2 times on T4 and V100 at tp 1, 2, 4, as a
                           ``MeasuredProfile`` of ``gpt2_amp`` (``data/amp/known_cost.json``)

These import the planning core; the core and the planners never import them.  Pure Python: no torch.
"""

__all__: list[str] = []  # the package's modules are imported one by one
