"""HF safetensors <-> jaxmamba parameters, and orbax checkpoints.

``hf_tensor_specs(config)`` is the one table that says, for every tensor
transformers saves for a family, its name, its shape, and where it lives in the
jaxmamba parameter tree. Loading, validation (missing / extra / mis-shaped
tensors raise ``CheckpointError`` naming the tensor) and ``random_model`` all
read it, so the three cannot disagree.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxmamba.config import HybridConfig
from jaxmamba.errors import CheckpointError, ConfigError
from jaxmamba.model import HybridForCausalLM
from jaxmamba.parallel.params import path_keys

# Mamba parameters whose precision matters more than their size: always float32.
FLOAT32_PARAMS = ("A_log", "D", "dt_bias", "e_score_correction_bias")


@dataclass(frozen=True)
class TensorSpec:
    hf_name: str
    hf_shape: tuple[int, ...]
    path: tuple[Any, ...]  # into nnx.to_pure_dict(params)
    shape: tuple[int, ...]  # jaxmamba's shape (differs only for conv1d.weight)
    expert: int | None = None  # NemotronH's per-expert tensors: row ``expert`` of a stacked (E, ...) leaf


def _names(family: str) -> dict[str, str]:
    backbone = family in ("mamba2", "nemotron_h")
    return {
        "prefix": "backbone" if backbone else "model",
        "embed": "backbone.embeddings.weight" if backbone else "model.embed_tokens.weight",
        "final_norm": {
            "mamba2": "backbone.norm_f.weight",
            "nemotron_h": "backbone.norm_f.weight",
            "granite_hybrid": "model.norm.weight",
        }.get(family, "model.final_layernorm.weight"),
        "input_norm": "norm" if backbone else "input_layernorm",
        "ffn_norm": "post_attention_layernorm" if family == "granite_hybrid" else "pre_ff_layernorm",
        "mamba": "mixer" if backbone else "mamba",
        "attention": "mixer" if family == "nemotron_h" else "self_attn",
        "mlp": {"nemotron_h": "mixer", "granite_hybrid": "shared_mlp"}.get(family, "feed_forward"),
    }


def hf_tensor_specs(cfg: HybridConfig) -> list[TensorSpec]:
    """Every tensor a transformers checkpoint of ``cfg`` holds, in a fixed order."""
    n = _names(cfg.family)
    specs: list[TensorSpec] = []

    def add(hf_name, shape, path, ours=None, expert=None):
        specs.append(TensorSpec(hf_name, tuple(shape), tuple(path), tuple(ours or shape), expert))

    d = cfg.hidden_size
    moe_layers = set(cfg.moe_layer_ids)
    add(n["embed"], (cfg.vocab_size, d), ("embed",))
    for i, kind in enumerate(cfg.layer_types):
        base = f"{n['prefix']}.layers.{i}"
        add(f"{base}.{n['input_norm']}.weight", (d,), ("layers", i, "input_norm", "weight"))
        if kind in ("mamba", "hybrid"):
            m, p = f"{base}.{n['mamba']}", ("layers", i, "mamba")
            conv, h, inner = cfg.mamba_conv_dim, cfg.mamba_num_heads, cfg.mamba_intermediate_size
            add(f"{m}.in_proj.weight", (cfg.mamba_in_proj_size, d), p + ("in_proj",))
            if cfg.mamba_in_proj_bias:
                add(f"{m}.in_proj.bias", (cfg.mamba_in_proj_size,), p + ("in_proj_bias",))
            add(f"{m}.conv1d.weight", (conv, 1, cfg.mamba_conv_kernel), p + ("conv_weight",), (conv, cfg.mamba_conv_kernel))
            if cfg.mamba_conv_bias:
                add(f"{m}.conv1d.bias", (conv,), p + ("conv_bias",))
            for name in ("dt_bias", "A_log", "D"):
                add(f"{m}.{name}", (h,), p + (name,))
            if cfg.mamba_gated_norm:
                add(f"{m}.norm.weight", (inner,), p + ("norm_weight",))
            add(f"{m}.out_proj.weight", (d, inner), p + ("out_proj",))
            if cfg.mamba_out_proj_bias:
                add(f"{m}.out_proj.bias", (d,), p + ("out_proj_bias",))
        if kind in ("attention", "hybrid"):
            a, p = f"{base}.{n['attention']}", ("layers", i, "attention")
            hq, hkv, hd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.head_dim
            for proj, shape in (("q_proj", (hq, d)), ("k_proj", (hkv, d)), ("v_proj", (hkv, d)), ("o_proj", (d, hq))):
                add(f"{a}.{proj}.weight", shape, p + (proj,))
                if cfg.attention_bias:
                    add(f"{a}.{proj}.bias", shape[:1], p + (f"{proj}_bias",))
            del hd
        if kind == "mlp" or cfg.ffn_after_mixer:
            f_, p = f"{base}.{n['mlp']}", ("layers", i, "mlp")
            ff = cfg.intermediate_size
            if cfg.mlp_kind == "granite":
                add(f"{f_}.input_linear.weight", (2 * ff, d), p + ("input_linear",))
                add(f"{f_}.output_linear.weight", (d, ff), p + ("output_linear",))
            else:
                projs = ([("gate_proj", (ff, d))] if cfg.mlp_kind == "gated" else []) + [
                    ("up_proj", (ff, d)), ("down_proj", (d, ff))]
                for proj, shape in projs:
                    add(f"{f_}.{proj}.weight", shape, p + (proj,))
                    if cfg.mlp_bias:
                        add(f"{f_}.{proj}.bias", shape[:1], p + (f"{proj}_bias",))
        if i in moe_layers:
            _moe_specs(cfg, base, ("layers", i, "moe"), add)
        if cfg.ffn_after_mixer:
            add(f"{base}.{n['ffn_norm']}.weight", (d,), ("layers", i, "ffn_norm", "weight"))
    add(n["final_norm"], (d,), ("final_norm", "weight"))
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", (cfg.vocab_size, d), ("lm_head",))
    return specs


def _moe_specs(cfg: HybridConfig, base: str, p: tuple, add) -> None:
    """Expert tensors as checkpoints store them (and transformers / vLLM load them).

    NemotronH: ``mixer.gate.weight``, ``mixer.gate.e_score_correction_bias``, one
    ``mixer.experts.{j}.{up,down}_proj.weight`` per expert (transformers merges them into 3-D
    tensors at load), ``mixer.shared_experts.{up,down}_proj``, optional ``fc{1,2}_latent_proj``.
    Granite: ``block_sparse_moe.router.layer.weight`` and the 3-D ``input_linear`` /
    ``output_linear`` (``(E, 2I, D)`` fused ``[gate | up]``, ``(E, D, I)``).
    """
    e, d, dm, i = cfg.moe_num_experts, cfg.hidden_size, cfg.moe_hidden_size, cfg.moe_intermediate_size
    if cfg.family == "granite_hybrid":
        m = f"{base}.block_sparse_moe"
        add(f"{m}.router.layer.weight", (e, d), p + ("router",))
        add(f"{m}.input_linear.weight", (e, 2 * i, dm), p + ("up_proj",))
        add(f"{m}.output_linear.weight", (e, dm, i), p + ("down_proj",))
        return
    m = f"{base}.mixer"
    add(f"{m}.gate.weight", (e, d), p + ("router",))
    add(f"{m}.gate.e_score_correction_bias", (e,), p + ("e_score_correction_bias",))
    for j in range(e):
        add(f"{m}.experts.{j}.up_proj.weight", (i, dm), p + ("up_proj",), expert=j)
        add(f"{m}.experts.{j}.down_proj.weight", (dm, i), p + ("down_proj",), expert=j)
    if cfg.moe_latent_size is not None:
        for proj, shape in (("fc1_latent_proj", (dm, d)), ("fc2_latent_proj", (d, dm))):
            add(f"{m}.{proj}.weight", shape, p + (proj,))
            if cfg.mlp_bias:
                add(f"{m}.{proj}.bias", shape[:1], p + (f"{proj}_bias",))
    s = cfg.moe_shared_intermediate_size
    if s > 0:
        for proj, shape in (("up_proj", (s, d)), ("down_proj", (d, s))):
            add(f"{m}.shared_experts.{proj}.weight", shape, p + ("shared", proj))
            if cfg.mlp_bias:
                add(f"{m}.shared_experts.{proj}.bias", shape[:1], p + ("shared", f"{proj}_bias"))


# ---------------------------------------------------------------------------- safetensors I/O
def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise CheckpointError(f"shard {f.name} named by {index.name} is missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {path}")
    return files


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a checkpoint directory (single file or sharded) as host arrays.

    bfloat16 tensors come back as ``ml_dtypes.bfloat16`` numpy arrays.
    """
    from safetensors import SafetensorError, safe_open

    tensors: dict[str, np.ndarray] = {}
    for file in _safetensors_files(Path(path)):
        try:
            # numpy (bfloat16 as ml_dtypes'): no JAX op, so reading compiles nothing (a start's compiles cost ~0.1 s).
            with safe_open(str(file), framework="numpy") as f:
                for name in f.keys():  # noqa: SIM118 -- safe_open has keys() but no __iter__
                    if name in tensors:
                        raise CheckpointError(f"tensor {name!r} appears in more than one shard")
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read {file.name} (truncated or corrupt safetensors file): {e}") from None
    return tensors


