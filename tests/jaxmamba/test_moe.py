"""Mixture-of-experts hybrids: NemotronH ``E`` blocks and GraniteMoeHybrid experts.

The whole-sequence model against transformers 5.23 (several seeds, prompts crossing SSD chunk
boundaries), and the routing / grouped-matmul edge cases against the dense reference.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jaxmamba.config import HybridConfig
from jaxmamba.model.moe import MoE, dense_experts, grouped_experts, route
from jaxmamba.random_checkpoint import MOE_VARIANTS, random_config_dict

# ---------------------------------------------------------------------------- against transformers
VARIANTS = [
    ("nemotron_h_moe", 0, {}),
    ("nemotron_h_moe", 1, {}),
    ("nemotron_h_moe", 2, {"moe_latent_size": 24, "mlp_bias": True}),  # Nemotron-3 Super-style latent MoE
    ("nemotron_h_moe", 3, {"n_group": 1, "topk_group": 1, "norm_topk_prob": False, "num_experts_per_tok": 3}),
    ("granite_hybrid_moe", 0, {}),
    ("granite_hybrid_moe", 1, {}),
    ("granite_hybrid_moe", 2, {"num_experts_per_tok": 1, "position_embedding_type": None}),
]


@pytest.mark.parametrize("variant,seed,overrides", VARIANTS,
                         ids=[f"{v}-s{s}-{'-'.join(o) or 'default'}" for v, s, o in VARIANTS])
def test_logits_match_transformers(tmp_path, variant, seed, overrides):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hf_reference import hf_checkpoint, hf_logits
    from jaxmamba import load_pretrained

    path = hf_checkpoint(tmp_path, variant, seed=seed, **overrides)
    # 37 tokens: two full SSD chunks of 16 and a tail, so chunk boundaries are crossed.
    ids = np.random.default_rng(seed + 10).integers(0, 512, size=(2, 37)).astype(np.int32)
    ref = hf_logits(path, ids)
    model = load_pretrained(path)
    assert any(layer.moe is not None for layer in model.layers)
    ours = np.asarray(model(jnp.asarray(ids)))
    scale = np.abs(ref).max()
    assert scale > 0.5, "reference logits are degenerate; the comparison would prove nothing"
    err = np.abs(ours - ref).max() / scale
    assert err < 1e-4, f"max |Δlogit| / scale = {err:.2e}"


def test_config_fields():
    nem = HybridConfig.from_hf(random_config_dict("nemotron_h_moe"))
    assert nem.layer_types == ("mamba", "moe", "attention", "moe") and nem.moe_layer_ids == (1, 3)
    assert (nem.moe_num_experts, nem.moe_top_k, nem.moe_n_group, nem.moe_topk_group) == (8, 2, 2, 1)
    assert nem.moe_scoring == "sigmoid" and nem.moe_score_correction_bias and nem.moe_norm_topk_prob
    assert nem.moe_routed_scaling_factor == 2.5 and nem.moe_expert_kind == "relu2"
    assert nem.moe_shared_intermediate_size == 48 and nem.moe_latent_size is None
    pattern = HybridConfig.from_hf({**random_config_dict("nemotron_h_moe"), "layers_block_type": None,
                                    "hybrid_override_pattern": "ME*E"})
    assert pattern.layer_types == nem.layer_types
    gra = HybridConfig.from_hf(random_config_dict("granite_hybrid_moe"))
    assert gra.moe_layer_ids == (0, 1, 2, 3) and gra.moe_scoring == "softmax" and gra.moe_expert_kind == "gated"
    assert gra.moe_intermediate_size == 32 and gra.intermediate_size == 128  # experts vs shared MLP
    assert HybridConfig.from_hf(random_config_dict("granite_hybrid")).moe_layer_ids == ()
    assert set(MOE_VARIANTS) == {"nemotron_h_moe", "granite_hybrid_moe"}


def test_small_moe_checkpoints(tmp_path):
    from jaxmamba import load_pretrained, random_model

    for variant in MOE_VARIANTS:
        model = load_pretrained(random_model(variant, size="small", path=tmp_path / variant))
        assert model.cfg.moe_num_experts == 16 and model.cfg.moe_top_k == 4
        assert np.isfinite(np.asarray(model(jnp.arange(8, dtype=jnp.int32)[None]))).all()


# ---------------------------------------------------------------------------- routing edge cases
E, D, I = 8, 16, 12


def _experts(kind, seed=0):
    rng = np.random.default_rng(seed)
    u = 2 * I if kind == "gated" else I
    return (jnp.asarray(rng.standard_normal((E, u, D)) / 4, jnp.float32),
            jnp.asarray(rng.standard_normal((E, D, I)) / 4, jnp.float32))


def _per_token_loop(x, weights, ids, up, down, kind, activation):
    """The definition, one token and one assignment at a time (numpy)."""
    from jaxmamba.model.moe import _expert_activation

    out = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = np.asarray(_expert_activation(jnp.asarray(up[e] @ x[t]), kind, activation))
            out[t] += float(weights[t, j]) * (np.asarray(down[e]) @ h)
    return out


@pytest.mark.parametrize("kind,activation", [("relu2", "relu2"), ("gated", "silu")])
def test_grouped_matches_dense_and_the_definition(kind, activation):
    rng = np.random.default_rng(3)
    up, down = _experts(kind)
    x = jnp.asarray(rng.standard_normal((11, D)), jnp.float32)
    weights, ids = route(jnp.asarray(rng.standard_normal((11, E)), jnp.float32), top_k=3, scoring="softmax")
    grouped = grouped_experts(x, weights, ids, up, down, kind=kind, activation=activation)
    dense = dense_experts(x, weights, ids, up, down, kind=kind, activation=activation)
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(dense), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grouped), _per_token_loop(np.asarray(x), weights, ids, up, down, kind,
                                                                    activation), rtol=1e-5, atol=1e-5)


def test_router_ties_go_to_the_lower_expert():
    logits = jnp.zeros((4, E), jnp.float32)  # every expert scores the same
    w, ids = route(logits, top_k=2, scoring="softmax")
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1]] * 4)
    np.testing.assert_allclose(np.asarray(w), 0.5)
    # Sigmoid grouped top-k: tied groups -> group 0 (experts 0..3); tied experts inside it -> 0, 1.
    w, ids = route(logits, top_k=2, scoring="sigmoid", correction_bias=jnp.zeros(E), n_group=2, topk_group=1,
                   norm_topk_prob=True, routed_scaling_factor=2.5)
    np.testing.assert_array_equal(np.asarray(ids), [[0, 1]] * 4)
    np.testing.assert_allclose(np.asarray(w), 1.25, rtol=1e-6)
    # A tie broken by the correction bias only: the choice moves, the weight is the uncorrected score.
    bias = jnp.zeros(E).at[6].set(0.5)
    w, ids = route(logits, top_k=1, scoring="sigmoid", correction_bias=bias, n_group=2, topk_group=1)
    np.testing.assert_array_equal(np.asarray(ids), [[6]] * 4)
    np.testing.assert_allclose(np.asarray(w), 0.5, rtol=1e-6)  # sigmoid(0), no renormalisation


def test_group_mask_excludes_experts_outside_the_best_groups():
    # Expert 7 has the single best score but group 0 (experts 0..3) has the better top-2 sum.
    logits = jnp.asarray([[2.0, 2.0, -5, -5, -5, -5, -5, 3.0]], jnp.float32)
    _, ids = route(logits, top_k=2, scoring="sigmoid", n_group=2, topk_group=1)
    assert sorted(np.asarray(ids)[0].tolist()) == [0, 1]
    _, ids = route(logits, top_k=2, scoring="sigmoid", n_group=1, topk_group=1)
    assert 7 in np.asarray(ids)[0].tolist()


def _moe_module(variant, **overrides):
    cfg = HybridConfig.from_hf(random_config_dict(variant, **overrides))
    from flax import nnx

    from jaxmamba.random_checkpoint import random_tensors
    from jaxmamba.weights import params_from_tensors

    pure = params_from_tensors(cfg, random_tensors(cfg, seed=5))
    layer = cfg.moe_layer_ids[0]
    modules = {}
    for impl in ("grouped", "dense"):
        m = MoE(cfg, jnp.float32, implementation=impl)
        state = nnx.state(m, nnx.Param)
        nnx.replace_by_pure_dict(state, pure["layers"][layer]["moe"])
        nnx.update(m, state)
        modules[impl] = m
    return cfg, modules


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_routing_edge_cases_grouped_equals_dense(variant):
    cfg, mods = _moe_module(variant)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((9, cfg.hidden_size)), jnp.float32)

    def both(m_x):
        g, d = (np.asarray(mods[k](m_x)) for k in ("grouped", "dense"))
        np.testing.assert_allclose(g, d, rtol=1e-5, atol=1e-5)
        return g

    base = both(x)
    # An expert that receives no token: push expert 3's router row far down.
    for m in mods.values():
        m.router[...] = m.router[...].at[3].set(-100 * jnp.abs(m.router[...][3]) - 100 * jnp.sign(x.sum(0)))
    w, ids = mods["grouped"].route(x)
    assert 3 not in np.asarray(ids)
    both(x)
    # All tokens to one expert set: identical tokens route identically; with one dominant expert row
    # every token's top-1 is that expert.
    for m in mods.values():
        m.router[...] = m.router[...].at[5].set(50 * x.mean(0) / jnp.linalg.norm(x.mean(0)))
    same = jnp.broadcast_to(x.mean(0), x.shape)
    _, ids = mods["grouped"].route(same)
    assert (np.asarray(ids)[:, 0] == 5).all()
    out = both(same)
    np.testing.assert_allclose(out, np.broadcast_to(out[0], out.shape), rtol=1e-5, atol=1e-6)
    del base, w


def test_grouped_experts_compile_once_per_shape():
    up, down = _experts("relu2")
    fn = jax.jit(lambda x, w, i: grouped_experts(x, w, i, up, down, kind="relu2", activation="relu2"))
    x = jnp.ones((6, D), jnp.float32)
    w = jnp.full((6, 2), 0.5, jnp.float32)
    outs = []
    for ids in ([[0, 1]] * 6, [[7, 7]] * 6, [[i % E, (i + 3) % E] for i in range(6)]):  # spread / one expert
        outs.append(fn(x, w, jnp.asarray(ids, jnp.int32)))
    assert fn._cache_size() == 1
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(
        dense_experts(x, w, jnp.full((6, 2), 7, jnp.int32), up, down, kind="relu2", activation="relu2")),
        rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", ["ragged_dot", "tiled", "pallas"])
@pytest.mark.parametrize("routing", ["random", "one_expert", "two_experts_rest_empty"])
def test_grouped_methods_match_dense(method, routing):
    rng = np.random.default_rng(7)
    up, down = _experts("gated")
    t, k = 13, 3
    x = jnp.asarray(rng.standard_normal((t, D)), jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (t, k)), jnp.float32)
    if routing == "random":
        ids = np.stack([rng.permutation(E)[:k] for _ in range(t)])
    elif routing == "one_expert":
        ids = np.full((t, k), 4)  # more rows than a tile, all in one group
    else:
        ids = np.where(np.arange(t * k).reshape(t, k) % 2, 1, 6)
    ids = jnp.asarray(ids, jnp.int32)
    tile_rows = 16 if method == "pallas" else 4  # Triton dot: >= 16 rows
    got = grouped_experts(x, weights, ids, up, down, kind="gated", activation="silu", method=method,
                          tile_rows=tile_rows)
    want = dense_experts(x, weights, ids, up, down, kind="gated", activation="silu")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


# The published config.json of NVIDIA-Nemotron-3-Nano-30B-A3B (written by transformers 4.55).
NEMOTRON_3_NANO = {
    "architectures": ["NemotronHForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 1,
    "chunk_size": 128, "conv_kernel": 4, "eos_token_id": 2, "expand": 2, "head_dim": 128, "hidden_dropout": 0.0,
    "hidden_size": 2688, "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "initializer_range": 0.02, "intermediate_size": 1856, "layer_norm_epsilon": 1e-05, "mamba_head_dim": 64,
    "mamba_hidden_act": "silu", "mamba_num_heads": 64, "mamba_proj_bias": False, "mamba_ssm_cache_dtype": "float32",
    "max_position_embeddings": 262144, "mlp_bias": False, "mlp_hidden_act": "relu2", "model_type": "nemotron_h",
    "moe_intermediate_size": 1856, "moe_shared_expert_intermediate_size": 3712, "n_group": 1, "n_groups": 8,
    "n_routed_experts": 128, "n_shared_experts": 1, "norm_eps": 1e-05, "norm_topk_prob": True,
    "num_attention_heads": 32, "num_experts_per_tok": 6, "num_hidden_layers": 52, "num_key_value_heads": 2,
    "num_logits_to_keep": 1, "pad_token_id": 0, "partial_rotary_factor": 1.0, "rescale_prenorm_residual": True,
    "residual_in_fp32": False, "rope_theta": 10000, "routed_scaling_factor": 2.5, "sliding_window": None,
    "ssm_state_size": 128, "tie_word_embeddings": False, "time_step_floor": 0.0001, "time_step_max": 0.1,
    "time_step_min": 0.001, "topk_group": 1, "torch_dtype": "bfloat16", "transformers_version": "4.55.4",
    "use_bias": False, "use_cache": True, "use_conv_bias": True, "use_mamba_kernels": True, "vocab_size": 131072,
}


def test_nemotron_3_nano_config_shards_and_counts():
    from jaxmamba import parallel as par
    from jaxmamba.weights import hf_tensor_specs

    cfg = HybridConfig.from_hf(NEMOTRON_3_NANO)
    kinds = cfg.layer_types
    assert (kinds.count("mamba"), kinds.count("moe"), kinds.count("attention")) == (23, 23, 6)
    assert (cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_intermediate_size, cfg.moe_shared_intermediate_size) == (
        128, 6, 1856, 3712)
    assert cfg.moe_scoring == "sigmoid" and cfg.moe_routed_scaling_factor == 2.5 and cfg.moe_norm_topk_prob
    specs = hf_tensor_specs(cfg)
    params = sum(int(np.prod(s.hf_shape)) for s in specs)
    assert 31.5e9 < params < 31.7e9, params  # "30B-A3B": 31.6B parameters in all
    assert sum(s.expert is not None for s in specs) == 23 * 128 * 2  # per-expert up/down tensors
    for tp in (1, 2, 4, 8):  # FusedMoE's split: 1856/8 = 232, 3712/8 = 464
        lc = par.local_config(cfg, tp)
        assert lc.moe_intermediate_size * tp == 1856 and lc.moe_shared_intermediate_size * tp == 3712


@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_bfloat16_moe_model_tracks_float32(tmp_path, variant):
    from jaxmamba import load_pretrained, random_model

    path = random_model(variant, path=tmp_path / variant)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 512, (1, 21)), jnp.int32)
    f32 = np.asarray(load_pretrained(path, dtype="float32")(ids))
    bf16_model = load_pretrained(path, dtype="bfloat16")
    moe = next(layer.moe for layer in bf16_model.layers if layer.moe is not None)
    assert moe.up_proj[...].dtype == jnp.bfloat16 and moe.router[...].dtype == jnp.bfloat16
    if moe.e_score_correction_bias is not None:
        assert moe.e_score_correction_bias[...].dtype == jnp.float32  # kept in f32, as transformers does
    bf16 = np.asarray(bf16_model(ids), np.float32)
    assert np.isfinite(bf16).all()
    assert np.abs(bf16 - f32).max() / np.abs(f32).max() < 5e-2


def test_step_backend_selects_the_grouped_method(monkeypatch):
    """Inside ``use_grouped_method`` every MoE layer traced runs that method (the serving step passes
    ``"pallas"`` with the Pallas kernel backend)."""
    from jaxmamba.model import moe as moe_mod

    seen = []
    for name in ("_tiled_experts", "_pallas_experts"):
        real = getattr(moe_mod, name)
        monkeypatch.setattr(moe_mod, name, lambda *a, _real=real, _name=name: seen.append(_name) or _real(*a))
    cfg, mods = _moe_module("nemotron_h_moe")
    x = jnp.ones((3, cfg.hidden_size), jnp.float32)
    want = np.asarray(mods["dense"](x))
    with moe_mod.use_grouped_method("pallas"):
        got = np.asarray(mods["grouped"](x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert seen == ["_pallas_experts"]
    np.asarray(mods["grouped"](x))
    assert seen == ["_pallas_experts", "_tiled_experts"]  # the CPU default outside
    with pytest.raises(ValueError, match="method="):
        with moe_mod.use_grouped_method("cuda"):
            pass


@pytest.mark.aot
def test_moe_model_plans_for_h100_with_the_grouped_gemm(tmp_path):
    """Deviceless H100 compile of a MoE model's buckets: the experts are the Triton grouped GEMM
    (no spill, shared memory within the block limit), and the plan's weight bytes count every expert."""
    import json
    import os
    import subprocess
    import sys

    from jaxmamba import aot, random_model
    from jaxmamba.weights import hf_tensor_specs

    ckpt = random_model("nemotron_h_moe", path=tmp_path / "ckpt")
    out = tmp_path / "plan.json"
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_ROOT", "JAXMAMBA_PTXAS_LOG")}
    proc = subprocess.run([sys.executable, "-m", "jaxmamba", "plan", str(ckpt), "--target", "h100",
                           "--kernel-backend", "pallas", "--json", str(out), "--quiet", "--max-num-seqs", "1",
                           "--max-num-batched-tokens", "16", "--max-model-len", "256"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plan = json.loads(out.read_text())
    gemms = [k for k in plan["kernels"] if k["name"].startswith("grouped_matmul")]
    assert gemms, [k["name"] for k in plan["kernels"]]
    limit = aot.get_target("h100").shared_memory_per_block_optin
    assert all(k["spill_bytes"] == 0 and k["shared_bytes"] <= limit for k in gemms), gemms
    cfg = HybridConfig.from_hf(ckpt)
    assert plan["weight_bytes"] == 4 * sum(int(np.prod(s.hf_shape)) for s in hf_tensor_specs(cfg))  # float32
