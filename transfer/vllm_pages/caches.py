"""``VllmCaches``: a running vLLM's Mamba state slots and attention KV blocks, read and written per request
through vLLM's own block table (docs/architecture.md, "P/D across frameworks").

vLLM must run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one worker), with the DS conv layout
(``VLLM_SSM_CONV_STATE_LAYOUT=DS``: conv state ``(conv_dim, R)`` per slot, as jaxmamba's) and without
prefix caching (Mamba cache mode "none": a request's state after its last computed token is in the
first block of its Mamba block table, the slot vLLM's Mamba metadata builder hands the kernels).

Shapes (TP = 1, one layer): Mamba ``conv (conv_dim, R)``, ``ssm (H, P, N)``; attention tokens
``(2, num_tokens, num_kv_heads, head_dim)`` (K then V), gathered from vLLM's kernel-block view of the
cache, ``(num_kernel_blocks, num_kv_heads, kernel_block_size, 2*head_dim)`` on its CPU backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
from vllm.model_executor.models.utils import extract_layer_index
from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

from jaxmamba.errors import ConfigError, SlotError


def engine_core(vllm_llm) -> Any:
    """The in-process ``EngineCore`` of a ``vllm.LLM`` (its scheduler and model executor)."""
    client = vllm_llm.llm_engine.engine_core
    core = getattr(client, "engine_core", None)
    if core is None:
        raise ConfigError("vLLM's engine core runs in another process: set VLLM_ENABLE_V1_MULTIPROCESSING=0 "
                          "before creating the LLM, so that its caches live in this process")
    return core


@dataclass(frozen=True)
class _MambaLayer:
    group: int  # index into vLLM's kv_cache_groups (block table of get_block_ids)
    conv: torch.Tensor  # (num_slots, conv_dim, R)
    ssm: torch.Tensor  # (num_slots, H, P, N)


@dataclass(frozen=True)
class _AttentionLayer:
    group: int
    attn_group: Any  # vLLM's AttentionGroup: maps scheduler blocks to kernel blocks
    module: Any  # the Attention layer: its backend impl writes the cache
    kv: torch.Tensor  # (num_kernel_blocks, K, kernel_block_size, 2*head_dim)


class VllmCaches:
    """vLLM's per-layer cache tensors, keyed by jaxmamba's layer names (``layers.{i}.mixer`` / ``layers.{i}.attn``).

    ``request_state(request_id)`` gives a live request's Mamba slot and attention block ids from vLLM's
    KV cache manager; ``read_*`` / ``write_*`` copy one slot or one request's tokens to or from numpy.
    """

    def __init__(self, vllm_llm):
        core = engine_core(vllm_llm)
        self.scheduler = core.scheduler
        runner = core.model_executor.driver_worker.worker.model_runner
        if not is_conv_state_dim_first():
            raise ConfigError("vLLM keeps its conv state as (R, conv_dim) (SD): set VLLM_SSM_CONV_STATE_LAYOUT=DS "
                              "before creating the LLM, jaxmamba's layout is (conv_dim, R)")
        if self.scheduler.cache_config.enable_prefix_caching:
            raise ConfigError("vLLM runs with prefix caching (Mamba cache mode 'align'): create the LLM with "
                              "enable_prefix_caching=False, so that a request's state is its one Mamba slot")
        context = runner.compilation_config.static_forward_context
        num_layers = runner.model_config.hf_config.num_hidden_layers
        self.mamba: dict[str, _MambaLayer] = {}
        self.attention: dict[str, _AttentionLayer] = {}
        self.attention_block_size = 0
        self._position_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for g, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            for name in group.layer_names:
                index = extract_layer_index(name)
                cache = context[name].kv_cache
                if isinstance(spec, MambaSpec):
                    conv, ssm = cache
                    # FalconH1's layers hold attention and Mamba side by side; vLLM names layer i's Mamba
                    # cache "model.{num_hidden_layers + i}" so that the two caches get distinct names.
                    if index >= num_layers:
                        index -= num_layers
                    self.mamba[f"layers.{index}.mixer"] = _MambaLayer(g, conv, ssm)
                elif isinstance(spec, FullAttentionSpec):
                    attn_group = next(a for a in runner.attn_groups[g] if name in a.layer_names)
                    self.attention[f"layers.{index}.attn"] = _AttentionLayer(g, attn_group, context[name], cache)
                    self.attention_block_size = spec.block_size
                else:
                    raise ConfigError(f"vLLM layer {name!r} has a {type(spec).__name__}: only Mamba2 and full "
                                      "attention layers cross between the frameworks")
        self.mamba = dict(sorted(self.mamba.items(), key=lambda kv: _index(kv[0])))
        self.attention = dict(sorted(self.attention.items(), key=lambda kv: _index(kv[0])))

    # ------------------------------------------------------------------ shapes
    def mamba_shapes(self, layer: str) -> tuple[tuple[int, ...], tuple[int, ...], np.dtype, np.dtype]:
        """``(conv (conv_dim, R), ssm (H, P, N), conv dtype, ssm dtype)`` of one Mamba layer's slot."""
        m = self.mamba[layer]
        return tuple(m.conv.shape[1:]), tuple(m.ssm.shape[1:]), _np_dtype(m.conv), _np_dtype(m.ssm)

    def kv_token_shape(self, layer: str) -> tuple[tuple[int, int], np.dtype]:
        """``((num_kv_heads, head_dim), dtype)`` of one attention layer's token rows."""
        kv = self.attention[layer].kv
        return (kv.shape[1], kv.shape[3] // 2), _np_dtype(kv)

    def staging_shapes(self, block_size: int) -> SimpleNamespace:
        """Zero-size arrays with the shapes and dtypes of a TP=1 jaxmamba engine's caches for this model with
        ``block_size`` tokens per KV block (``StagingPool``'s ``caches``: it takes all but the page count)."""
        conv, ssm, kv = [], [], []
        for layer in self.mamba:
            conv_shape, ssm_shape, conv_dtype, ssm_dtype = self.mamba_shapes(layer)
            conv.append(np.empty((0, *conv_shape), conv_dtype))
            ssm.append(np.empty((0, *ssm_shape), ssm_dtype))
        for layer in self.attention:
            (heads, head_dim), dtype = self.kv_token_shape(layer)
            kv.append(np.empty((2, 0, block_size, heads, head_dim), dtype))
        return SimpleNamespace(conv=conv, ssm=ssm, kv=kv)

    # ------------------------------------------------------------------ a request's pages
    def request_state(self, request_id: str) -> tuple[dict[str, int], dict[str, list[int]]]:
        """``({mamba layer: slot}, {attention layer: scheduler block ids})`` of a request vLLM still holds."""
        try:
            block_ids = self.scheduler.kv_cache_manager.get_block_ids(request_id)
        except KeyError:
            raise SlotError(f"vLLM holds no blocks for request {request_id!r}") from None
        slots = {name: int(block_ids[m.group][0]) for name, m in self.mamba.items()}
        blocks = {name: [int(b) for b in block_ids[a.group]] for name, a in self.attention.items()}
        return slots, blocks

    def read_mamba(self, layer: str, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """Copies of one slot's ``conv (conv_dim, R)`` and ``ssm (H, P, N)``."""
        m = self.mamba[layer]
        return m.conv[slot].numpy().copy(), m.ssm[slot].numpy().copy()

    def write_mamba(self, layer: str, slot: int, conv: np.ndarray, ssm: np.ndarray) -> None:
        m = self.mamba[layer]
        m.conv[slot].copy_(torch.from_numpy(np.ascontiguousarray(conv)))
        m.ssm[slot].copy_(torch.from_numpy(np.ascontiguousarray(ssm)))

    def _token_index(self, layer: str, blocks: list[int], num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kernel block, row in block)`` of each of a request's first ``num_tokens`` tokens: vLLM's own
        scheduler-to-kernel block mapping (``AttentionGroup.map_to_kernel_block_table``)."""
        a = self.attention[layer]
        kernel_block_size = a.kv.shape[2]
        table = torch.tensor([blocks], dtype=torch.int32)
        kernel_blocks = a.attn_group.map_to_kernel_block_table(table)[0].clone().long()
        if num_tokens > len(kernel_blocks) * kernel_block_size:
            raise SlotError(f"{layer}: {num_tokens} tokens do not fit the request's {len(blocks)} vLLM blocks")
        tokens = torch.arange(num_tokens)
        return kernel_blocks[tokens // kernel_block_size], tokens % kernel_block_size

    def _halves(self, layer: str, kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V regions of every block, ``(blocks, K, kernel_block_size, head_dim)`` each: the CPU
        backend's own split (``CPUAttentionBackendImpl.forward``: view ``(blocks, K, 2*size, head_dim)``, chunk)."""
        blocks, heads, size, _ = kv.shape
        return kv.view(blocks, heads, 2 * size, -1).chunk(2, dim=2)

    def _positions(self, layer: str) -> tuple[torch.Tensor, torch.Tensor]:
        """Where vLLM's cache write puts each ``(row, head, dim)`` of a block: flat offsets into the block's K
        and V regions, ``(kernel_block_size, K, head_dim)`` each.

        The CPU kernels may keep K in a packed order of their own (the ``isa`` the backend picked), so it is
        learnt from vLLM's write itself: a scratch block written through ``impl.do_kv_cache_update`` with
        every element's own index (in base-256 digits, exact in any float dtype).
        """
        if layer in self._position_cache:
            return self._position_cache[layer]
        a = self.attention[layer]
        _, heads, size, two_head_dim = a.kv.shape
        count = size * heads * (two_head_dim // 2)
        if count > 256 * 256:
            raise ConfigError(f"{layer}: a KV block of {count} elements per half is too large to map (> 65536)")
        index = torch.arange(count).reshape(size, heads, two_head_dim // 2)
        found = [torch.zeros(count, dtype=torch.long), torch.zeros(count, dtype=torch.long)]
        for scale, digit in ((1, index % 256), (256, index // 256)):
            scratch = torch.zeros((1, *a.kv.shape[1:]), dtype=a.kv.dtype)
            values = digit.to(a.kv.dtype)
            a.module.impl.do_kv_cache_update(a.module, values, values, scratch, torch.arange(size))
            for total, half in zip(found, self._halves(layer, scratch), strict=True):
                total += scale * half.reshape(-1).long()
        positions = []
        for source in found:
            if not torch.equal(torch.sort(source).values, torch.arange(count)):
                raise ConfigError(f"{layer}: vLLM's cache write is not a permutation of a block's elements")
            position = torch.empty_like(source)
            position[source] = torch.arange(count)
            positions.append(position.reshape(size, heads, -1))
        self._position_cache[layer] = (positions[0], positions[1])
        return self._position_cache[layer]

    def read_kv_tokens(self, layer: str, blocks: list[int], num_tokens: int) -> np.ndarray:
        """``(2, num_tokens, num_kv_heads, head_dim)``: K and V of a request's first ``num_tokens`` tokens."""
        block, row = self._token_index(layer, blocks, num_tokens)
        used, which = torch.unique(block, return_inverse=True)
        out = []
        for half, position in zip(self._halves(layer, self.attention[layer].kv), self._positions(layer), strict=True):
            flat = half[used].reshape(len(used), -1)  # only the request's blocks, copied
            out.append(flat[which[:, None, None], position[row]])  # (num_tokens, K, head_dim)
        return torch.stack(out).numpy().copy()

    def write_kv_tokens(self, layer: str, blocks: list[int], tokens: np.ndarray) -> None:
        """Write ``tokens`` ``(2, num_tokens, num_kv_heads, head_dim)`` as a request's first tokens, through
        vLLM's own cache write (``impl.do_kv_cache_update``) at the slots of its block table."""
        a = self.attention[layer]
        block, row = self._token_index(layer, blocks, tokens.shape[1])
        data = torch.from_numpy(np.ascontiguousarray(tokens)).to(a.kv.dtype)
        a.module.impl.do_kv_cache_update(a.module, data[0], data[1], a.kv, block * a.kv.shape[2] + row)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _index(layer: str) -> int:
    return int(layer.split(".")[1])


def _np_dtype(t: torch.Tensor) -> np.dtype:
    return np.dtype(str(t.dtype).removeprefix("torch."))