def params_from_tensors(
    cfg: HybridConfig, tensors: Mapping[str, np.ndarray], dtype="float32"
) -> dict[str, Any]:
    """Check names and shapes against ``hf_tensor_specs`` and build the pure parameter dict."""
    specs = hf_tensor_specs(cfg)
    expected = {s.hf_name for s in specs}
    # Buffers transformers may save that carry no parameters of ours.
    # NemotronH's multi-token-prediction layers (``mtp.*``) are not part of the served model (transformers
    # skips them too).
    ignorable = {name for name in tensors
                 if name.endswith((".mup_vector", "rotary_emb.inv_freq")) or name.startswith("mtp.")}
    extra = sorted(set(tensors) - expected - ignorable)
    if extra:
        raise CheckpointError(f"unexpected tensor {extra[0]!r} in checkpoint ({len(extra)} unexpected in all)")
    pure: dict[str, Any] = {}
    stacked: dict[tuple, dict[int, Any]] = {}  # per-expert tensors, stacked once all are read
    for spec in specs:
        if spec.hf_name not in tensors:
            raise CheckpointError(f"tensor {spec.hf_name!r} is missing from the checkpoint")
        arr = tensors[spec.hf_name]
        if tuple(arr.shape) != spec.hf_shape:
            raise CheckpointError(
                f"tensor {spec.hf_name!r} has shape {tuple(arr.shape)}, expected {spec.hf_shape}"
            )
        target = jnp.float32 if spec.path[-1] in FLOAT32_PARAMS else dtype
        if spec.expert is not None:
            stacked.setdefault(spec.path, {})[spec.expert] = np.asarray(arr).reshape(spec.shape)
            continue
        value = _to_device(np.asarray(arr).reshape(spec.shape), target)
        node = pure
        for key in spec.path[:-1]:
            node = node.setdefault(key, {})
        node[spec.path[-1]] = value
    for path, rows in stacked.items():
        node = pure
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = _to_device(np.stack([rows[j] for j in range(len(rows))]), dtype)
    return pure


