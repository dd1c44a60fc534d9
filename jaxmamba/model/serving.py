"""The model's serving forward: packed tokens, state caches and step metadata in, logits and caches out.

One call covers every layer of a bucket (static shapes). Rows are ordered
decodes first, then prefills; which rows are which comes from metadata leaves,
never from shapes:

* Mamba layers run the decode kernels (``causal_conv1d_update``,
  ``selective_state_update``) over the decode rows' tokens ``[0,
  num_decode_tokens)``, and the varlen prefill kernels (``causal_conv1d_varlen``,
  ``ssd_chunk_scan_varlen``) over the prefill tokens, which are shifted to start
  at 0 so the host-built prefill offsets apply directly. A pure-decode bucket
  skips the prefill kernels at trace time.
* Attention layers write this step's K/V into the paged cache and attend over
  each row's blocks (the flash-decoding kernel in a pure-decode bucket, the
  varlen kernel otherwise), as far as each token's real position.

dt is discretised once here (softplus, bias, ``time_step_limit``) and handed to
every kernel as is, so decode and prefill see bit-identical dt.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.cache import StateCaches
from jaxmamba.layout import PAD_SLOT_ID
from jaxmamba.metadata import CacheMode, CommonAttentionMetadata, MambaMetadata
from jaxmamba.model import ops
from jaxmamba.model.moe import use_grouped_method
from jaxmamba.model.paged_attention import paged_attention, write_kv
from pallas_kernels import dispatch
from pallas_kernels.reference import selective_state_update_rows, slot_usable, take_rows


#: Parameters that enter the step only as ``ops.linear`` weights (torch's ``(out, in)``): the names
#: ``cpu_weight_layout`` stores transposed.
LINEAR_WEIGHT_NAMES = frozenset({
    "in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    "input_linear", "output_linear", "lm_head", "router", "fc1_latent_proj", "fc2_latent_proj"})


def cpu_weight_layout(params) -> tuple[bool, ...]:
    """Which leaves of ``jax.tree_util.tree_flatten(params)`` a CPU step keeps transposed (``(in, out)``).

    XLA CPU's matmul library repacks an ``(out, in)`` weight on every call of ``x @ w.T``, at a cost that
    grows with the weight: the tiny model's ``[8, 64] x [512, 64]`` LM head took ~35 us of a ~250 us
    decode step, ~6 us from an ``(in, out)`` copy; the 21M model's greedy decode step went from ~25 to
    ~16 ms. The step transposes those leaves back at trace time (``from_weight_layout``), which XLA
    folds into the dot, so the model code and its numbers are unchanged."""
    flat, _ = jax.tree_util.tree_flatten_with_path(params)

    def name(path) -> str:
        keys = [getattr(k, "key", getattr(k, "name", None)) for k in path]
        keys = [k for k in keys if isinstance(k, str) and k != "value"]
        return keys[-1] if keys else ""

    return tuple(leaf.ndim == 2 and name(path) in LINEAR_WEIGHT_NAMES for path, leaf in flat)


def to_weight_layout(leaves: list, transposed: tuple[bool, ...]) -> list:
    """The flat parameter leaves with the ``transposed`` ones stored as ``(in, out)`` (once, on the host side).
    Abstract leaves (``ShapeDtypeStruct``: ``plan`` compiles without weights) get the transposed shape."""
    def flip(leaf):
        if isinstance(leaf, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(leaf.shape[::-1], leaf.dtype)
        # On the host (numpy's transpose, then one copy in): jnp's transpose would compile a program per shape
        # at every start.
        return jax.device_put(np.ascontiguousarray(np.asarray(leaf).T))

    return [flip(leaf) if t else leaf for leaf, t in zip(leaves, transposed, strict=True)]


def from_weight_layout(leaves: list, transposed: tuple[bool, ...]) -> list:
    """Inverse of ``to_weight_layout`` inside the traced step (no copy: XLA folds it into the dots)."""
    if not transposed:
        return list(leaves)
    return [leaf.T if t else leaf for leaf, t in zip(leaves, transposed, strict=True)]


@dataclass(frozen=True)
class StepOptions:
    """Trace-time switches of one compiled step."""

    backend: str = "reference"  # "reference" | "pallas"
    # Pallas interpreter: None means "when jax's default backend is the CPU"; False for GPU targets.
    interpret: bool | None = None
    has_prefill: bool = True  # False for pure-decode buckets: skip the varlen kernels
    # Multi-step windows on the reference backend: the SSM caches passed in hold one state per batch row
    # (the window's working set, row r = token r) and decode rows update them without index arrays;
    # a row whose state_indices_decode is PAD_SLOT_ID keeps its state (selective_state_update_rows).
    ssm_state_per_row: bool = False


def _conv_checkpoints(md: MambaMetadata, num_slots: int) -> dict:
    """The conv half of the block-end checkpoints (modes align/all), in ``causal_conv1d_varlen``'s form.

    The SSM checkpoints are the chunk states of chunks that end a Mamba block
    (``state_indices_chunk_checkpoint``); a slot is a (conv, SSM) pair, so the
    conv history after the same token goes to the same slot, or a prefix hit
    would resume with a stale conv state. Returns ``block_boundary_indices`` /
    ``block_boundary_slots`` ``int32[R, NC]``: for prefill row ``r`` and chunk
    ``c`` of that row with a checkpoint, the chunk's end counted from the row's
    first token; 0 / ``PAD_SLOT_ID`` (ignored) elsewhere.
    """
    ck = md.state_indices_chunk_checkpoint  # [NC]
    rows = jnp.arange(md.state_indices_prefill.shape[0])[:, None]  # [R, 1]
    mine = (md.seq_idx[None, :] == rows) & slot_usable(ck, num_slots)[None, :]
    ends = md.cu_chunk_seqlens[1:][None, :] - md.query_start_loc_prefill[rows]
    return dict(block_boundary_indices=jnp.where(mine, ends, 0).astype(jnp.int32),
                block_boundary_slots=jnp.where(mine, ck[None, :], PAD_SLOT_ID).astype(jnp.int32))


def mamba_step(mixer, normed, conv_state, ssm_state, md: MambaMetadata, opts: StepOptions):
    """One Mamba2 mixer over packed tokens ``normed [T, D]``; returns ``(out [T, D], conv_state, ssm_state)``."""
    cfg = mixer.cfg
    t = normed.shape[0]
    num_slots = ssm_state.shape[0]
    z, xbc, dt_raw = mixer.project_in(normed)
    dt = ops.discretize_dt(dt_raw, mixer.dt_bias[...], cfg.mamba_time_step_limit)  # [T, H] f32
    A = mixer.A()
    D = mixer.D[...]
    weight = mixer.conv_weight[...]
    bias = None if mixer.conv_bias is None else mixer.conv_bias[...]
    spec = md.num_spec > 0
    accepted = md.num_accepted_tokens if spec else None
    tok = jnp.arange(t)
    # A decode row has at most 1 + num_spec tokens: the decode kernels' token loops stop there, not at
    # the bucket's T (a mixed bucket of 2,048 tokens would otherwise loop ~2,000 times over R states).
    decode_len = 1 + md.num_spec

    # Decode rows: tokens [0, num_decode_tokens), one or 1+num_spec per row. The conv history is one
    # slot per request (column 0, as vLLM), read from the source window and written to the destination
    # window: the same slot in cache mode none, a fresh one after a prefix hit (never the shared slot).
    xbc_dec, conv_state = dispatch.causal_conv1d_update(
        xbc, conv_state, weight, bias, activation="silu",
        conv_state_indices=md.state_indices_decode[:, 0], dst_conv_state_indices=md.state_indices_decode_dst[:, 0],
        num_accepted_tokens=accepted, query_start_loc=md.query_start_loc_decode, max_query_len=decode_len,
        backend=opts.backend, interpret=opts.interpret,
    )
    x, B, C = mixer.split_xbc(xbc_dec)
    if opts.ssm_state_per_row:
        y_dec, ssm_state = selective_state_update_rows(ssm_state, x, dt, A, B, C, D, dt_softplus=False,
                                                       active=md.state_indices_decode[:, 0] != PAD_SLOT_ID)
    else:
        y_dec, ssm_state = dispatch.selective_state_update(
            ssm_state, x, dt, A, B, C, D, None, None, dt_softplus=False,
            state_batch_indices=md.state_indices_decode, dst_state_batch_indices=md.state_indices_decode_dst,
            num_accepted_tokens=accepted, cu_seqlens=md.query_start_loc_decode, max_query_len=decode_len,
            backend=opts.backend, interpret=opts.interpret,
        )
    y = y_dec

    if opts.has_prefill:
        nd = md.num_decode_tokens
        shift = jnp.clip(tok + nd, 0, t - 1)  # prefill token j sits at packed position nd + j
        checkpoints = md.cache_mode != CacheMode.NONE
        boundaries = _conv_checkpoints(md, num_slots) if checkpoints else {}
        xbc_pre, conv_state = dispatch.causal_conv1d_varlen(
            take_rows(xbc, shift), conv_state, weight, bias, activation="silu",
            query_start_loc=md.query_start_loc_prefill, cache_indices=md.state_indices_prefill_initial,
            has_initial_state=md.has_initial_state, dst_cache_indices=md.state_indices_prefill,
            backend=opts.backend, interpret=opts.interpret, **boundaries,
        )
        x, B, C = mixer.split_xbc(xbc_pre)
        src = md.state_indices_prefill_initial
        has_init = md.has_initial_state & slot_usable(src, num_slots)
        init = jnp.where(has_init[:, None, None, None], take_rows(ssm_state, jnp.clip(src, 0, num_slots - 1)), 0)
        y_pre, final, chunk_states = dispatch.ssd_chunk_scan_varlen(
            x, take_rows(dt, shift), A, B, C, D, None, None, chunk_size=md.chunk_size,
            cu_seqlens=md.query_start_loc_prefill, initial_states=init, has_initial_state=has_init,
            return_intermediate_states=checkpoints, dt_softplus=False,
            cu_chunk_seqlens=md.cu_chunk_seqlens, last_chunk_indices=md.last_chunk_indices, seq_idx=md.seq_idx,
            backend=opts.backend, interpret=opts.interpret,
        )
        rows = jnp.arange(final.shape[0])
        dst = md.state_indices_prefill
        write = (rows < md.num_prefills) & slot_usable(dst, num_slots)
        ssm_state = ssm_state.at[jnp.where(write, dst, num_slots)].set(final.astype(ssm_state.dtype), mode="drop")
        if checkpoints:
            ck = md.state_indices_chunk_checkpoint
            ssm_state = ssm_state.at[jnp.where(slot_usable(ck, num_slots), ck, num_slots)].set(
                chunk_states.astype(ssm_state.dtype), mode="drop")
        unshift = jnp.clip(tok - nd, 0, t - 1)
        y = jnp.where((tok < nd)[:, None, None], y_dec, take_rows(y_pre, unshift))

    y = y.reshape(t, cfg.mamba_intermediate_size).astype(jnp.float32)
    return mixer.project_out(y, z), conv_state, ssm_state


def attention_step(attention, hidden, kv, common: CommonAttentionMetadata, opts: StepOptions = StepOptions(),
                   row_map=None):
    """One attention mixer over packed tokens; returns ``(out [T, D], kv)``. ``row_map``: see ``forward_step``.

    A pure-decode bucket (``opts.has_prefill`` False) takes the flash-decoding kernel, any
    other the varlen kernel; both bound their work by the real positions.
    """
    q, k, v = attention.qkv(hidden, common.positions)
    kv = write_kv(kv, k, v, common.slot_mapping)
    attn = paged_attention(q, kv, common.block_table, common.query_start_loc, common.positions, attention.scale,
                           backend=opts.backend, interpret=opts.interpret, decode_only=not opts.has_prefill,
                           row_map=row_map)
    return attention.out(attn), kv


def forward_step(model, caches: StateCaches, common: CommonAttentionMetadata, mamba: MambaMetadata,
                 token_ids: jax.Array, logit_positions: jax.Array, opts: StepOptions,
                 block_table_rows: jax.Array | None = None) -> tuple[jax.Array, StateCaches]:
    """All layers over ``token_ids int32[T]``; returns float32 logits ``[R, S, V]`` at ``logit_positions [R, S]``.

    ``block_table_rows`` (``int32[R]``): ``common.block_table`` is then the engine's persistent
    ``int32[N, B]`` table and batch row ``r`` reads its row ``block_table_rows[r]``.

    ``S = 1 + num_spec``: a decode row verifying drafts needs logits at each of its tokens; other
    rows point every position at their last token.
    """
    conv, ssm, kv = list(caches.conv), list(caches.ssm), list(caches.kv)
    hidden = model.embed_tokens(token_ids)
    # MoE experts follow the kernel backend: the Pallas grouped GEMM with the Pallas kernels.
    with use_grouped_method("pallas" if opts.backend == "pallas" else None, interpret=opts.interpret):
        hidden = _layers(model, hidden, conv, ssm, kv, common, mamba, opts, block_table_rows)
    logits = model.logits(hidden[logit_positions])  # padded rows read token 0; ignored by the host
    return logits, StateCaches(conv=tuple(conv), ssm=tuple(ssm), kv=tuple(kv))


def _layers(model, hidden, conv: list, ssm: list, kv: list, common, mamba, opts, block_table_rows=None):
    """Every decoder layer over the packed tokens; updates the ``conv`` / ``ssm`` / ``kv`` lists in place."""
    for layer_idx, layer in enumerate(model.layers):
        mi = model.cfg.mamba_layer_ids.index(layer_idx) if layer.mamba is not None else None
        ai = model.cfg.attention_layer_ids.index(layer_idx) if layer.attention is not None else None

        def run_mamba(mixer, normed, mi=mi):
            out, conv[mi], ssm[mi] = mamba_step(mixer, normed, conv[mi], ssm[mi], mamba, opts)
            return out

        def run_attention(attention, x, ai=ai):
            out, kv[ai] = attention_step(attention, x, kv[ai], common, opts, block_table_rows)
            return out

        hidden = layer(hidden, mamba_fn=run_mamba, attention_fn=run_attention)
    return hidden
