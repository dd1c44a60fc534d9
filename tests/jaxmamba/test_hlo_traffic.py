"""``jaxmamba.hlo_traffic``: the bytes a compiled program moves, on programs whose bytes are known, and the
ideal bytes of a decode step (``jaxmamba.roofline``) at the 8B's widths."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxmamba.config import HybridConfig
from jaxmamba.hlo_traffic import RARE_BRANCH, analyze, array_bytes
from jaxmamba.roofline import ideal_decode_bytes

MIB = 1 << 20
X = jax.ShapeDtypeStruct((1024, 1024), jnp.float32)  # 4 MiB


def _hlo(fn, *args, donate=()):
    return jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()


def test_array_bytes_of_arrays_and_tuples():
    assert array_bytes("f32[8,128]{1,0}") == 8 * 128 * 4
    assert array_bytes("(bf16[2,3]{1,0}, s32[], pred[5])") == 12 + 4 + 5
    assert array_bytes("token[]") == 0


def test_an_elementwise_pass_reads_and_writes_its_array_once():
    traffic = analyze(_hlo(lambda x: x * 2 + 1, X))
    assert traffic.bytes_moved == 8 * MIB and traffic.kernel_launches == 1


def test_an_in_place_update_moves_the_update_not_the_buffer():
    """A donated buffer updated by dynamic_update_slice: the 32 KiB rows read and written (and the index),
    not the 4 MiB buffer."""
    rows = jax.ShapeDtypeStruct((8, 1024), jnp.float32)
    hlo = _hlo(lambda c, u, i: jax.lax.dynamic_update_slice(c, u, (i, 0)), X, rows, jnp.int32(0), donate=(0,))
    assert analyze(hlo).bytes_moved == 2 * 8 * 1024 * 4 + 4


def test_a_slice_reads_only_the_slice():
    traffic = analyze(_hlo(lambda x, i: jax.lax.dynamic_slice(x, (i, 0), (8, 1024)) * 2, X, jnp.int32(0)))
    assert traffic.bytes_moved <= 2 * 8 * 1024 * 4 + 64


def test_loop_bodies_count_their_trip_count():
    traffic = analyze(_hlo(lambda x: jax.lax.fori_loop(0, 5, lambda i, x: x * 2 + i, x), X))
    assert traffic.unknown_trip_counts == 0
    # Five passes over the array, plus at most the copy of the argument into the loop's state.
    assert 5 * 8 * MIB <= traffic.bytes_moved <= 6 * 8 * MIB + 1024
    assert traffic.kernel_launches >= 5


def test_a_conditional_counts_its_costliest_common_branch_and_reports_the_rare_one():
    """One branch runs. A fallback traced under ``RARE_BRANCH``'s scope (as the sampler's exact bisection) is
    reported apart; of the other branches the most expensive counts."""
    def slow(x):
        return jax.lax.fori_loop(0, 10, lambda i, x: x * 2 + i, x)

    def rare(x):
        with jax.named_scope(RARE_BRANCH):
            return slow(x)

    traffic = analyze(_hlo(lambda x, p: jax.lax.cond(p, rare, lambda x: x * 3, x), X, jnp.bool_(False)))
    assert traffic.bytes_moved <= 2 * 8 * MIB + 1024
    assert 9 * 8 * MIB <= traffic.worst_case_extra_bytes <= 12 * 8 * MIB
    # A loop of its own: jax caches a traced loop body with the name scope it was first traced under.
    common = analyze(_hlo(lambda x, p: jax.lax.cond(p, lambda x: jax.lax.fori_loop(0, 10, lambda i, x: x * 2 - i, x),
                                                    lambda x: x * 3, x), X, jnp.bool_(False)))
    assert common.bytes_moved >= 10 * 8 * MIB and common.worst_case_extra_bytes == 0


# A GPU program's shape, written out: a Pallas kernel updating row slots of a donated state pool in place
# (output 1 aliases operand 1), then a copy of the pool (what a failed donation costs).
POOL_PROGRAM = """HloModule step, input_output_alias={ {1}: (1, {}, may-alias) }

ENTRY %main (x: f32[4,256], pool: f32[64,256]) -> (f32[4,256], f32[64,256], f32[64,256]) {
  %x = f32[4,256]{1,0} parameter(0)
  %pool = f32[64,256]{1,0} parameter(1)
  %kernel = (f32[4,256]{1,0}, f32[64,256]{1,0}) custom-call(%x, %pool), custom_call_target="__gpu$xla.gpu.triton", output_to_operand_aliasing={{1}: (1, {})}, metadata={op_name="ssu"}
  %out = f32[4,256]{1,0} get-tuple-element(%kernel), index=0
  %new_pool = f32[64,256]{1,0} get-tuple-element(%kernel), index=1
  %copied = f32[64,256]{1,0} copy(%new_pool)
  ROOT %t = (f32[4,256]{1,0}, f32[64,256]{1,0}, f32[64,256]{1,0}) tuple(%out, %new_pool, %copied)
}
"""


def test_a_kernel_touches_the_pool_rows_a_step_addresses_but_a_copy_moves_the_pool():
    rows, pool = 4 * 256 * 4, 64 * 256 * 4
    traffic = analyze(POOL_PROGRAM, {1: rows})
    by_name = {k.name: k.bytes_moved for k in traffic.kernels}
    assert by_name["kernel"] == rows + rows + rows + rows  # x and the rows read; out and the rows written
    assert by_name["copied"] == 2 * pool
    assert traffic.kernel_launches == 2
    assert analyze(POOL_PROGRAM).kernels[0].bytes_moved == 2 * rows + 2 * pool  # not told: the whole pool


def test_ideal_decode_bytes_at_the_8b_widths():
    """NemotronH at the 8B's widths, layers M*M-, vocab 32768, bf16 (the GPU benchmarks' checkpoint): 1.41 GB of
    weights, of which the 256 MiB input embedding is only gathered from (its rows read); per row 2 MiB of SSM
    state a Mamba layer (read and written), 60 KiB of conv state, 4 KiB of KV per token."""
    import json
    from pathlib import Path

    raw = json.loads((Path(__file__).parents[2] / "jaxmamba/configs/nemotron_h_8b.json").read_text())
    raw.update(vocab_size=32768, layers_block_type=["linear_attention", "full_attention", "linear_attention", "mlp"])
    cfg = HybridConfig.from_hf(raw)
    ideal = ideal_decode_bytes(cfg, 128, 96, jnp.bfloat16)
    assert ideal.weights + 32768 * 4096 * 2 == 1_411_664_896 and ideal.embedding == 128 * 4096 * 2
    assert ideal.ssm_state == 2 * 128 * 2 * (128 * 64 * 128 * 2)
    assert ideal.conv_state == 2 * 128 * 2 * (10240 * 3 * 2)
    assert ideal.kv == 128 * 96 * 1 * (2 * 8 * 128 * 2)
    # An earlier estimate, 0.717 ms at 3.58 TB/s (2,567,195,648 B), counted the whole embedding table.
    assert ideal.total == 2_567_195_648 - 32768 * 4096 * 2 + 128 * 4096 * 2
    tied = HybridConfig.from_hf({**raw, "tie_word_embeddings": True})
    assert ideal_decode_bytes(tied, 128, 96, jnp.bfloat16).embedding == 0  # the LM head reads the table whole
    assert ideal_decode_bytes(cfg, 128, 96, jnp.bfloat16, jnp.float32).ssm_state == 2 * ideal.ssm_state
    with pytest.raises(ValueError, match="mean_context"):
        ideal_decode_bytes(cfg, 1, 0, jnp.bfloat16)