#: Tensors up to this size change dtype on the host (numpy); larger ones on the device.
_HOST_CONVERT_BYTES = 16 << 20


def _to_device(host: np.ndarray, dtype) -> jax.Array:
    """``host`` as a device array of ``dtype``. ``jnp.asarray(x, dtype=...)`` of a numpy array of another dtype
    compiles a convert program for each shape, at every start (a bfloat16 checkpoint's float32 parameters
    cost an 8B-widths engine 11 compiles on a warm start): a small tensor (A_log, D, dt_bias, norms) is
    converted on the host instead; a large one (a dtype override of the weights) still on the device, which
    is faster than numpy's single thread."""
    if host.dtype != np.dtype(dtype) and host.nbytes <= _HOST_CONVERT_BYTES:
        host = host.astype(dtype)
    return jnp.asarray(host, dtype=dtype)


#: vLLM's dtype spellings (``half``, ``float``) and common short ones, for the three served dtypes.
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "float": "float32", "fp32": "float32", "bf16": "bfloat16"}


def canonical_dtype(dtype) -> str | None:
    """``dtype`` as a served dtype's name (``float32``, ``bfloat16``, ``float16``); ``None`` for ``"auto"``
    or ``None`` (the checkpoint's own dtype). ``ConfigError`` for anything else."""
    if dtype is None or dtype == "auto":
        return None
    dtype = DTYPE_ALIASES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        dt = None
    if dt not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ConfigError(f"dtype={dtype!r} must be 'auto', float32 ('float', 'fp32'), bfloat16 ('bf16') "
                          f"or float16 ('half', 'fp16')")
    return dt.name


