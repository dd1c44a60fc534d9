"""Tensor-parallel checks that need several JAX devices, run in their own process.

``tests/jaxmamba/test_parallel.py`` starts ``python tests/jaxmamba/tp_worker.py {fast|full}`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (the flag must be set before jax
initialises, so it cannot be set inside the pytest process, whose other tests use one device).
The worker measures; the test file asserts. It prints one JSON object on its last stdout line:

* ``forward``: per (family, overrides, tp) the relative max error of ``tp_forward_logits``
  against the TP=1 ``jax.jit(model)`` logits;
* ``states``: per (family, overrides, tp) the relative error between what each rank holds after a
  TP prefill (``tp_prefill`` + ``rank_pages``) and the rank pages ``transfer.pages`` builds from
  the TP=1 prefill state (the sharding model the transfer plans are checked against);
* ``weights``: per case, the parameters whose device-``r`` shard differs from vLLM's rank-``r``
  tensor (derived here independently, conv channels and KV heads from ``transfer.pages``), and
  whether ``unshard_params`` restores the HF tensors exactly;
* ``caches``: per (n_groups, kv heads, tp, num_spec) the byte mismatches between
  ``place_logical_caches`` + ``rank_pages`` / ``gather_rank_page`` and ``transfer.pages``'
  ``shard_mamba_pages`` / ``shard_kv``, and the per-rank shapes of ``shard_caches``;
* ``negative``: the error of a deliberately wrong (contiguous) ``in_proj`` sharding, to show the
  forward check can fail.

Run it by hand with ``XLA_FLAGS=--xla_force_host_platform_device_count=8 python
tests/jaxmamba/tp_worker.py fast``.
"""

from __future__ import annotations

import json
import sys
import time

# (family, config overrides, TPs for the logits check, TPs for the state check). mamba2 and
# nemotron_h spell the group count `n_groups`; bamba, granite and falcon_h1 `mamba_n_groups`.
# The tiny models have 8 Mamba heads, 4 attention heads and 2 KV heads; TP=8 with attention
# needs 8 q heads, and then replicates each KV head on 4 ranks. The bias flags turn on every
# row-parallel bias (added once, after the all-reduce) and the column-parallel ones.
FAST_CASES = [
    ("mamba2", {"n_groups": 1}, [1, 2, 8], [8]),
    ("mamba2", {"n_groups": 4}, [4], []),
    ("nemotron_h", {}, [2], [2]),
    ("nemotron_h", {"n_groups": 1, "num_attention_heads": 8, "use_bias": True, "mlp_bias": True}, [8], [8]),
    ("bamba", {"mamba_n_groups": 1, "mamba_proj_bias": True, "attention_bias": True, "mlp_bias": True}, [4], []),
    ("granite_hybrid", {"mamba_n_groups": 4, "vocab_size": 509}, [4], [4]),
    ("falcon_h1", {"mamba_n_groups": 1, "mamba_norm_before_gate": True}, [2], []),
    ("falcon_h1", {}, [2], []),
    # Mixture of experts (FusedMoE: every rank holds every expert, intermediate dimension split).
    ("nemotron_h_moe", {"n_groups": 1}, [2, 4], [4]),
    ("nemotron_h_moe", {"moe_latent_size": 24, "mlp_bias": True}, [2], []),
    ("granite_hybrid_moe", {"mamba_n_groups": 1}, [2, 4], [2]),
]

_GROUP_KEY = {"mamba2": "n_groups", "nemotron_h": "n_groups"}


def _full_cases():
    out = []
    for family in ("mamba2", "nemotron_h", "bamba", "granite_hybrid", "falcon_h1"):
        key = _GROUP_KEY.get(family, "mamba_n_groups")
        for g in (1, 2, 4):
            tps = [tp for tp in (1, 2, 4, 8) if g == 1 or g % tp == 0]
            # With attention, TP=8 needs 8 q heads (the tiny models have 4): a separate model.
            small = tps if family == "mamba2" else [tp for tp in tps if tp <= 4]
            out.append((family, {key: g}, small, small))
            if family != "mamba2" and 8 in tps:
                out.append((family, {key: g, "num_attention_heads": 8}, [8], [8]))
    return out + [c for c in FAST_CASES if c[1] and case_id(c[0], c[1]) not in {case_id(f, o) for f, o, _, _ in out}]


