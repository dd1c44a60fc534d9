"""``jaxmamba.hlo_flops`` / ``jaxmamba.pallas_work`` / ``jaxmamba.roofline.batch_flops``: the contractions a
compiled program performs, on programs whose FLOPs are known, the Pallas kernels' tile work for a batch, and
the FLOPs a batch needs (``plan`` compares the two for every mixed bucket)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from jaxmamba.config import HybridConfig
from jaxmamba.errors import ConfigError
from jaxmamba.hlo_flops import count_flops
from jaxmamba.pallas_work import BatchShape, KernelCall, filling_batch, kernel_work
from jaxmamba.random_checkpoint import random_config_dict
from jaxmamba.roofline import batch_flops, ssd_chunk_flops


def _hlo(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text()


def _spec(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def test_a_matmul_counts_two_flops_per_multiply_add():
    flops = count_flops(_hlo(lambda a, b: jnp.tanh(a @ b), _spec(8, 16), _spec(16, 32)))
    assert flops.total == 2 * 8 * 16 * 32 and not flops.unknown_kernels


def test_a_batched_contraction_counts_every_batch():
    flops = count_flops(_hlo(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), _spec(3, 8, 16), _spec(3, 16, 4)))
    assert flops.total == 2 * 3 * 8 * 16 * 4


def test_loop_bodies_count_their_trip_count():
    def body(_, x):
        return jnp.tanh(x @ x)

    flops = count_flops(_hlo(lambda x: jax.lax.fori_loop(0, 5, body, x), _spec(16, 16)))
    assert flops.total == 5 * 2 * 16 ** 3 and flops.unknown_trip_counts == 0


def test_elementwise_work_counts_nothing():
    assert count_flops(_hlo(lambda x: jnp.exp(x) * 2 + x.sum(), _spec(64, 64))).total == 0


TRITON_HLO = """HloModule m, entry_computation_layout={(f32[256,2,16]{2,1,0}, f32[256,2,16]{2,1,0})->f32[5,2,128,128]{3,2,1,0}}

ENTRY %main (c: f32[256,2,16], b: f32[256,2,16]) -> f32[5,2,128,128] {
  %c = f32[256,2,16]{2,1,0} parameter(0)
  %b = f32[256,2,16]{2,1,0} parameter(1)
  %cc = s32[6]{0} constant({0, 128, 200, 201, 256, 256})
  ROOT %pallas_call.1 = f32[5,2,128,128]{3,2,1,0} custom-call(%cc, %c, %b), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="jit(f)/ssd_bmm_cs128_bm64_bn16/pallas_call"}, backend_config={debug = false, grid_x = 5 : i32, grid_y = 2 : i32, grid_z = 4 : i32, ir = "ML\\EFR\\00\\22name = \\"x\\"", name = "ssd_bmm_cs128_bm64_bn16", num_stages = 2 : i32, num_warps = 4 : i32}
}
"""


def test_a_triton_pallas_call_counts_the_tiles_it_runs_for_the_batch():
    """The GPU form of a Pallas kernel: its name (block shapes) and grid read from the backend config (whose
    serialized IR may hold anything, even a quoted ``name =``), its work from the batch's chunks."""
    batch = BatchShape(new_tokens=(200, 1, 55), computed=(0, 0, 0), prefill=(True, True, True))
    assert batch.chunk_lengths(128) == [128, 72, 1, 55]
    flops = count_flops(TRITON_HLO, batch)
    # Causal 64 x 64 tiles inside each chunk: 3 (128 rows), 3 (72), 1 (1), 1 (55); 2 groups, state 16.
    assert flops.total == 2 * (3 + 3 + 1 + 1) * 64 * 64 * 16 * 2
    assert flops.kernels[0].kind == "ssd_bmm_cs128_bm64_bn16"
    without_batch = count_flops(TRITON_HLO)
    assert without_batch.total == 0 and without_batch.unknown_kernels == ["ssd_bmm_cs128_bm64_bn16"]


def test_chunks_follow_the_engines_alignment():
    """A row restarting mid-chunk (chunked prefill) finishes its partial chunk first; decode rows have none."""
    batch = BatchShape(new_tokens=(300, 1), computed=(100, 40), prefill=(True, False))
    assert batch.chunk_lengths(128) == [28, 128, 128, 16]