def _resolve_dtype(dtype, cfg: HybridConfig):
    dtype = canonical_dtype(dtype)
    if dtype is None:
        dtype = cfg.hf_config.get("dtype") or cfg.hf_config.get("torch_dtype") or "float32"
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ConfigError(f"dtype={dtype!r} is not a floating dtype") from None
    if dt not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ConfigError(f"dtype={dtype!r} must be float32, bfloat16 or float16")
    return dt


def build_model(cfg: HybridConfig, pure_params: Mapping[str, Any], dtype):
    """A ``HybridForCausalLM`` holding ``pure_params`` (no zero-filled intermediate allocation)."""
    abstract = nnx.eval_shape(lambda: HybridForCausalLM(cfg, dtype))
    graphdef, state = nnx.split(abstract)
    nnx.replace_by_pure_dict(state, pure_params)
    return nnx.merge(graphdef, state)


def load_hf(path: str | Path, dtype=None) -> tuple[HybridConfig, nnx.State]:
    """Read an HF checkpoint directory: ``(config, params)`` with params an ``nnx.State`` of ``nnx.Param``."""
    cfg, pure, dt = _read_hf(path, dtype)
    return cfg, nnx.state(build_model(cfg, pure, dt), nnx.Param)


def _read_hf(path: str | Path, dtype=None):
    """``(config, pure parameter dict, dtype)`` of an HF checkpoint directory."""
    cfg = HybridConfig.from_hf(path)
    dt = _resolve_dtype(dtype, cfg)
    return cfg, params_from_tensors(cfg, read_safetensors(path), dt), dt


def save_hf(path: str | Path, cfg_dict: Mapping[str, Any], tensors: Mapping[str, np.ndarray]) -> None:
    """Write ``config.json`` + ``model.safetensors`` as transformers' ``save_pretrained`` does."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg_dict, indent=2, sort_keys=True, default=_json_default))
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(path / "model.safetensors"),
              metadata={"format": "pt"})


def _json_default(o):
    if isinstance(o, float) and math.isinf(o):
        return {"__float__": "Infinity"}
    raise TypeError(type(o))


def params_to_tensors(cfg: HybridConfig, params: nnx.State | Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Inverse of ``params_from_tensors``: HF-named host arrays (e.g. to export after conversion)."""
    pure = nnx.to_pure_dict(params) if isinstance(params, nnx.State) else params
    out = {}
    for spec in hf_tensor_specs(cfg):
        node = pure
        for key in spec.path:
            node = node[key]
        value = np.asarray(node) if spec.expert is None else np.asarray(node)[spec.expert]
        out[spec.hf_name] = value.reshape(spec.hf_shape)
    return out


# ---------------------------------------------------------------------------- orbax
def save_orbax(path: str | Path, cfg: HybridConfig, params: nnx.State) -> None:
    """Save params with orbax, and the HF config beside them (``path/config.json``, ``path/params``)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(dict(cfg.hf_config), indent=2, default=_json_default))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(path / "params", nnx.to_pure_dict(params), force=True)


def restore_orbax(path: str | Path, dtype=None) -> tuple[HybridConfig, nnx.State]:
    """Restore what ``save_orbax`` wrote, bit-exactly (target shapes/dtypes from the config)."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    if not (path / "params").exists():
        raise CheckpointError(f"{path} has no orbax 'params' directory")
    cfg = HybridConfig.from_hf(path)
    with ocp.StandardCheckpointer() as ckptr:
        meta = ckptr.metadata(path / "params")
        stored = jax.tree_util.tree_leaves(getattr(meta, "item_metadata", meta))
        stored_dtype = next((m.dtype for m in stored if hasattr(m, "dtype") and m.dtype != jnp.float32), None)
        dt = _resolve_dtype(dtype if canonical_dtype(dtype) is not None else (stored_dtype or "float32"), cfg)
        abstract = nnx.eval_shape(lambda: HybridForCausalLM(cfg, dt))
        target = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
        # Checked before any read starts: a restore that fails part-way leaves orbax's other reads pending, and
        # the garbage collector prints their errors later, wherever the caller is by then.
        _check_orbax_shapes(path, getattr(meta, "item_metadata", meta), target)
        try:
            pure = ckptr.restore(path / "params", target)
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"orbax checkpoint at {path} does not match its config: {e}") from None
    return cfg, nnx.state(build_model(cfg, pure, dt), nnx.Param)


