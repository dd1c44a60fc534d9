"""The step program: what one compiled step (``_step``) or window of decode steps (``_multi_step``) computes,
traced by ``jaxmamba.steps.CompiledSteps`` once per bucket and sampling variant.

A step reads two host buffers: ``int_buf`` (the packed metadata, then ``int_input_sizes``' fields) and
``float_buf`` (``FLOAT_INPUTS``), plus the persistent device block table and Mamba state-index table and the
previous step's ``last_tokens`` (``prev_last_tokens``); ``_step_inputs`` unpacks them. The model is rebuilt
from its flat parameter leaves inside the program (``_merge_model``). docs/architecture.md, "2. The data
path of one step", follows one step through.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxmamba.buckets import Bucket
from jaxmamba.cache import StateCaches
from jaxmamba.errors import ConfigError
from jaxmamba.layout import PAD_SLOT_ID
from jaxmamba.metadata import CacheMode, PackLayout, unpack
from jaxmamba.metadata.device_slots import DEVICE_SLOT_FIELDS, gather_slot_indices
from jaxmamba.model.serving import StepOptions, forward_step, from_weight_layout
from jaxmamba.sampling import MAX_BANNED_IDS, MAX_LOGPROBS, SamplingVariant, verify_and_sample


def int_input_sizes(bucket: Bucket, num_spec: int, multi_step: bool = False) -> dict[str, int]:
    """Fields that follow the packed metadata in ``int_buf``, in order, with their sizes. A multi-step
    program (``CompiledSteps(num_scheduler_steps=K)``) also reads ``num_steps`` (``int32[R]``: each row's
    decode steps in the window, 0 for padding rows). ``wants_logprobs``: 1 where the row asked for logprobs
    (a ``FULL`` step computes them only when some row did)."""
    r, s = bucket.num_reqs, 1 + num_spec
    sizes = {"token_ids": bucket.num_tokens, "top_k": r, "seeds": r, "steps": r, "num_drafts": r,
             "drafts": r * num_spec, "logit_positions": r * s, "min_tokens": r, "ban_ids": r * MAX_BANNED_IDS,
             "prev_token_rows": r, "row_map": r, "wants_logprobs": r}
    if multi_step:
        sizes["num_steps"] = r
    return sizes


#: Per-row floats of ``float_buf``, in order.
FLOAT_INPUTS = ("temperature", "top_p", "min_p")

def int_buffer_size(layout: PackLayout, bucket: Bucket, num_spec: int = 0, multi_step: bool = False) -> int:
    return layout.size + sum(int_input_sizes(bucket, num_spec, multi_step).values())


@dataclass
class _StepInputs:
    """What one step reads, unpacked from its buffers on the device (``_step_inputs``)."""

    common: object  # CommonAttentionMetadata, block_table = the persistent device table
    mamba: object  # MambaMetadata, slot arrays gathered from the state table
    fields: dict  # int_input_sizes' fields, by name
    sampling: dict  # temperature, top_p, min_p (float32[R])
    token_ids: jax.Array  # int32[T], the previous step's sampled tokens filled in


def _merge_model(graphdef, param_treedef, param_leaves, transposed: tuple[bool, ...]):
    """The model from its flat parameter leaves (``transposed``: leaves stored ``(in, out)``, see
    ``cpu_weight_layout``). Called where the weights are used: a loop that merges the model outside its body
    gets the transposed weights as loop operands, which XLA then copies on every call (the whole model)."""
    param_leaves = from_weight_layout(param_leaves, transposed)
    return nnx.merge(graphdef, jax.tree_util.tree_unflatten(param_treedef, param_leaves))


def _step_inputs(int_buf, float_buf, block_table, state_table, prev_last_tokens, *, layout: PackLayout,
                 bucket: Bucket, num_spec: int, max_rows: int, multi_step: bool = False) -> _StepInputs:
    r, s = bucket.num_reqs, 1 + num_spec
    fields, offset = {}, layout.size
    for name, size in int_input_sizes(bucket, num_spec, multi_step).items():
        fields[name] = int_buf[offset : offset + size]
        offset += size
    # block_table: the persistent int32[N, B] table, read in place by the attention kernels at row row_map[r]
    # for batch row r (padding rows: the null row). Gathering the [R, B] table the metadata describes would
    # make a step temporary as wide as max_model_len; unpack gets a placeholder of that shape, never computed.
    # The Mamba slot arrays packed apart are gathered from the persistent state table (state_table, int32[N, C])
    # at the same rows; their placeholders are replaced.
    separate = dict(layout.separate)
    common, mamba = unpack(int_buf[: layout.size], layout,
                           **{name: jnp.zeros(shape, jnp.int32) for name, shape in separate.items()})
    common = dataclasses.replace(common, block_table=block_table)
    if DEVICE_SLOT_FIELDS[0] in separate:
        mamba = gather_slot_indices(mamba, state_table, fields["row_map"])
    sampling = {name: float_buf[i * r : (i + 1) * r] for i, name in enumerate(FLOAT_INPUTS)}
    fields["logit_positions"] = fields["logit_positions"].reshape(r, s)
    fields["drafts"] = fields["drafts"].reshape(r, num_spec)
    fields["ban_ids"] = fields["ban_ids"].reshape(r, MAX_BANNED_IDS)
    # A row's last input token may still be on the device (async scheduling): the previous step sampled
    # it. Its position is the row's last scheduled token, which is where the row's last logit is read.
    prev_rows = fields["prev_token_rows"]
    target = jnp.where(prev_rows >= 0, fields["logit_positions"][:, -1], bucket.num_tokens)  # out of range: dropped
    token_ids = fields["token_ids"].at[target].set(prev_last_tokens[jnp.clip(prev_rows, 0, max_rows - 1)],
                                                   mode="drop")
    return _StepInputs(common, mamba, fields, sampling, token_ids)


def _sample(logits, inputs: _StepInputs, variant: SamplingVariant, steps=None):
    """``verify_and_sample`` over ``logits`` with the step's per-row parameters (``steps``: the sampler's
    step counters, default the host's)."""
    f, p = inputs.fields, inputs.sampling
    return verify_and_sample(
        logits, f["drafts"], f["num_drafts"], p["temperature"], f["top_k"], p["top_p"], f["seeds"],
        f["steps"] if steps is None else steps, min(MAX_LOGPROBS, logits.shape[-1]), min_p=p["min_p"],
        min_tokens=f["min_tokens"], ban_ids=f["ban_ids"], variant=variant,
        wants_logprobs=f["wants_logprobs"] > 0)


