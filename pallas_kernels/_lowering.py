"""Lower kernels for an abstract NVIDIA H100 on a machine without a GPU.

Lowering runs the Pallas -> Triton IR translation, which is where Triton-only
errors show up (non power-of-2 loads, scalar prefetch, unsupported primitives);
it stops before PTX generation, so register pressure and Triton's own
shape limits (e.g. ``dot`` operands of at least 16 per dimension) are not
checked. jax 0.10 lowers for "cuda" without more; jax 0.11+ needs an abstract
GPU device from an ``AbstractMesh`` in scope.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import jax

__all__ = ["abstract_gpu", "lower_for_gpu"]


@contextlib.contextmanager
def abstract_gpu(device_kind: str = "NVIDIA H100", num_cores: int = 132):
    """Context in which ``lower(lowering_platforms=("cuda",))`` targets an abstract GPU."""
    try:
        from jax.sharding import AbstractDevice, AbstractMesh, use_abstract_mesh

        mesh = AbstractMesh(
            (1,),
            ("x",),
            abstract_device=AbstractDevice(device_kind=device_kind, num_cores=num_cores, platform="cuda"),
        )
        ctx = use_abstract_mesh(mesh)
    except (ImportError, TypeError, AttributeError):  # older jax: lowering needs no device
        ctx = contextlib.nullcontext()
    with ctx:
        yield


def lower_for_gpu(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    """Lower ``jax.jit(fn)(*args, **kwargs)`` for CUDA; return the StableHLO text.

    ``args`` may be ``jax.ShapeDtypeStruct``s or arrays; ``kwargs`` are passed
    as static (closed over). Raises whatever the Triton lowering raises.
    """
    jitted = jax.jit(lambda *a: fn(*a, **kwargs))
    with abstract_gpu():
        lowered = jitted.trace(*args).lower(lowering_platforms=("cuda",))
    return lowered.as_text()