def _shapes_by_name(tree) -> dict[str, tuple[int, ...] | None]:
    """``{"layers/0/mamba/A_log": shape, ...}`` of a parameter tree (orbax's stored metadata names a layer "0"
    where the model's pure dict has 0: both spelled as strings)."""
    out = {}
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = "/".join(map(str, path_keys(key_path)))
        out[name] = None if getattr(leaf, "shape", None) is None else tuple(leaf.shape)
    return out


def _check_orbax_shapes(path: Path, stored_tree, target) -> None:
    """``CheckpointError`` naming the parameters an orbax checkpoint lacks, has beyond its config's model, or
    holds at another shape than the config gives (``stored_tree``: its metadata tree; ``target``: the
    model's abstract parameters)."""
    stored, wanted = _shapes_by_name(stored_tree), _shapes_by_name(target)
    problems = [f"{name}: missing" for name in wanted if name not in stored]
    problems += [f"{name}: not a parameter of this config's model" for name in stored if name not in wanted]
    problems += [f"{name}: stored {stored[name]}, the config gives {shape}" for name, shape in wanted.items()
                 if name in stored and stored[name] is not None and stored[name] != shape]
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise CheckpointError(f"orbax checkpoint at {path} does not match its config.json: "
                              + "; ".join(problems[:5]) + more)


#: ``dt_clamp`` choices: the checkpoint's clamp as transformers reads it (NemotronH: ``time_step_min``; Mamba2,
#: Bamba, Granite, Falcon-H1: ``time_step_limit``), or vLLM's ``MambaMixer2`` one (``dt_limit=(0, inf)`` for
#: every family: it never reads the config's limits).
DT_CLAMPS = ("checkpoint", "vllm")


def check_dt_clamp(dt_clamp: str) -> None:
    """Raise ``ConfigError`` unless ``dt_clamp`` is one of ``DT_CLAMPS``."""
    if dt_clamp not in DT_CLAMPS:
        raise ConfigError(f"dt_clamp={dt_clamp!r} must be one of {DT_CLAMPS}")


def with_dt_clamp(model, dt_clamp: str):
    """``model`` with dt clamped as ``dt_clamp`` says (the same model object for ``"checkpoint"``).

    The two peers differ for NemotronH (transformers clamps ``softplus(dt + bias)`` from below at
    ``time_step_min``, vLLM does not), so a line-by-line comparison needs the peer's clamp."""
    check_dt_clamp(dt_clamp)
    if dt_clamp == "checkpoint" or model.cfg.mamba_time_step_limit == (0.0, math.inf):
        return model
    cfg = dataclasses.replace(model.cfg, mamba_time_step_limit=(0.0, math.inf))
    return build_model(cfg, nnx.to_pure_dict(nnx.state(model, nnx.Param)), model.dtype)


def load_pretrained(path: str | Path, dtype="float32"):
    """Load an HF checkpoint directory, or an orbax one written by ``save_orbax``, as a model."""
    path = Path(path)
    if (path / "params").is_dir() and not list(path.glob("*.safetensors")):
        cfg, params = restore_orbax(path, dtype)
        return build_model(cfg, nnx.to_pure_dict(params), _resolve_dtype(dtype, cfg))
    cfg, pure, dt = _read_hf(path, dtype)  # the model built once (load_hf builds one to return its state)
    return build_model(cfg, pure, dt)

