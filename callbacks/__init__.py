"""Lightning callbacks (straggler detection, telemetry), shipped as ``het_strategy.callbacks``."""

__all__: list[str] = []  # the package's modules are imported one by one