# (n_groups, num_kv_heads, tp, num_spec, conv bytes, ssm bytes, kv bytes)
CACHE_CASES = [
    (g, k, tp, spec, cb, sb, kb)
    for (g, k, tp) in [(1, 2, 1), (1, 2, 2), (1, 2, 4), (1, 2, 8), (2, 2, 2), (4, 2, 4), (4, 4, 4), (4, 1, 2), (2, 4, 2)]
    for (spec, cb, sb, kb) in [(0, 4, 4, 4), (2, 2, 4, 2)]
]


def case_id(family: str, overrides: dict, tp: int | None = None) -> str:
    over = ",".join(f"{k}={v}" for k, v in sorted(overrides.items()))
    return f"{family}[{over}]" + ("" if tp is None else f"@tp{tp}")


def cache_case_id(case) -> str:
    g, k, tp, spec, cb, sb, kb = case
    return f"G{g}-kv{k}-tp{tp}-spec{spec}-c{cb}s{sb}k{kb}"


def main(mode: str) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxmamba
    from jaxmamba import parallel as par
    from jaxmamba.cache import StateCaches
    from jaxmamba.config import HybridConfig
    from jaxmamba.layout import kv_cache_shape, page_size_bytes, state_shapes
    from jaxmamba.random_checkpoint import random_config_dict
    from jaxmamba.weights import load_pretrained
    from transfer import pages
    from transfer.hetero_tp import TransferShape

    def rel(a, b) -> float:
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))

    def keys_of(path):
        return par.path_keys(path)

    # ---------------------------------------------------------------- vLLM's rank tensors
    def vllm_rank_tensor(keys, w: np.ndarray, cfg: HybridConfig, tp: int, r: int) -> np.ndarray:
        """Rank r's copy of HF tensor ``w`` as vLLM's weight loaders shard it (independent of jaxmamba.parallel)."""
        name, owner = keys[-1], (keys[-2] if len(keys) > 1 else None)
        i, h, n_heads_q, d = cfg.mamba_intermediate_size, cfg.mamba_num_heads, cfg.num_attention_heads, cfg.head_dim
        sl = lambda size: slice(r * size // tp, (r + 1) * size // tp)  # noqa: E731
        if keys in (("embed",), ("lm_head",)):
            per = -(-cfg.vocab_size // tp)
            out = np.zeros((per, *w.shape[1:]), w.dtype)
            rows = w[r * per : (r + 1) * per]
            out[: rows.shape[0]] = rows
            return out
        if owner in ("final_norm", "input_norm", "ffn_norm") or name in ("out_proj_bias", "o_proj_bias",
                                                                          "down_proj_bias"):
            return w
        if owner == "mamba":
            shape = TransferShape.from_config(cfg, conv_dtype=4, ssm_dtype=4)
            chans = pages.rank_conv_channels(shape, tp, r)  # [x_r | B_r | C_r] of the conv
            heads = np.arange(h)[sl(h)]
            if name in ("in_proj", "in_proj_bias"):  # [z | xBC | dt]: z_r = x_r's channels
                return w[np.concatenate([chans[: i // tp], i + chans, i + cfg.mamba_conv_dim + heads])]
            if name in ("conv_weight", "conv_bias"):
                return w[chans]
            if name in ("A_log", "D", "dt_bias"):
                return w[heads]
            if name == "norm_weight":
                return w[sl(i)]
            if name == "out_proj":
                return w[:, sl(i)]
        if owner == "attention":
            if name in ("q_proj", "q_proj_bias"):
                return w[sl(n_heads_q * d)]
            if name in ("k_proj", "v_proj", "k_proj_bias", "v_proj_bias"):
                kv = pages.rank_kv_heads(cfg.num_key_value_heads, tp, r)
                return np.concatenate([w[k * d : (k + 1) * d] for k in kv])
            if name == "o_proj":
                return w[:, sl(n_heads_q * d)]
        if owner == "mlp":
            f = cfg.intermediate_size
            if name in ("gate_proj", "up_proj", "gate_proj_bias", "up_proj_bias"):
                return w[sl(f)]
            if name in ("down_proj", "output_linear"):
                return w[:, sl(f)]
            if name == "input_linear":
                return np.concatenate([w[:f][sl(f)], w[f:][sl(f)]])
        if owner == "moe":  # FusedMoE: all experts on every rank, w13 / w2 split on the intermediate dim
            f = cfg.moe_intermediate_size
            if name == "up_proj":
                if cfg.moe_expert_kind == "gated":  # w1 (gate) and w3 (up) each split, then stacked
                    return np.concatenate([w[:, :f][:, sl(f)], w[:, f:][:, sl(f)]], axis=1)
                return w[:, sl(f)]
            if name == "down_proj":
                return w[:, :, sl(f)]
            return w  # router, e_score_correction_bias, latent projections: replicated
        if owner == "shared":
            f = cfg.moe_shared_intermediate_size
            if name in ("up_proj", "up_proj_bias"):
                return w[sl(f)]
            if name == "down_proj":
                return w[:, sl(f)]
        raise AssertionError(f"no vLLM rule for {keys}")

    def check_weights(model, cfg, mesh) -> dict:
        tp = par.mesh_tp_size(mesh)
        hf = nnx.state(model, nnx.Param)
        sharded = par.shard_params(model, cfg, mesh)
        hf_leaves = {keys_of(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(hf)[0]}
        bad, checked = [], 0
        for path, arr in jax.tree_util.tree_flatten_with_path(sharded)[0]:
            keys = keys_of(path)
            for r in range(tp):
                want = vllm_rank_tensor(keys, hf_leaves[keys], cfg, tp, r)
                got = par.rank_shard(arr, r)
                checked += 1
                if got.shape != want.shape or not np.array_equal(got, want):
                    bad.append(f"{'.'.join(map(str, keys))}@rank{r}")
        back = par.unshard_params(sharded, cfg, tp)
        restored = all(
            np.array_equal(np.asarray(x), hf_leaves[keys_of(p)]) and np.asarray(x).dtype == hf_leaves[keys_of(p)].dtype
            for p, x in jax.tree_util.tree_flatten_with_path(back)[0]
        )
        return {"mismatched": bad, "checked": checked, "num_params": len(hf_leaves), "roundtrip": restored}

    # ---------------------------------------------------------------- forward + states
    results: dict = {"devices": len(jax.devices()), "jax": jax.__version__, "forward": {}, "states": {},
                     "weights": {}, "caches": {}, "timing": {}}
    cases = FAST_CASES if mode == "fast" else _full_cases()
    rng = np.random.default_rng(0)
    for family, overrides, fwd_tps, state_tps in cases:
        t0 = time.time()
        model = load_pretrained(jaxmamba.random_model(family, "tiny", seed=1, **overrides))
        cfg = model.cfg
        ids = rng.integers(0, cfg.vocab_size, (2, 37)).astype(np.int32)
        ref = np.asarray(jax.jit(lambda ids: model(ids))(ids))
        for tp in fwd_tps:
            mesh = par.make_mesh(tp, cfg=cfg)
            out = np.asarray(par.tp_forward_logits(model, cfg, mesh, ids))
            results["forward"][case_id(family, overrides, tp)] = {"rel_err": rel(out, ref), "shape_ok": out.shape == ref.shape}
            results["weights"][case_id(family, overrides, tp)] = check_weights(model, cfg, mesh)
        if state_tps:
            mesh1 = par.make_mesh(1, cfg=cfg)
            logits1, st1 = par.tp_prefill(par.shard_params(model, cfg, mesh1), cfg, mesh1, ids)
            logical = [np.asarray(x) for x in (*st1.conv, *st1.ssm, *st1.kv)]
            prefill_logits_err = rel(logits1, ref)
            nm, na = len(cfg.mamba_layer_ids), len(cfg.attention_layer_ids)
            for tp in state_tps:
                mesh = par.make_mesh(tp, cfg=cfg)
                logits, st = par.tp_prefill(par.shard_params(model, cfg, mesh), cfg, mesh, ids)
                shape = TransferShape.from_config(cfg, conv_dtype=4, ssm_dtype=4, kv_dtype=4, block_size=ids.shape[1])
                errs, shapes_ok = [], True
                conv_bytes = int(np.prod(state_shapes(cfg, tp)[0])) * 4
                for r in range(tp):
                    mine = par.rank_pages(st, r)
                    for j in range(nm):  # Mamba layer j: transfer.pages' rank-r page of the TP=1 state
                        state = pages.LogicalState(logical[j], logical[nm + j], None)
                        want = pages.shard_mamba_pages(shape, state, tp, r)  # (slots, page bytes) uint8
                        got_conv, got_ssm = mine.conv[j], mine.ssm[j]
                        want_conv = want[:, :conv_bytes].copy().view(np.float32).reshape(got_conv.shape)
                        want_ssm = want[:, conv_bytes:].copy().view(np.float32).reshape(got_ssm.shape)
                        shapes_ok &= want.shape[1] == par.mamba_page_bytes(got_conv, got_ssm).shape[1]
                        shapes_ok &= par.gather_rank_page(st, r, j, 1).shape[0] == want.shape[1]
                        errs += [rel(got_conv, want_conv), rel(got_ssm, want_ssm)]
                    for j in range(na):  # attention layer j: K/V of the rank's heads
                        want_kv = pages.shard_kv(shape, pages.LogicalState(None, None, logical[2 * nm + j]), tp, r)
                        shapes_ok &= mine.kv[j].shape == want_kv.shape
                        if mine.kv[j].shape == want_kv.shape:
                            errs.append(rel(mine.kv[j], want_kv))
                results["states"][case_id(family, overrides, tp)] = {
                    "rel_err": max(errs), "shapes_ok": bool(shapes_ok), "logits_rel_err": rel(logits, ref),
                    "tp1_prefill_logits_rel_err": prefill_logits_err, "num_checks": len(errs),
                }
        results["timing"][case_id(family, overrides)] = round(time.time() - t0, 2)

    # ---------------------------------------------------------------- cache layout (bytes)
    t0 = time.time()
    for case in CACHE_CASES:
        g, k, tp, spec, cb, sb, kb = case
        raw = random_config_dict("nemotron_h", "tiny", n_groups=g, num_key_value_heads=k, num_attention_heads=8)
        cfg = HybridConfig.from_hf(raw)
        mesh = par.make_mesh(tp, cfg=cfg)
        block_size = 4
        shape = TransferShape.from_config(cfg, conv_dtype=cb, ssm_dtype=sb, kv_dtype=kb, block_size=block_size,
                                          num_spec=spec)
        nm, na = len(cfg.mamba_layer_ids), len(cfg.attention_layer_ids)
        states = [pages.random_logical_state(shape, num_slots=5, num_blocks=3, seed=100 * j + tp) for j in range(max(nm, na))]
        logical = StateCaches(conv=tuple(s.conv for s in states[:nm]), ssm=tuple(s.ssm for s in states[:nm]),
                              kv=tuple(s.kv for s in states[:na]))
        caches = par.place_logical_caches(logical, cfg, mesh)
        bad = []
        for r in range(tp):
            mine = par.rank_pages(caches, r)
            for j in range(nm):
                want = pages.shard_mamba_pages(shape, states[j], tp, r)
                got = par.mamba_page_bytes(mine.conv[j], mine.ssm[j])
                if got.shape != want.shape or not np.array_equal(got, want):
                    bad.append(f"mamba{j}@rank{r}")
                for slot in (0, 3):
                    if not np.array_equal(par.gather_rank_page(caches, r, j, slot), want[slot]):
                        bad.append(f"mamba{j}@rank{r}/slot{slot}")
            for j in range(na):
                want = pages.shard_kv(shape, states[j], tp, r)
                got = mine.kv[j]
                if got.shape != want.shape or got.dtype != want.dtype or not np.array_equal(got, want):
                    bad.append(f"kv{j}@rank{r}")
        back = par.gather_logical_caches(caches, cfg, tp)
        roundtrip = all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(logical), strict=True))
        # Zero caches: every rank's shard has vLLM's per-rank shape and page size.
        conv_dt, ssm_dt = {2: jnp.bfloat16, 4: jnp.float32}[cb], jnp.float32
        zeros = par.shard_caches(cfg, mesh, num_slots=5, num_blocks=3, block_size=block_size, num_spec=spec,
                                 dtype=conv_dt, ssm_dtype=ssm_dt)
        conv_shape, ssm_shape = state_shapes(cfg, tp, num_spec=spec)
        kv_shape = kv_cache_shape(3, block_size, cfg.num_key_value_heads, cfg.head_dim, tp)
        page = page_size_bytes(cfg, tp, conv_dtype=conv_dt, ssm_dtype=ssm_dt, num_spec=spec)
        zero_ok = True
        for r in range(tp):
            mine = par.rank_pages(zeros, r)
            zero_ok &= all(c.shape == (5, *conv_shape) and not c.any() for c in mine.conv)
            zero_ok &= all(s.shape == (5, *ssm_shape) and not s.any() for s in mine.ssm)
            zero_ok &= all(x.shape == kv_shape and not x.any() for x in mine.kv)
            zero_ok &= all(par.gather_rank_page(zeros, r, j, 1).shape == (page,) for j in range(nm))
        results["caches"][cache_case_id(case)] = {"mismatched": bad, "roundtrip": bool(roundtrip),
                                                  "zero_caches_ok": bool(zero_ok)}
    results["timing"]["caches"] = round(time.time() - t0, 2)

    # ---------------------------------------------------------------- negative control
    model = load_pretrained(jaxmamba.random_model("nemotron_h", "tiny", seed=1))
    cfg = model.cfg
    ids = rng.integers(0, cfg.vocab_size, (2, 37)).astype(np.int32)
    ref = np.asarray(jax.jit(lambda ids: model(ids))(ids))
    mesh = par.make_mesh(2, cfg=cfg)
    # Patched where tp_index looks it up (jaxmamba.parallel.ranks), not on the package's re-export.
    real = par.ranks.in_proj_index
    par.ranks.in_proj_index = lambda cfg, tp: np.arange(cfg.mamba_in_proj_size)  # contiguous rows: not vLLM's layout
    try:
        out = np.asarray(par.tp_forward_logits(model, cfg, mesh, ids))
    finally:
        par.ranks.in_proj_index = real
    results["negative"] = {"contiguous_in_proj_rel_err": rel(out, ref)}
    return results


# (family, config overrides, TPs) served through LLM(tensor_parallel_size=...). The default tier's: the hybrid's
# attention, Mamba and MLP at TP=2, falcon_h1's replicated groups at TP=4. The slow tier's (mode "engine-slow"; each
# case two engines, ~50 s cold on 2 cores): the MoE hybrids and pure Mamba2 at TP=8, whose sharding FAST_CASES'
# logits and state checks cover in the default tier.
ENGINE_CASES = [
    ("nemotron_h", {}, [2]),
    ("falcon_h1", {"mamba_n_groups": 1}, [4]),
]
SLOW_ENGINE_CASES = [
    ("nemotron_h_moe", {"n_groups": 1}, [4]),
    ("granite_hybrid_moe", {}, [2]),
    ("mamba2", {"n_groups": 1}, [8]),
]


def engine(mode: str) -> dict:
    """Greedy tokens of ``LLM(tensor_parallel_size=tp)`` against the TP=1 engine, plus compile counts: ``ENGINE_CASES``
    then multi-step windows and prefix caching at TP=2 (mode "engine"), or ``SLOW_ENGINE_CASES`` alone ("engine-slow")."""
    import numpy as np

    import jaxmamba
    from jaxmamba import LLM, SamplingParams

    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (5, 23, 1, 17)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    args = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, buckets=[(1, 4), (4, 32)])
    out = {"engine": {}, "timing": {}}
    for family, overrides, tps in SLOW_ENGINE_CASES if mode == "engine-slow" else ENGINE_CASES:
        path = jaxmamba.random_model(family, "tiny", seed=1, **overrides)
        ref = LLM(path, **args).generate(prompts, params)
        for tp in tps:
            llm = LLM(path, tensor_parallel_size=tp, **args)
            outs = llm.generate(prompts, params)
            shard = llm.runner.caches.conv[0].addressable_shards[0].data.shape
            out["engine"][case_id(family, overrides, tp)] = {
                "tokens_equal": [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref],
                "max_logprob_diff": max(abs(a[t] - b[t]) for o, r in zip(outs, ref)
                                        for a, b in zip(o.outputs[0].logprobs, r.outputs[0].logprobs) for t in a),
                "compilations": llm.stats.num_compilations,
                "programs": llm.stats.num_step_programs,
                "compiles_while_serving": llm.stats.backend_compiles_since_warmup,
                "conv_shard_shape": list(shard),
                "slots_in_use": llm.stats.slots_in_use,
            }
    if mode == "engine-slow":
        return out

    # Multi-step windows at TP=2 (the per-row SSM working set is each rank's own heads), sampled and greedy rows.
    path = jaxmamba.random_model("nemotron_h", "tiny", seed=1)
    mixed = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (9, 4, 7)]
    mixed.append(SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=2))
    window_args = dict(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    ref = LLM(path, **window_args).generate(prompts, mixed)
    llm = LLM(path, tensor_parallel_size=2, num_scheduler_steps=4, **window_args)
    steps_before = llm.stats.num_steps
    outs = llm.generate(prompts, mixed)
    out["multi_step_tp2"] = {
        "tokens_equal": [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref],
        "max_logprob_diff": max(abs(a[t] - b[t]) for a, b in zip(outs[3].outputs[0].logprobs,
                                                                   ref[3].outputs[0].logprobs) for t in a),
        "steps": llm.stats.num_steps - steps_before, "max_tokens": max(p.max_tokens for p in mixed),
        "compiles_while_serving": llm.stats.backend_compiles_since_warmup,
    }

    # Prefix caching (mode all) at TP=2: later requests resume from cached per-rank KV and (conv, SSM) pages.
    shared = rng.integers(3, 500, size=40).tolist()
    waves = [[shared + [7, 8]], [shared + rng.integers(3, 500, size=n).tolist() for n in (1, 6, 13)], [shared[:33]]]
    flat = [p for w in waves for p in w]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(path, **args).generate(flat, greedy)]
    llm = LLM(path, tensor_parallel_size=2, enable_prefix_caching=True, mamba_cache_mode="all", **args)
    got = [o.outputs[0].token_ids for w in waves for o in llm.generate(w, greedy)]
    out["prefix_caching_tp2"] = {
        "tokens_equal": got == ref, "hit_tokens": llm.stats.num_prefix_hit_tokens,
        "compiles_while_serving": llm.stats.backend_compiles_since_warmup,
        "slots_in_use": llm.stats.slots_in_use, "blocks_in_use": llm.stats.blocks_in_use,
    }
    return out


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "fast"
    if mode not in ("fast", "full", "engine", "engine-slow"):
        raise SystemExit(f"usage: {sys.argv[0]} [fast|full|engine|engine-slow]")
    start = time.time()
    out = engine(mode) if mode.startswith("engine") else main(mode)
    out["timing"]["total"] = round(time.time() - start, 2)
    print(json.dumps(out))
