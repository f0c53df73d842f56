"""Lightning callbacks (straggler detection, telemetry), shipped as ``het_strategy.callbacks``."""
