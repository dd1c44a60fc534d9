"""The CPU step's weight layout: which parameters it stores as (in, out), and the round trip back."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxmamba import load_pretrained, random_model
from jaxmamba.model.serving import cpu_weight_layout, from_weight_layout, to_weight_layout


@pytest.mark.parametrize("family", ["nemotron_h", "bamba", "granite_hybrid_moe"])
def test_linear_weights_are_transposed_and_restored(tmp_path, family):
    model = load_pretrained(random_model(family, path=tmp_path / "ckpt"))
    _, params = nnx.split(model)
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    leaves = [leaf for _, leaf in flat]
    transposed = cpu_weight_layout(params)
    picked = {jax.tree_util.keystr(path) for (path, _), t in zip(flat, transposed) if t}
    kept = {jax.tree_util.keystr(path) for (path, _), t in zip(flat, transposed) if not t}
    assert any("in_proj" in k for k in picked) and any("out_proj" in k for k in picked)
    assert any("q_proj" in k for k in picked) and any("down_proj" in k or "output_linear" in k for k in picked)
    # Gathered (embedding), elementwise (conv taps, norms) and per-expert (3-D) weights keep their layout.
    assert any("embed" in k for k in kept) and any("conv_weight" in k for k in kept)
    assert not any("embed" in k or "conv_weight" in k or "norm" in k for k in picked)
    stored = to_weight_layout(leaves, transposed)
    for leaf, out, t in zip(leaves, stored, transposed):
        assert out.shape == (leaf.shape[::-1] if t else leaf.shape)
    for leaf, back in zip(leaves, from_weight_layout(stored, transposed)):
        np.testing.assert_array_equal(np.asarray(back), np.asarray(leaf))
