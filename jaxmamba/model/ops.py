"""Pure math shared by the whole-sequence (research) path and the serving path.

Every function here is a pure function of arrays; numerics follow the
HuggingFace transformers torch implementations of the five families so logits
can be compared line by line: normalisation and the SSM run in float32 and cast
back to the input dtype at the same points transformers does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# The stable (masked-cumsum) segment sum lives with the kernels' references, which share it.
from pallas_kernels.reference.common import segment_sum


def linear(x: jax.Array, weight: jax.Array, bias: jax.Array | None = None) -> jax.Array:
    """``x @ weight.T (+ bias)`` with ``weight`` kept in torch's ``(out, in)`` orientation."""
    y = jnp.einsum("...i,oi->...o", x, weight.astype(x.dtype))
    return y if bias is None else y + bias.astype(y.dtype)


def activation(name: str, x: jax.Array) -> jax.Array:
    if name in ("silu", "swish"):
        return jax.nn.silu(x)
    if name == "relu2":
        return jnp.square(jax.nn.relu(x))
    if name == "relu":
        return jax.nn.relu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name == "gelu_pytorch_tanh":
        return jax.nn.gelu(x, approximate=True)
    raise ValueError(f"activation {name!r} is not supported")


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, weight applied in float32, cast back to ``x.dtype``."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def gated_rms_norm(
    y: jax.Array,
    gate: jax.Array,
    weight: jax.Array,
    *,
    n_groups: int,
    eps: float,
    norm_before_gate: bool = False,
) -> jax.Array:
    """Mamba2's gated RMSNorm over ``n_groups`` groups of the last axis.

    ``norm_before_gate=False`` (Mamba2, NemotronH, Bamba, Granite):
    ``rmsnorm(y * silu(gate))``; ``True`` (FalconH1 option): ``rmsnorm(y) * silu(gate)``.
    """
    dtype = y.dtype
    y32 = y.astype(jnp.float32)
    g32 = jax.nn.silu(gate.astype(jnp.float32))
    if not norm_before_gate:
        y32 = y32 * g32
    shape = y32.shape
    grouped = y32.reshape(*shape[:-1], n_groups, shape[-1] // n_groups)
    grouped = grouped * jax.lax.rsqrt(jnp.mean(jnp.square(grouped), axis=-1, keepdims=True) + eps)
    y32 = grouped.reshape(shape) * weight.astype(jnp.float32)
    if norm_before_gate:
        y32 = y32 * g32
    return y32.astype(dtype)


# ---------------------------------------------------------------------------- rotary
def rope_cos_sin(positions: jax.Array, rotary_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables ``[..., rotary_dim]`` for integer ``positions`` (HF's default rope)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``cos.shape[-1]`` dims of ``x [..., heads, head_dim]`` (rotate-half form).

    ``cos``/``sin`` are ``[..., rotary_dim]`` without the heads axis.
    """
    rotary_dim = cos.shape[-1]
    cos = cos[..., None, :].astype(x.dtype)
    sin = sin[..., None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


# ---------------------------------------------------------------------------- conv
def causal_conv1d(
    x: jax.Array, weight: jax.Array, bias: jax.Array | None, initial_state: jax.Array | None = None
) -> jax.Array:
    """Depthwise causal conv over time.

    Args:
      x: ``[batch, T, channels]``.
      weight: ``[channels, K]`` (torch's ``conv1d.weight`` squeezed).
      bias: ``[channels]`` or None.
      initial_state: ``[batch, channels, K-1]`` history (DS layout, oldest first) or None (zeros).

    Returns ``[batch, T, channels]`` (before the activation).
    """
    k = weight.shape[-1]
    if initial_state is None:
        history = jnp.zeros((x.shape[0], k - 1, x.shape[-1]), x.dtype)
    else:
        history = jnp.swapaxes(initial_state, 1, 2).astype(x.dtype)
    padded = jnp.concatenate([history, x], axis=1)  # [b, K-1+T, c]
    t = x.shape[1]
    out = sum(padded[:, i : i + t, :] * weight[:, i].astype(x.dtype) for i in range(k))
    return out if bias is None else out + bias.astype(x.dtype)


# ---------------------------------------------------------------------------- SSD
def discretize_dt(
    dt: jax.Array, dt_bias: jax.Array, time_step_limit: tuple[float, float]
) -> jax.Array:
    """``clamp(softplus(dt + dt_bias), *limit)`` in float32 (``dt [..., H]``)."""
    dt = jax.nn.softplus(dt.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    lo, hi = time_step_limit
    return jnp.clip(dt, lo, hi)


def ssd_chunked(
    x: jax.Array,
    dt: jax.Array,
    A: jax.Array,
    B: jax.Array,
    C: jax.Array,
    *,
    chunk_size: int,
    D: jax.Array | None = None,
    initial_state: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Mamba2 SSD (state-space duality) scan over dense batches, float32 throughout.

    Args:
      x: ``[b, T, H, P]`` inputs.
      dt: ``[b, T, H]`` already discretised (softplus + clamp applied).
      A: ``[H]`` negative decay rates (``-exp(A_log)``).
      B, C: ``[b, T, G, N]``; each group serves ``H / G`` consecutive heads.
      D: ``[H]`` skip term or None.
      initial_state: ``[b, H, P, N]`` or None.

    Returns ``(y [b, T, H, P] float32, final_state [b, H, P, N] float32)``.
    """
    b, t, h, p = x.shape
    g, n = B.shape[-2:]
    x = x.astype(jnp.float32)
    heads_per_group = h // g
    Bh = jnp.repeat(B.astype(jnp.float32), heads_per_group, axis=2)
    Ch = jnp.repeat(C.astype(jnp.float32), heads_per_group, axis=2)
    pad = (-t) % chunk_size
    q = chunk_size
    nc = (t + pad) // q

    def chunks(a):
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return a.reshape(b, nc, q, *a.shape[2:])

    xdt = chunks(x * dt[..., None])  # [b, c, l, h, p]
    a = chunks(A.astype(jnp.float32) * dt)  # [b, c, l, h]; padding gives a=0 (no decay, no input)
    Bc, Cc = chunks(Bh), chunks(Ch)  # [b, c, l, h, n]
    a = jnp.moveaxis(a, -1, 1)  # [b, h, c, l]
    a_cumsum = jnp.cumsum(a, axis=-1)

    # 1. intra-chunk (diagonal blocks): masked "attention" C B^T * L.
    L = jnp.exp(segment_sum(a))  # [b, h, c, l, s]
    y_diag = jnp.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cc, Bc, L, xdt)

    # 2. each chunk's contribution to the state at its end.
    decay_states = jnp.exp(a_cumsum[..., -1:] - a_cumsum)  # [b, h, c, l]
    states = jnp.einsum("bclhn,bhcl,bclhp->bchpn", Bc, decay_states, xdt)

    # 3. inter-chunk recurrence (a small quadratic form over chunks).
    init = jnp.zeros((b, 1, h, p, n), jnp.float32) if initial_state is None else initial_state[:, None].astype(jnp.float32)
    states = jnp.concatenate([init, states], axis=1)  # [b, c+1, h, p, n]
    chunk_decay = jnp.exp(segment_sum(jnp.pad(a_cumsum[..., -1], [(0, 0), (0, 0), (1, 0)])))  # [b, h, c+1, c+1]
    new_states = jnp.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]

    # 4. state -> output for each chunk.
    y_off = jnp.einsum("bclhn,bchpn,bhcl->bclhp", Cc, states, jnp.exp(a_cumsum))
    y = (y_diag + y_off).reshape(b, nc * q, h, p)[:, :t]
    if D is not None:
        y = y + x * D.astype(jnp.float32)[:, None]
    return y, final_state
