"""``matmul_precision``: a float32 model's step multiplies float32 at full precision (HIGHEST), as torch does, and
in TF32 only when asked; bfloat16 models are left alone. Checked in the programs' HLO, on the CPU and for the
H100 target (where jax's default would let XLA use TF32)."""

from __future__ import annotations

import re

import jax.numpy as jnp
import pytest
from flax import nnx

from jaxmamba import aot
from jaxmamba.buckets import Bucket
from jaxmamba.config import HybridConfig
from jaxmamba.engine.engine_args import EngineConfig
from jaxmamba.engine.sizing import compile_buckets, probe_pools
from jaxmamba.errors import ConfigError
from jaxmamba.model import HybridForCausalLM
from jaxmamba.random_checkpoint import random_config_dict
from jaxmamba.steps import step_matmul_precision

BUCKET = Bucket(16, 2, False, 2)
_DOT = re.compile(r"= f32\[[^\n]*? dot\([^\n]*")


def test_the_option_resolves_by_the_models_dtype():
    assert step_matmul_precision("auto", jnp.float32) == "float32"
    assert step_matmul_precision("auto", jnp.bfloat16) is None  # bf16 products are exact either way
    assert step_matmul_precision("tf32", jnp.float32) is None  # jax's default: TF32 on a GPU
    assert step_matmul_precision("float32", jnp.bfloat16) == "float32"
    with pytest.raises(ConfigError, match="matmul_precision='fp32' must be one of"):
        step_matmul_precision("fp32", jnp.float32)
    with pytest.raises(ConfigError, match="matmul_precision"):
        EngineConfig(matmul_precision="highest")


def _step_hlo(precision: str, target: str | None, backend: str = "reference") -> str:
    cfg = HybridConfig.from_hf(random_config_dict("nemotron_h", "tiny"))
    dt = jnp.float32
    model = nnx.eval_shape(lambda: HybridForCausalLM(cfg, dt))
    sizing = dict(max_num_seqs=2, max_model_len=64, block_size=16, num_spec=0, cache_mode="none", dtype=dt,
                  ssm_dtype=dt, cap_blocks=True, num_blocks=None)
    steps = compile_buckets(model, probe_pools(cfg, **sizing), [BUCKET], block_size=16, max_model_len=64,
                            cache_mode="none", num_spec=0, enable_caching=False, ssm_dtype=dt, backend=backend,
                            target=target, matmul_precision=precision)
    return steps.executable(BUCKET).as_text()


def test_every_float32_matmul_of_a_float32_step_is_at_full_precision():
    """On the CPU (the same traced program a GPU compiles): every float32 dot of the step carries HIGHEST."""
    dots = _DOT.findall(_step_hlo("auto", None))
    assert dots and all("operand_precision={highest,highest}" in d for d in dots), [
        d for d in dots if "highest" not in d][:3]


@pytest.mark.aot
def test_the_h100_program_of_a_float32_step_keeps_full_precision():
    """Compiled for the H100 (deviceless): the model's GEMMs carry HIGHEST (XLA then runs them without TF32);
    with ``matmul_precision="tf32"`` none does."""
    if not aot.aot_available():
        pytest.skip(f"needs the aot extra: {aot.AOT_INSTALL_HINT}")
    full, tf32 = _step_hlo("auto", "h100", "pallas"), _step_hlo("tf32", "h100", "pallas")
    dots = _DOT.findall(full)
    assert len(dots) >= 4 and all("operand_precision={highest,highest}" in d for d in dots), dots[:3]
    assert "highest" not in tf32.lower()
