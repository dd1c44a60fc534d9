"""Device state caches in vLLM's layouts, and the host-side pools that hand out their slots.

Device side (``StateCaches``, a pytree donated into every step):

* per Mamba layer: ``conv`` ``(num_slots, conv_dim, K-1+num_spec)`` (DS layout,
  channels ``[x|B|C]``) and ``ssm`` ``(num_slots, H, P, N)``;
* per attention layer: ``kv`` ``(2, num_blocks, block_size, kv_heads, head_dim)``
  (K then V, as vLLM's FlashAttention backend).

Slot 0 of every Mamba array and block 0 of every KV array are *null*: never
handed out, the target of padded rows, and never read into a real row. Arrays
are created with zeros (``jnp.empty`` is uninitialised from jax 0.11 on).

Host side: ``SlotPool`` (Mamba state slots) and ``BlockPool`` (attention KV
blocks) are free lists with reference counts (prefix caching shares blocks);
``check_invariants`` is what tests call after every step.
"""

from __future__ import annotations

import functools

from collections import deque
from dataclasses import dataclass
from typing import Iterable

import jax
import jax.numpy as jnp

from jaxmamba.config import HybridConfig
from jaxmamba.errors import SlotError
from jaxmamba.layout import NULL_SLOT, kv_cache_shape, state_shapes


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class StateCaches:
    """Every layer's device state; tuples are indexed by Mamba layer / attention layer order."""

    conv: tuple[jax.Array, ...]  # per Mamba layer: (num_slots, conv_dim, K-1+num_spec)
    ssm: tuple[jax.Array, ...]  # per Mamba layer: (num_slots, H, P, N)
    kv: tuple[jax.Array, ...]  # per attention layer: (2, num_blocks, block_size, kv_heads, head_dim)


def allocate_caches(
    cfg: HybridConfig,
    *,
    num_slots: int,
    num_blocks: int,
    block_size: int,
    num_spec: int = 0,
    dtype=jnp.float32,
    ssm_dtype=None,
) -> StateCaches:
    """Zero-filled caches. ``num_slots``/``num_blocks`` include the null slot/block 0."""
    conv_shape, ssm_shape = state_shapes(cfg, 1, num_spec=num_spec)
    kv_shape = kv_cache_shape(max(num_blocks, 1), block_size, max(cfg.num_key_value_heads, 1), max(cfg.head_dim, 1))
    return zero_caches(cfg, num_slots, num_blocks, (num_slots, *conv_shape), (num_slots, *ssm_shape), kv_shape,
                       dtype=dtype, ssm_dtype=ssm_dtype)


def zero_caches(cfg: HybridConfig, num_slots: int, num_blocks: int, conv_shape, ssm_shape, kv_shape, *,
                dtype=jnp.float32, ssm_dtype=None, out_shardings=None) -> StateCaches:
    """One zero-filled array per layer of the given global shapes (``allocate_caches`` and
    ``parallel.shard_caches``), created on device by one jitted call (``out_shardings``: where)."""
    if num_slots < 2:
        raise SlotError(f"num_slots={num_slots} must be >= 2 (slot 0 is the null slot)")
    if cfg.attention_layer_ids and num_blocks < 2:
        raise SlotError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the null block)")
    ssm_dtype = dtype if ssm_dtype is None else ssm_dtype

    @functools.partial(jax.jit, out_shardings=out_shardings)
    def make():
        return StateCaches(
            conv=tuple(jnp.zeros(conv_shape, dtype) for _ in cfg.mamba_layer_ids),
            ssm=tuple(jnp.zeros(ssm_shape, ssm_dtype) for _ in cfg.mamba_layer_ids),
            kv=tuple(jnp.zeros(kv_shape, dtype) for _ in cfg.attention_layer_ids),
        )

    return make()


class _RefCountedPool:
    """Free list over ids ``1..size-1`` (0 is null) with reference counts."""

    kind = "id"

    def __init__(self, size: int):
        if size < 2:
            raise SlotError(f"{self.kind} pool size {size} must be >= 2 (id 0 is the null {self.kind})")
        self.size = size
        self._free: deque[int] = deque(range(1, size))
        self._refs = [0] * size

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.size - 1 - len(self._free)

    @property
    def usage(self) -> float:
        return self.num_used / (self.size - 1)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int = 1) -> list[int]:
        if n > len(self._free):
            raise SlotError(f"{self.kind} pool exhausted: asked for {n}, {len(self._free)} free of {self.size - 1}")
        ids = [self._free.popleft() for _ in range(n)]
        for i in ids:
            self._refs[i] = 1
        return ids

    def share(self, ids: Iterable[int]) -> None:
        """Add a reference to ids already in use (a prefix-cache hit)."""
        for i in ids:
            self._check(i)
            if self._refs[i] == 0:
                raise SlotError(f"{self.kind} {i} is free; cannot share it")
            self._refs[i] += 1

    def free(self, ids: Iterable[int]) -> list[int]:
        """Drop one reference from each id; return the ids that became free."""
        released = []
        for i in ids:
            self._check(i)
            if self._refs[i] == 0:
                raise SlotError(f"{self.kind} {i} freed twice")
            self._refs[i] -= 1
            if self._refs[i] == 0:
                self._free.append(i)
                released.append(i)
        return released

    def refcount(self, i: int) -> int:
        return self._refs[i]

    def _check(self, i: int) -> None:
        if not 0 < i < self.size:
            raise SlotError(f"{self.kind} id {i} is out of range [1, {self.size})")

    def check_invariants(self) -> None:
        """No duplicate in the free list, no live id in it, the null id never handed out."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise SlotError(f"{self.kind} free list holds duplicates")
        if NULL_SLOT in free or self._refs[NULL_SLOT] != 0:
            raise SlotError(f"null {self.kind} 0 was handed out")
        live_free = [i for i in free if self._refs[i] != 0]
        if live_free:
            raise SlotError(f"{self.kind}s {live_free[:5]} are both free and referenced")
        if len(free) + sum(1 for r in self._refs[1:] if r > 0) != self.size - 1:
            raise SlotError(f"{self.kind}s leaked: some are neither free nor referenced")


class SlotPool(_RefCountedPool):
    """Mamba state slots (one "block" of vLLM's Mamba KV-cache group each)."""

    kind = "slot"


class BlockPool(_RefCountedPool):
    """Attention KV blocks of ``block_size`` tokens."""

    kind = "block"
