"""Host time of the engine loop by phase (``python -m jaxmamba.bench serve --profile-host``).

``LLM.host_profile = HostProfile()`` turns it on; ``None`` (the default) costs one attribute
test per phase. Phases, in step order:

* ``schedule``: the scheduler (and draft proposal) picks the step's rows;
* ``metadata``: the runner builds the step's metadata and input buffers on the host;
* ``transfer``: the buffers go to the device (``jax.device_put``);
* ``dispatch``: the step's executable is called (returns once the work is enqueued);
* ``wait``: the host blocks until the step's outputs are ready (device time not hidden);
* ``read_back``: the outputs come back to the host (``jax.device_get``);
* ``record``: tokens, logprobs and stops are applied to the requests, blocks committed;
* ``detokenize``: ``RequestOutput``s (and their text) are built for the caller.

``wait`` is the device time the host did not overlap with its own work; everything else is
host time. In a synchronous engine nothing is hidden: the hidden share is
``device - wait`` over the host time, with ``device`` measured per step from dispatch to ready.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("schedule", "metadata", "transfer", "dispatch", "wait", "read_back", "record", "detokenize")
HOST_PHASES = tuple(p for p in PHASES if p != "wait")


@dataclass
class HostProfile:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    device_seconds: float = 0.0  # dispatch -> outputs ready, per step, summed
    num_steps: int = 0
    num_rows: int = 0  # batch rows over all steps
    num_output_tokens: int = 0

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    @property
    def host_seconds(self) -> float:
        return sum(self.seconds[p] for p in HOST_PHASES)

    @property
    def hidden_share(self) -> float:
        """Share of host time that ran while the device worked (0 for a synchronous engine)."""
        hidden = max(0.0, self.device_seconds - self.seconds["wait"] - self.seconds["dispatch"])
        return min(1.0, hidden / self.host_seconds) if self.host_seconds else 0.0

    def summary(self) -> dict:
        steps = max(self.num_steps, 1)
        out = {f"{p}_ms_per_step": 1e3 * self.seconds[p] / steps for p in PHASES}
        out.update(host_ms_per_step=1e3 * self.host_seconds / steps,
                   device_ms_per_step=1e3 * self.device_seconds / steps,
                   host_us_per_output_token=1e6 * self.host_seconds / max(self.num_output_tokens, 1),
                   mean_batch_rows=self.num_rows / steps, hidden_share=self.hidden_share, steps=self.num_steps)
        return out


@contextmanager
def maybe_phase(profile: HostProfile | None, name: str):
    """``profile.phase(name)``, or nothing when profiling is off."""
    if profile is None:
        yield
    else:
        with profile.phase(name):
            yield
