"""``HybridConfig``: one normalised description of the five supported model families.

``HybridConfig.from_hf(path_or_dict)`` reads ``config.json`` as transformers 5.x writes it
(``jaxmamba.hf_config``: the families, every layer-kind spelling); anything that cannot be served raises
``ConfigError`` naming the field.

Canonical layer kinds (``HybridConfig.layer_types``):

* ``"mamba"``: a Mamba2 mixer.
* ``"attention"``: a GQA attention mixer.
* ``"hybrid"``: FalconH1's parallel mamba + attention mixer.
* ``"mlp"``: a feed-forward-only block (NemotronH ``-``).
* ``"moe"``: a mixture-of-experts-only block (NemotronH ``E``: routed experts plus
  shared experts, ``jaxmamba.model.moe``).

Families whose blocks also carry an MLP after the mixer (Bamba, Granite,
FalconH1) set ``ffn_after_mixer``; Granite with ``num_local_experts > 0`` adds
routed experts beside that shared MLP (``moe_num_experts > 0``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from jaxmamba.errors import ConfigError
from jaxmamba.hf_config import hybrid_config_fields, read_config_json

FAMILIES = ("mamba2", "nemotron_h", "bamba", "granite_hybrid", "falcon_h1")
#: The family of the embedded default checkpoint (``random_checkpoint.default_checkpoint``, the CLI).
DEFAULT_FAMILY = "nemotron_h"

_SUPPORTED_ACTIVATIONS = ("silu", "swish", "relu2", "gelu", "gelu_pytorch_tanh", "relu")


@dataclass(frozen=True)
class HybridConfig:
    """A served model's shape, independent of which HF family wrote it."""

    family: str
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]
    ffn_after_mixer: bool
    rms_norm_eps: float
    tie_word_embeddings: bool = False
    # Mamba2 mixer
    mamba_intermediate_size: int = 0
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_n_groups: int = 1
    mamba_d_state: int = 0
    mamba_conv_kernel: int = 4
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_in_proj_bias: bool = False
    mamba_out_proj_bias: bool = False
    mamba_activation: str = "silu"
    mamba_time_step_limit: tuple[float, float] = (0.0, math.inf)
    mamba_gated_norm: bool = True  # FalconH1 may drop the gated RMSNorm (mamba_rms_norm=False)
    mamba_norm_before_gate: bool = False
    mamba_eps: float = 1e-5
    # Attention
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    attention_bias: bool = False
    rope_theta: float | None = None  # None: no rotary embedding (NemotronH, Granite without rope)
    partial_rotary_factor: float = 1.0
    attention_scale: float | None = None  # None: head_dim ** -0.5
    # Feed-forward
    mlp_kind: str | None = None  # "gated" (gate/up/down), "relu2" (up/down), "granite" (input/output_linear)
    intermediate_size: int = 0
    mlp_activation: str = "silu"
    mlp_bias: bool = False
    # Scalar multipliers (FalconH1 muP, Granite); 1.0 where a family has none.
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0  # logits *= this (Granite: 1 / logits_scaling)
    residual_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)  # z, x, B, C, dt
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # gate, down
    # Mixture of experts (0 experts: none). NemotronH "moe" blocks; Granite's block_sparse_moe.
    moe_num_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate_size: int = 0  # per routed expert
    moe_expert_kind: str | None = None  # "relu2" (up/down, NemotronH) | "gated" (fused [gate | up], Granite)
    moe_activation: str = "silu"
    moe_scoring: str = "softmax"  # "softmax": softmax of the top-k logits (Granite); "sigmoid": NemotronH
    moe_n_group: int = 1  # grouped top-k (sigmoid scoring): experts in n_group groups,
    moe_topk_group: int = 1  # only the topk_group best groups may be chosen
    moe_norm_topk_prob: bool = False
    moe_routed_scaling_factor: float = 1.0
    moe_score_correction_bias: bool = False  # NemotronH's e_score_correction_bias
    moe_shared_intermediate_size: int = 0  # NemotronH shared experts (0: none); Granite's is the MLP
    moe_latent_size: int | None = None  # NemotronH latent MoE: experts run in this width
    eos_token_id: tuple[int, ...] = ()
    max_position_embeddings: int | None = None
    hf_config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    # ------------------------------------------------------------------ derived
    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        """Layers that own Mamba state (``mamba`` and FalconH1 ``hybrid``)."""
        return tuple(i for i, k in enumerate(self.layer_types) if k in ("mamba", "hybrid"))

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """Layers that own a paged KV cache (``attention`` and ``hybrid``)."""
        return tuple(i for i, k in enumerate(self.layer_types) if k in ("attention", "hybrid"))

    @property
    def moe_layer_ids(self) -> tuple[int, ...]:
        """Layers with routed experts (NemotronH ``moe`` blocks; every Granite layer when it has experts)."""
        if self.ffn_after_mixer and self.moe_num_experts > 0:
            return tuple(range(len(self.layer_types)))
        return tuple(i for i, k in enumerate(self.layer_types) if k == "moe")

    @property
    def moe_hidden_size(self) -> int:
        """Width the routed experts read and write (the latent size when NemotronH projects to one)."""
        return self.moe_latent_size if self.moe_latent_size is not None else self.hidden_size

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def mamba_in_proj_size(self) -> int:
        return self.mamba_intermediate_size + self.mamba_conv_dim + self.mamba_num_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor) if self.rope_theta is not None else 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("hf_config")
        return d

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_hf(cls, path_or_dict: str | Path | Mapping[str, Any]) -> "HybridConfig":
        """Parse an HF ``config.json`` (a checkpoint directory, the file, or the dict): ``jaxmamba.hf_config``
        reads each family's spelling."""
        cfg = cls(**hybrid_config_fields(read_config_json(path_or_dict)))
        cfg.validate()
        return cfg

    def validate(self) -> None:
        """Raise ``ConfigError`` naming the first field that makes this model unservable."""
        _require(self.vocab_size > 0, "vocab_size", self.vocab_size, "must be > 0")
        _require(self.hidden_size > 0, "hidden_size", self.hidden_size, "must be > 0")
        _require(len(self.layer_types) > 0, "layer_types", self.layer_types, "must name at least one layer")
        for i, kind in enumerate(self.layer_types):
            _require(kind in ("mamba", "attention", "hybrid", "mlp", "moe"), f"layer_types[{i}]", kind,
                     "unknown kind")
            if kind == "moe":
                _require(not self.ffn_after_mixer and self.moe_num_experts > 0, f"layer_types[{i}]", kind,
                         "needs a family with expert blocks (NemotronH) and n_routed_experts > 0")
        if self.moe_layer_ids:
            self._validate_moe()
        if self.mamba_layer_ids:
            _require(self.mamba_num_heads > 0, "mamba_num_heads", self.mamba_num_heads, "must be > 0")
            _require(self.mamba_head_dim > 0, "mamba_head_dim", self.mamba_head_dim, "must be > 0")
            _require(self.mamba_d_state > 0, "mamba_d_state", self.mamba_d_state, "must be > 0")
            _require(
                self.mamba_num_heads * self.mamba_head_dim == self.mamba_intermediate_size,
                "mamba_intermediate_size",
                self.mamba_intermediate_size,
                f"must equal mamba_num_heads*mamba_head_dim={self.mamba_num_heads * self.mamba_head_dim}",
            )
            _require(
                self.mamba_n_groups > 0 and self.mamba_num_heads % self.mamba_n_groups == 0,
                "mamba_n_groups",
                self.mamba_n_groups,
                f"must divide mamba_num_heads={self.mamba_num_heads}",
            )
            _require(self.mamba_conv_kernel >= 2, "mamba_conv_kernel", self.mamba_conv_kernel, "must be >= 2")
            _require(self.mamba_chunk_size > 0, "mamba_chunk_size", self.mamba_chunk_size, "must be > 0")
            _require(
                self.mamba_activation in ("silu", "swish"),
                "mamba_activation",
                self.mamba_activation,
                "only silu is supported for the Mamba2 conv",
            )
        if self.attention_layer_ids:
            _require(self.num_attention_heads > 0, "num_attention_heads", self.num_attention_heads, "must be > 0")
            _require(
                self.num_key_value_heads > 0 and self.num_attention_heads % self.num_key_value_heads == 0,
                "num_key_value_heads",
                self.num_key_value_heads,
                f"must divide num_attention_heads={self.num_attention_heads}",
            )
            _require(self.head_dim > 0, "head_dim", self.head_dim, "must be > 0")
            if self.rope_theta is not None:
                _require(self.rotary_dim % 2 == 0, "partial_rotary_factor", self.partial_rotary_factor,
                         "must give an even rotary dimension")
        if self.mlp_kind is not None:
            _require(self.mlp_kind in ("gated", "relu2", "granite"), "mlp_kind", self.mlp_kind, "unknown")
            _require(self.intermediate_size > 0, "intermediate_size", self.intermediate_size, "must be > 0")
            _require(self.mlp_activation in _SUPPORTED_ACTIVATIONS, "mlp_activation", self.mlp_activation,
                     f"must be one of {_SUPPORTED_ACTIVATIONS}")
        needs_ffn = self.ffn_after_mixer or "mlp" in self.layer_types
        _require(not needs_ffn or self.mlp_kind is not None, "mlp_kind", self.mlp_kind, "layers need an MLP")
        _require(len(self.ssm_multipliers) == 5, "ssm_multipliers", self.ssm_multipliers, "must have 5 entries")
        _require(len(self.mlp_multipliers) == 2, "mlp_multipliers", self.mlp_multipliers, "must have 2 entries")


    def _validate_moe(self) -> None:
        e, k = self.moe_num_experts, self.moe_top_k
        _require(e > 0, "moe_num_experts", e, "must be > 0")
        _require(0 < k <= e, "num_experts_per_tok", k, f"must be in [1, {e}] (the number of experts)")
        _require(self.moe_intermediate_size > 0, "moe_intermediate_size", self.moe_intermediate_size, "must be > 0")
        _require(self.moe_expert_kind in ("relu2", "gated"), "moe_expert_kind", self.moe_expert_kind,
                 "must be 'relu2' or 'gated'")
        _require(self.moe_activation in _SUPPORTED_ACTIVATIONS, "moe_activation", self.moe_activation,
                 f"must be one of {_SUPPORTED_ACTIVATIONS}")
        _require(self.moe_scoring in ("softmax", "sigmoid"), "moe_scoring", self.moe_scoring,
                 "must be 'softmax' or 'sigmoid'")
        g, tg = self.moe_n_group, self.moe_topk_group
        _require(g > 0 and e % g == 0, "n_group", g, f"must divide n_routed_experts={e}")
        _require(0 < tg <= g, "topk_group", tg, f"must be in [1, n_group={g}]")
        if self.moe_scoring == "sigmoid":
            # transformers scores a group by the sum of its two best experts.
            _require(e // g >= 2, "n_group", g, f"leaves fewer than 2 experts per group (n_routed_experts={e})")
            _require(k <= tg * (e // g), "num_experts_per_tok", k,
                     f"exceeds the {tg * (e // g)} experts of the topk_group={tg} chosen groups")
        _require(self.moe_latent_size is None or self.moe_latent_size > 0, "moe_latent_size", self.moe_latent_size,
                 "must be > 0 or null")


def _require(ok: bool, name: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{name}={value!r} {why}")
