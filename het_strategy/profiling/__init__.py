"""Measuring the real thing (torch): devices and links (``probe.py``), a module's blocks (``module_profile.py``).

- ``probe.py``           the collective probe of ``cluster="auto"``: measure, cache, build a ``ClusterSpec``
- ``measurements.py``    what the probe measured (device, allreduce, point-to-point), with a JSON form
- ``device_probe.py``    one device: matmul TFLOPS, memory, copy bandwidth
- ``link_probe.py``      the process group's links: allreduce and ring send/recv times
- ``probe_cache.py``     the probe's cache files
- ``module_profile.py``  ``profile_module``: a workload and measured times from a real ``nn.Module``
- ``segments.py``        the model cut into segments, and the timeline of a pass through them
- ``block_counts.py``    the counting pass: FLOPs, saved bytes, output bytes per segment
- ``block_times.py``     the timed passes: forward, backward and update seconds per segment
- ``batch_contents.py``  the tensors of a batch, its main tensor, its sample count
- ``torch_device.py``    torch's dtypes by the cost model's names; a device's synchronisation

What they measure becomes core objects (``ClusterSpec``, ``MeasuredProfile``) that the planner reads.
"""

__all__: list[str] = []  # the package's modules are imported one by one
