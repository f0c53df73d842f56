"""het-plan and het-train: the Hydra command lines, their configs and jobs."""

__all__: list[str] = []  # the package's modules are imported one by one
