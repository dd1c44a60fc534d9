"""A stand-in for a GPU device where the engine reads one (the sizing code's device memory): tests of code that
runs only on a GPU (docs/testing.md, "The engine's GPU choices, on the CPU")."""

from __future__ import annotations


class StandInH100:
    """What ``gpu_cache_budget`` reads of ``jax.devices()[0]``: the kind (matched to the H100 target) and the
    runtime's memory limit (``bytes_limit``)."""

    device_kind = "NVIDIA H100 80GB HBM3"

    def __init__(self, limit: int):
        self.limit = limit

    def memory_stats(self) -> dict[str, int]:
        return {"bytes_limit": self.limit}
