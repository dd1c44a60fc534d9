"""``python -m jaxmamba.bench moe``: the MoE layer (grouped matmuls) against a dense loop over experts.

For each token count it times one jitted MoE layer (router, top-k, experts, shared expert) with the
routed experts computed two ways, in the same run:

* ``grouped``: ``jaxmamba.model.moe.grouped_experts`` with the platform's default method —
  assignments sorted by expert, then two ``ragged_dot`` calls (GPU/TPU) or a loop over one-expert
  row tiles (CPU); work proportional to ``T * top_k``. ``--ragged-dot`` also times the
  ``ragged_dot`` method on CPU, where XLA expands it densely over every expert.
* ``dense_loop``: a Python loop over every expert running *all* tokens through it and masking by
  the routing weight (what a naive port does); work proportional to ``T * num_experts``.

It also checks the two agree (relative max difference) and reports ``speedup = dense / grouped``.
The default shapes are Nemotron-3-Nano's expert structure (128 experts, top-6, sigmoid grouped
routing, a shared expert) at a width that fits a CPU run; ``--preset granite`` uses
Granite-4.0-H-Tiny's (64 experts, top-6, SwiGLU, softmax routing).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

PRESETS = {
    # (variant, hidden, experts, top_k, n_group, topk_group, expert width, shared width)
    "nemotron": ("nemotron_h_moe", 512, 128, 6, 1, 1, 256, 512),
    "granite": ("granite_hybrid_moe", 512, 64, 6, 1, 1, 256, 0),
}


def dense_loop_experts(x, weights, expert_ids, up, down, *, kind, activation):
    """Every expert over every token, masked by its routing weight (same signature as ``grouped_experts``)."""
    from jaxmamba.model.moe import _expert_activation

    out = jnp.zeros((x.shape[0], up.shape[-1]), jnp.float32)
    for e in range(up.shape[0]):
        w_e = jnp.sum(jnp.where(expert_ids == e, weights, 0.0), axis=-1)  # [T]
        h = _expert_activation(x @ up[e].T, kind, activation)
        out = out + w_e[:, None] * (h @ down[e].T).astype(jnp.float32)
    return out


def _layer(preset: str, seed: int = 0):
    """A MoE module of ``preset``'s shape with random weights (float32)."""
    from flax import nnx

    from jaxmamba.config import HybridConfig
    from jaxmamba.model.moe import MoE
    from jaxmamba.random_checkpoint import random_config_dict

    variant, hidden, e, k, g, tg, width, shared = PRESETS[preset]
    fields = dict(hidden_size=hidden, intermediate_size=2 * hidden)
    if variant == "nemotron_h_moe":
        fields.update(n_routed_experts=e, num_experts_per_tok=k, n_group=g, topk_group=tg, moe_intermediate_size=width,
                      moe_shared_expert_intermediate_size=shared, num_attention_heads=8, head_dim=hidden // 8)
    else:
        fields.update(num_local_experts=e, num_experts_per_tok=k, intermediate_size=width,
                      shared_intermediate_size=2 * hidden, num_attention_heads=8, head_dim=hidden // 8,
                      mamba_d_head=2 * hidden // 8)
    cfg = HybridConfig.from_hf(random_config_dict(variant, **fields))
    module = MoE(cfg, jnp.float32)
    rng = np.random.default_rng(seed)
    state = nnx.state(module, nnx.Param)
    leaves, treedef = jax.tree_util.tree_flatten(state)
    new = [jnp.asarray(rng.standard_normal(x.shape) / np.sqrt(x.shape[-1]), x.dtype) for x in leaves]
    nnx.update(module, jax.tree_util.tree_unflatten(treedef, new))
    return cfg, module


def _time(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def run(preset: str, tokens: list[int], repeats: int, with_ragged_dot: bool = False) -> dict:
    from flax import nnx

    from jaxmamba.model import moe as moe_mod

    cfg, module = _layer(preset)
    graphdef, params = nnx.split(module)

    def make(experts_fn):
        def layer(params, x):  # MoE.__call__ (no latent projection in the presets) with experts_fn
            m = nnx.merge(graphdef, params)
            weights, ids = m.route(x)
            y = experts_fn(x, weights, ids, m.up_proj[...], m.down_proj[...], kind=cfg.moe_expert_kind,
                           activation=cfg.moe_activation).astype(x.dtype)
            return y if m.shared is None else y + m.shared(x)
        return jax.jit(layer)

    grouped, dense = make(moe_mod.grouped_experts), make(dense_loop_experts)
    ragged = make(functools.partial(moe_mod.grouped_experts, method="ragged_dot")) if with_ragged_dot else None
    rows = []
    for t in tokens:
        x = jnp.asarray(np.random.default_rng(t).standard_normal((t, cfg.hidden_size)), jnp.float32)
        g_out, d_out = np.asarray(grouped(params, x)), np.asarray(dense(params, x))
        rel = float(np.abs(g_out - d_out).max() / max(np.abs(d_out).max(), 1e-30))
        tg, td = _time(grouped, params, x, repeats=repeats), _time(dense, params, x, repeats=repeats)
        row = dict(tokens=t, grouped_ms=tg * 1e3, dense_loop_ms=td * 1e3, speedup=td / tg, rel_diff=rel)
        if ragged is not None:
            row["ragged_dot_ms"] = _time(ragged, params, x, repeats=repeats) * 1e3
        rows.append(row)
    return dict(preset=preset, device=str(jax.devices()[0].platform), method=moe_mod.default_grouped_method(),
                hidden=cfg.hidden_size,
                experts=cfg.moe_num_experts, top_k=cfg.moe_top_k, expert_width=cfg.moe_intermediate_size,
                shared_width=cfg.moe_shared_intermediate_size, rows=rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jaxmamba.bench moe", description=__doc__.split("\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="nemotron")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 512])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--ragged-dot", action="store_true", help="also time the ragged_dot method")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    res = run(args.preset, args.tokens, args.repeats, args.ragged_dot)
    print(f"MoE layer, {res['preset']}-shaped: hidden {res['hidden']}, {res['experts']} experts, top-{res['top_k']}, "
          f"expert width {res['expert_width']}, shared {res['shared_width']} ({res['device']}, grouped method "
          f"{res['method']})")
    extra = "ragged_dot_ms" in res["rows"][0]
    print(f"{'tokens':>7} {'grouped ms':>11} {'dense loop ms':>14} {'speedup':>8} {'rel diff':>9}"
          + (f" {'ragged_dot ms':>14}" if extra else ""))
    for r in res["rows"]:
        print(f"{r['tokens']:>7} {r['grouped_ms']:>11.3f} {r['dense_loop_ms']:>14.3f} {r['speedup']:>8.2f} "
              f"{r['rel_diff']:>9.1e}" + (f" {r['ragged_dot_ms']:>14.3f}" if extra else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