def test_attention_counts_whole_key_tiles_up_to_each_query_tiles_context():
    call = KernelCall("paged_attention_varlen_g4_d128_bs16_bq16_bk32", [], [[80, 32, 128]], (9, 8, 1))
    # One prompt of 40 tokens: tiles of 16, 16, 8 queries see 16, 32, 40 keys -> 1, 1, 2 key tiles of 32;
    # one decode row at 100 cached tokens: its tile sees 101 keys -> 4 key tiles.
    batch = BatchShape(new_tokens=(40, 1), computed=(0, 100), prefill=(True, False))
    tiles = 1 + 1 + 2 + 4
    assert kernel_work(call, batch) == 2 * 2 * tiles * 32 * 16 * 4 * 128 * 8


def test_a_kernel_without_a_formula_is_unknown():
    assert kernel_work(KernelCall("some_new_kernel_b64", [], [[4]], (1, 1, 1)),
                       BatchShape((1,), (0,), (True,))) is None


def test_the_batch_that_fills_a_bucket():
    b = filling_batch(2048, 256, 4, decode_context=1024)
    assert b.num_tokens == 2048 and len(b.new_tokens) == 256 and b.num_decodes == 252
    assert b.new_tokens[:4] == (449, 449, 449, 449) and set(b.computed[4:]) == {1024}
    assert filling_batch(16, 16, 16, 8).new_tokens == (1,) * 16
    assert filling_batch(8, 8, 4, 0).new_tokens == (1,) * 8  # 4 decode rows leave 4 tokens for 4 prompts
    with pytest.raises(ConfigError, match="no batch fills"):
        filling_batch(6, 8, 4, 0)


def _attention_only_cfg():
    raw = random_config_dict("nemotron_h", "tiny")
    raw.update(layers_block_type=["full_attention"], num_hidden_layers=1)
    raw.pop("hybrid_override_pattern", None)
    return HybridConfig.from_hf(raw)


def test_batch_flops_count_causal_attention_over_real_positions_only():
    cfg = _attention_only_cfg()
    d, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    projections = 2 * d * (q + 2 * kv) + 2 * q * d
    lm_head = 2 * d * cfg.vocab_size
    # A 5-token prompt (keys 1..5) and a decode row after 10 cached tokens (11 keys).
    batch = BatchShape((5, 1), (0, 10), (True, False))
    keys = 15 + 11
    assert batch_flops(cfg, batch) == 6 * projections + 4 * q * keys + 2 * lm_head
    assert batch_flops(cfg, batch, sampled_rows=1) == 6 * projections + 4 * q * keys + lm_head


def test_ssd_chunk_flops_grow_with_the_chunks_causal_pairs():
    cfg = HybridConfig.from_hf(random_config_dict("nemotron_h", "tiny"))
    h, p, n, g = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_d_state, cfg.mamba_n_groups
    assert ssd_chunk_flops(cfg, 1) == 2 * (n * g + p * h + 2 * p * n * h)
    assert ssd_chunk_flops(cfg, 4) == 2 * (10 * n * g + 10 * p * h + 8 * p * n * h)


CUBLAS_HLO = """HloModule m, entry_computation_layout={(f32[64,256]{1,0}, f32[512,256]{1,0})->f32[64,512]{1,0}}

ENTRY %main (a: f32[64,256], b: f32[512,256]) -> f32[64,512] {
  %a = f32[64,256]{1,0} parameter(0)
  %b = f32[512,256]{1,0} parameter(1)
  %gemm = (f32[64,512]{1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", metadata={op_name="jit(f)/dot_general"}, backend_config={"operation_queue_id":"0","gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]},"precision_config":{"operand_precision":["HIGHEST","HIGHEST"]}}}
  ROOT %out = f32[64,512]{1,0} get-tuple-element(%gemm), index=0
}
"""


def test_a_cublas_gemm_counts_from_its_dimension_numbers():
    assert count_flops(CUBLAS_HLO).total == 2 * 64 * 512 * 256