def _last_tokens(tokens, num_accepted, max_rows: int):
    """Each row's last output token, zero-padded to ``int32[max_rows]`` (the next step's ``prev_last_tokens``)."""
    last = jnp.take_along_axis(tokens, num_accepted[:, None], axis=1)[:, 0]
    # A pad, not zeros().at[:r].set(): jax 0.11.2's CPU compiler segfaulted on that update inside the TP
    # shard_map (bisected to the commit that added last_tokens; every TP engine test crashed).
    return jnp.pad(last.astype(jnp.int32), (0, max_rows - tokens.shape[0]))


def _step(graphdef, param_treedef, param_leaves, caches: StateCaches, int_buf, float_buf, block_table,
          state_table, prev_last_tokens, *, layout: PackLayout, bucket: Bucket, num_spec: int, opts: StepOptions,
          variant: SamplingVariant, max_rows: int, transposed: tuple[bool, ...] = ()):
    """One step: ``verify_and_sample``'s six outputs plus ``last_tokens`` (``int32[max_rows]``: each batch
    row's last accepted token, zero-padded; the next step's ``prev_last_tokens``), and the new caches.
    ``transposed``: which parameter leaves arrive as ``(in, out)`` (``cpu_weight_layout``)."""
    inputs = _step_inputs(int_buf, float_buf, block_table, state_table, prev_last_tokens, layout=layout,
                          bucket=bucket, num_spec=num_spec, max_rows=max_rows)
    model = _merge_model(graphdef, param_treedef, param_leaves, transposed)
    logits, caches = forward_step(model, caches, inputs.common, inputs.mamba, inputs.token_ids,
                                  inputs.fields["logit_positions"], opts, block_table_rows=inputs.fields["row_map"])
    outputs = _sample(logits, inputs, variant)
    return (*outputs, _last_tokens(outputs[0], outputs[1], max_rows)), caches


