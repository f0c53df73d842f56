"""DiLoCo across groups of devices (``strategy="hetero_diloco"``): the groups, the outer exchange, the outer loop.

- ``groups.py`` — the plan's device groups as process groups (one per group, one of the groups' leaders);
- ``outer_exchange.py`` — the sample-weighted average of the groups' pseudo-gradients over the slow link, in a
  codec of the registry with error feedback;
- ``outer_loop.py`` — the outer parameters and optimizer, the count of inner steps in the round, the outer step.
"""

__all__: list[str] = []  # the package's modules are imported one by one
