"""Devices and networks that one machine plays for tests and benchmarks.

- ``speeds.py``       an emulated device's time per sample, slowdowns and noise (no torch)
- ``padding.py``      the comm-hook wrapper that pads a step to its emulated time (one for every runtime)
- ``netshape.py``     private network namespaces with a rate-limited loopback (``tc tbf``), and its CLI
- ``node_network.py`` several emulated nodes: a namespace per node, joined through a bridge by veth links whose
                      egress is shaped per node pair (``tc htb``): fast within a node, slow between nodes
- ``netns.py``        the ``ip netns`` plumbing under both: create, list, empty and delete a namespace
- ``local_ranks.py``  start N gloo ranks of a function (or a script, optionally on emulated nodes) on this machine
"""

__all__: list[str] = []  # the package's modules are imported one by one