def _multi_step(graphdef, param_treedef, param_leaves, caches: StateCaches, int_buf, float_buf, block_table,
                state_table, prev_last_tokens, *, layout: PackLayout, bucket: Bucket, num_steps: int,
                opts: StepOptions, variant: SamplingVariant, max_rows: int, transposed: tuple[bool, ...] = (),
                ssm_working_set: bool = False):
    """Up to ``num_steps`` decode steps of a pure-decode bucket in one program (vLLM's multi-step
    scheduling): row ``r`` runs ``int_buf``'s ``num_steps[r]`` of them, each feeding the token it samples
    to the next, and the loop stops after the longest row's. Outputs as ``_step``'s with ``S = num_steps``:
    ``tokens[r, k]`` (and the logprob outputs) of step ``k``, ``num_accepted[r] = num_steps[r] - 1`` (the
    row's outputs are ``tokens[r, :num_steps[r]]``, as a speculative row's accepted tokens), and
    ``last_tokens`` the last of them.

    The host's metadata describes step 0; step ``k`` moves each running row ``k`` positions on: its
    position, sequence length and KV slot (read from the persistent block table, whose blocks the
    scheduler allocated for the whole window). A row past its own steps keeps its last position and
    writes nothing (KV slot -1, Mamba slots ``PAD_SLOT_ID``): its caches stay as its last step left them.
    Only cache mode ``none`` without speculative tokens (the Mamba slots do not move between steps)."""
    if not bucket.decode_only or bucket.num_tokens != bucket.num_reqs:
        raise ConfigError(f"multi-step decoding needs a pure-decode bucket of one token a row, got {bucket}")
    inputs = _step_inputs(int_buf, float_buf, block_table, state_table, prev_last_tokens, layout=layout,
                          bucket=bucket, num_spec=0, max_rows=max_rows, multi_step=True)
    common, mamba, fields = inputs.common, inputs.mamba, inputs.fields
    if mamba.cache_mode != CacheMode.NONE:
        raise ConfigError("multi-step decoding needs mamba_cache_mode='none'")
    r = bucket.num_reqs
    row_steps = fields["num_steps"]  # int32[R]; 0 for padding rows
    row_map = fields["row_map"]
    # ssm_working_set (the reference backend on the CPU): the rows' SSM states stay in a working set between
    # steps (one gather before the window, one scatter after it) instead of a gather and a scatter of the
    # cache at every step.
    per_row = ssm_working_set and bool(caches.ssm)
    if per_row:
        slots = mamba.state_indices_decode[:, 0]  # mode none: a row's one slot, read and written in place
        num_slots = caches.ssm[0].shape[0]
        cache_ssm = caches.ssm
        caches = dataclasses.replace(caches, ssm=tuple(s[jnp.clip(slots, 0, num_slots - 1)] for s in cache_ssm))
        opts = dataclasses.replace(opts, ssm_state_per_row=True)

    def one_step(k, caches, token_ids):
        common_k, mamba_k = _window_step_metadata(common, mamba, block_table, row_map, row_steps, k)
        model = _merge_model(graphdef, param_treedef, param_leaves, transposed)  # inside the loop body: see there
        logits, caches = forward_step(model, caches, common_k, mamba_k, token_ids, fields["logit_positions"],
                                      opts, block_table_rows=row_map)
        return _sample(logits, inputs, variant, steps=fields["steps"] + k), caches

    # Step 0 outside the loop: its outputs give the shapes of the window's buffers.
    first, caches = one_step(0, caches, inputs.token_ids)
    # Every output but num_accepted (int32[R]) is [R, S=1, ...]: step k fills column k.
    buffers = tuple(None if out is None or out.ndim == 1 else
                    jnp.zeros((r, num_steps, *out.shape[2:]), out.dtype).at[:, 0].set(out[:, 0]) for out in first)

    def body(carry):
        k, caches, buffers = carry
        outputs, caches = one_step(k, caches, buffers[0][:, k - 1])
        buffers = tuple(None if buf is None else buf.at[:, k].set(out[:, 0])
                        for buf, out in zip(buffers, outputs, strict=True))
        return k + 1, caches, buffers

    window = jnp.minimum(jnp.max(row_steps), num_steps)
    _, caches, buffers = jax.lax.while_loop(lambda carry: carry[0] < window, body, (jnp.int32(1), caches, buffers))
    if per_row:
        written = jnp.where((row_steps > 0) & (slots >= 0), slots, num_slots)  # out of range: dropped
        caches = dataclasses.replace(caches, ssm=tuple(
            cache.at[written].set(rows, mode="drop")
            for cache, rows in zip(cache_ssm, caches.ssm, strict=True)))
    # Clipped into the window: num_accepted indexes the [R, num_steps] outputs (the host never asks for more).
    num_accepted = jnp.clip(row_steps - 1, 0, num_steps - 1).astype(jnp.int32)
    tokens, _, *logprobs = buffers  # logprobs: token_logprobs, top_ids, top_logprobs, token_ranks (or None)
    return (tokens, num_accepted, *logprobs, _last_tokens(tokens, num_accepted, max_rows)), caches


def _window_step_metadata(common, mamba, block_table, row_map, row_steps, k):
    """The metadata of a window's step ``k`` from step 0's: each running row ``k`` positions on (its KV slot
    read from the persistent block table), a row past its own ``row_steps`` kept where it ended, writing
    nothing (KV slot -1, Mamba slots ``PAD_SLOT_ID``)."""
    bs, blocks = common.block_size, block_table.shape[1]
    active = k < row_steps
    moved = jnp.minimum(k, jnp.maximum(row_steps - 1, 0))  # a finished row stays where it ended
    positions = common.positions + moved
    block = block_table[row_map, jnp.clip(positions // bs, 0, blocks - 1)]
    slot_mapping = jnp.where(active, block * bs + positions % bs, -1)
    seq_lens = common.seq_lens + jnp.where(row_steps > 0, moved, 0)
    common_k = dataclasses.replace(
        common, positions=positions, seq_lens=seq_lens, max_seq_len=jnp.max(seq_lens).astype(jnp.int32),
        slot_mapping=jnp.where(k == 0, common.slot_mapping, slot_mapping).astype(jnp.int32))
    quiet = ~active[:, None]
    mamba_k = dataclasses.replace(
        mamba, state_indices_decode=jnp.where(quiet, PAD_SLOT_ID, mamba.state_indices_decode),
        state_indices_decode_dst=jnp.where(quiet, PAD_SLOT_ID, mamba.state_indices_decode_dst))
    return common_k, mamba_k
