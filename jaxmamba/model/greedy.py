"""Cache-free greedy generation over the whole-sequence model (the reference the engine is checked against).

Because the model is causal, logits at position ``t`` depend only on tokens
``<= t``: each sequence is padded once to a fixed length and the same compiled
forward is reused for every new token, so there is a single compilation.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxmamba.errors import RequestError


def greedy_generate(
    model, prompts: Sequence[Sequence[int]], max_tokens: int, *, progress: bool = False
) -> tuple[list[list[int]], list[np.ndarray]]:
    """Greedy continuation of each prompt by ``max_tokens`` tokens.

    Returns ``(tokens, logits)``: per prompt the generated ids and the float32
    ``[max_tokens, vocab]`` logits each was chosen from (for near-tie checks).
    """
    if max_tokens <= 0:
        raise RequestError(f"max_tokens={max_tokens} must be > 0")
    vocab = model.cfg.vocab_size
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise RequestError(f"prompt {i} is empty")
        if min(p) < 0 or max(p) >= vocab:
            raise RequestError(f"prompt {i} has a token id outside [0, {vocab})")
    lengths = np.array([len(p) for p in prompts])
    total = int(lengths.max()) + max_tokens
    ids = np.zeros((len(prompts), total), np.int32)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = p

    @jax.jit
    def step(ids, pos):
        logits = model(ids)
        return jnp.take_along_axis(logits, pos[:, None, None], axis=1)[:, 0]

    out_tokens = [[] for _ in prompts]
    out_logits = [[] for _ in prompts]
    rows = np.arange(len(prompts))
    steps = range(max_tokens)
    if progress:
        from tqdm import tqdm

        steps = tqdm(steps, desc="generate", unit="tok")
    for k in steps:
        pos = lengths - 1 + k
        logits = np.asarray(step(jnp.asarray(ids), jnp.asarray(pos, jnp.int32)))
        nxt = logits.argmax(-1)
        ids[rows, pos + 1] = nxt
        for i in rows:
            out_tokens[i].append(int(nxt[i]))
            out_logits[i].append(logits[i])
    return out_tokens, [np.stack(l) for l in out_logits]
