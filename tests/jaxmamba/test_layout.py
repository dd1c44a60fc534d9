"""State shapes and page sizes against vLLM's MambaStateShapeCalculator / MambaSpec."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jaxmamba.config import HybridConfig
from jaxmamba.errors import ConfigError
from jaxmamba.layout import (
    conv_channel_split,
    extra_groups_for_head_shards,
    kv_cache_shape,
    mamba2_state_shape,
    page_size_bytes,
    state_shapes,
)
from jaxmamba.random_checkpoint import random_config_dict


def test_nemotron_h_8b_shapes_by_hand():
    # Nemotron-H-8B: I=8192, G=8, H=128, P=64, N=128, K=4 -> conv_dim = 8192 + 2*8*128 = 10240.
    assert mamba2_state_shape(1, 8192, 8, 128, 64, 128, 4) == ((10240, 3), (128, 64, 128))
    assert mamba2_state_shape(4, 8192, 8, 128, 64, 128, 4) == ((2560, 3), (32, 64, 128))
    assert mamba2_state_shape(2, 8192, 8, 128, 64, 128, 4, num_spec=3) == ((5120, 6), (64, 64, 128))
    assert mamba2_state_shape(2, 8192, 8, 128, 64, 128, 4, conv_layout="SD") == ((3, 5120), (64, 64, 128))


def test_single_group_is_replicated_across_ranks():
    assert extra_groups_for_head_shards(1, 4) == 3
    assert extra_groups_for_head_shards(8, 4) == 0
    # I=4096, G=1 -> G'=4 at TP=4: each rank holds x_local=1024 plus the whole group (2*N).
    conv, _ = mamba2_state_shape(4, 4096, 1, 64, 64, 128, 4)
    assert conv == (1024 + 2 * 128, 3)


def test_non_dividing_groups_other_than_one_are_rejected():
    with pytest.raises(ConfigError, match="n_groups=3"):
        extra_groups_for_head_shards(3, 2)
    with pytest.raises(ConfigError, match="num_heads"):
        mamba2_state_shape(3, 96, 1, 8, 12, 16, 4)


def test_page_size_and_channel_split_from_config():
    cfg = HybridConfig.from_hf(random_config_dict("bamba"))  # I=128, G=2, N=16, H=8, P=16, K=4
    assert state_shapes(cfg, 2) == ((64 + 32, 3), (4, 16, 16))
    assert page_size_bytes(cfg, 2, conv_dtype=np.float16, ssm_dtype=np.float32) == 96 * 3 * 2 + 4 * 16 * 16 * 4
    split = conv_channel_split(cfg, 2)
    assert (split.x_local, split.b_local, split.conv_dim_local) == (64, 16, 96)


def test_kv_cache_shape_replicates_heads_when_tp_exceeds_them():
    assert kv_cache_shape(10, 16, 8, 64, tp_size=2) == (2, 10, 16, 4, 64)
    assert kv_cache_shape(10, 16, 2, 64, tp_size=8) == (2, 10, 16, 1, 64)
    with pytest.raises(ConfigError):
        kv_cache_shape(10, 16, 3, 64, tp_size=2)


CASES = [
    (tp, inter, groups, heads, 64, state, 4, spec)
    for tp, (inter, groups, heads), state, spec in itertools.product(
        [1, 2, 4, 8], [(4096, 1, 64), (8192, 8, 128), (2048, 2, 32)], [64, 128], [0, 2]
    )
    if groups % tp == 0 or groups == 1
]


@pytest.mark.vllm
def test_shapes_match_vllm(vllm_oracle):
    theirs = vllm_oracle(
        f"""
        import json
        from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as M
        cases = {CASES!r}
        out = []
        for tp, inter, g, h, p, n, k, spec in cases:
            conv, ssm = M.mamba2_state_shape(tp, inter, g, h, p, n, k, num_spec=spec)
            out.append([list(conv), list(ssm), M.extra_groups_for_head_shards(g, tp)])
        print(json.dumps(out))
        """
    )
    for case, (conv, ssm, extra) in zip(CASES, theirs):
        tp, inter, g, h, p, n, k, spec = case
        ours_conv, ours_ssm = mamba2_state_shape(tp, inter, g, h, p, n, k, num_spec=spec)
        assert list(ours_conv) == conv and list(ours_ssm) == ssm, case
        assert extra_groups_for_head_shards(g, tp) == extra, case
