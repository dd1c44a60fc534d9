"""Bytes a decode step sends for the Mamba state slots, before and after the persistent state table (computed).

Not a test, no model: the real ``PrefixCacheManager`` and the runner's two persistent tables
(``engine.block_table``) follow a steady decode of ``--reqs`` staggered requests (prompts of random
length, each prefilled in one step, then one token per step), as ``ModelRunner._inputs`` drives them.
Before: every step packed the decode bucket's slot arrays (``metadata.device_slots.DEVICE_SLOT_FIELDS``:
``2 R (1 + num_spec) + 2 P`` int32) into ``int_buf``. After: nothing in ``int_buf``, and the update arrays
of the state table's scatter calls (``DeviceTable.num_update_bytes``) in the steps that change slots.
The block table's update bytes are printed beside them (scatter calls take the smallest program of
``update_capacity_ladder`` that holds a step's entries).

    PYTHONPATH=<tree> python benchmarks/state_table_bytes.py [--reqs 128] [--steps 64] [--block-size 16]
"""

from __future__ import annotations

import argparse

import numpy as np

from jaxmamba.engine.block_table import DeviceBlockTable, DeviceTable, default_update_capacity
from jaxmamba.engine.prefix_cache import PrefixCacheManager


def simulate(mode: str, reqs: int, steps: int, block_size: int, max_model_len: int, max_batched: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    slots = reqs * 72 + 1  # mode all holds one state per prompt block until the first commit
    kv = PrefixCacheManager(reqs * (max_model_len // block_size) + 1, slots, block_size, mode, 0,
                            max_model_len=max_model_len, enable_caching=mode != "none")
    capacity = default_update_capacity(max_batched, reqs, block_size)
    blocks = DeviceBlockTable(reqs + 1, kv.num_kv_columns, update_capacity=capacity, holds=kv.has_request)
    states = DeviceTable(reqs + 1, kv.num_state_columns, update_capacity=2 * capacity, value_limit=slots)
    ids = [f"r{i}" for i in range(reqs)]
    lengths, block_bytes = {}, []
    for rid in ids:
        n = int(rng.integers(block_size * 4, block_size * 64))
        tokens = rng.integers(3, 30000, n).tolist()
        assert kv.allocate_for_new_request(rid, tokens, n) is not None
        lengths[rid] = (tokens, n)

    def step(grow: int):
        for rid in ids:
            tokens, n = lengths[rid]
            assert kv.allocate_more(rid, n + grow)
        before_blocks = blocks.num_update_bytes
        row_map = blocks.sync(ids, [kv.kv_block_list(rid) for rid in ids])
        block_bytes.append(blocks.num_update_bytes - before_blocks)
        before = states.num_update_bytes
        states.write_rows(ids, row_map, [kv.state_table_list(rid) for rid in ids],
                          [kv.state_table_window(rid) for rid in ids])
        for rid in ids:
            tokens, n = lengths[rid]
            tokens.append(int(rng.integers(3, 30000)))
            kv.commit(rid, n + grow, token_ids=tokens)
            lengths[rid] = (tokens, n + grow)
        return states.num_update_bytes - before, len(states.last_updates)

    for rid in ids:  # the prefill step: the tables start filled (the admissions' bytes are not steady state)
        tokens, n = lengths[rid]
        lengths[rid] = (tokens, n - 1)
    step(1)
    # The first decode step also clears the prompt's columns the prefill's commit released (mode all): once
    # per admission, reported apart.
    first = step(1)
    per_step = [step(1) for _ in range(steps)]
    return (first, np.array([b for b, _ in per_step]), np.array([e for _, e in per_step]), kv.num_state_columns,
            np.array(block_bytes[-steps:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reqs", type=int, default=128)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    args = parser.parse_args()
    r, p = args.reqs, 1  # the decode bucket of R rows carries one (unused) prefill row
    for num_spec in (0, 2):
        before = 4 * (2 * r * (1 + num_spec) + 2 * p)
        print(f"before, num_spec={num_spec}: {before:,} B per decode step in int_buf (every mode)")
    for mode in ("none", "align", "all"):
        first, sent, entries, columns, block_sent = simulate(mode, r, args.steps, args.block_size, args.max_model_len,
                                                 args.max_num_batched_tokens)
        print(f"after, mode {mode} ({columns} columns): {sent.mean():,.0f} B per decode step on average "
              f"(max {sent.max():,}, {np.mean(sent == 0):.0%} of steps send nothing); "
              f"{entries.mean():.1f} entries per step (max {entries.max()}); first decode step after the "
              f"prefill: {first[0]:,} B, {first[1]} entries; the block table's updates: {block_sent.mean():,.0f} B "
              f"per decode step (max {block_sent.max():,})")


if __name__ == "__main__":
    main()
