"""The metadata rules against vLLM 0.33's own functions (the ``vllm_oracle`` venv).

One oracle call computes every vLLM answer (importing vLLM takes seconds);
each test then compares one function. Skipped when the vLLM venv is absent.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from jaxmamba.metadata import (
    batch_regions,
    build_common_metadata,
    build_mamba_metadata,
    check_batch_order,
    compute_chunk_metadata,
    mamba_block_table_columns,
    reorder_batch,
    split_decodes_and_prefills,
)

pytestmark = pytest.mark.vllm

RNG = np.random.default_rng(20261123)


def _split_cases():
    cases = []
    for _ in range(300):
        n = int(RNG.integers(1, 8))
        thr = int(RNG.choice([1, 1, 2, 3]))
        # Mostly ordered batches (short first), sometimes arbitrary ones: vLLM's
        # function does not check the order, and neither does ours.
        q = RNG.integers(1, 6, size=n)
        if RNG.random() < 0.7:
            q = np.sort(q)
        if RNG.random() < 0.2:
            q[RNG.integers(0, n)] = 0  # padded-uniform rows have length 0
        prefilling = RNG.random(n) < 0.4
        cases.append(
            dict(
                q=q.tolist(),
                prefilling=prefilling.tolist(),
                thr=thr,
                treat=bool(RNG.random() < 0.5),
                uniform=bool(RNG.random() < 0.25),
            )
        )
    return cases


def _chunk_cases():
    cases = []
    for _ in range(200):
        p = int(RNG.integers(1, 6))
        cs = int(RNG.choice([1, 2, 4, 8, 16]))
        computed = RNG.integers(0, 40, size=p) * RNG.integers(0, 2, size=p)
        q = RNG.integers(1, 40, size=p)
        cases.append(dict(cs=cs, computed=computed.tolist(), q=q.tolist()))
    return cases


def _reorder_cases():
    cases = []
    for _ in range(150):
        n = int(RNG.integers(1, 9))
        thr = int(RNG.choice([1, 2, 3]))
        computed = RNG.integers(0, 30, size=n) * (RNG.random(n) < 0.8)
        prompt = np.maximum(computed + RNG.integers(-10, 10, size=n), 1)
        q = np.where(RNG.random(n) < 0.6, RNG.integers(1, thr + 1, size=n), RNG.integers(1, 20, size=n))
        cases.append(dict(thr=thr, computed=computed.tolist(), prompt=prompt.tolist(), q=q.tolist()))
    return cases


def _align_case():
    """A mixed batch in mode align with spec decode, for vLLM's block-table gather."""
    k, bs, mml = 2, 4, 48
    computed = np.array([9, 20, 7, 0, 12])
    q = np.array([3, 2, 1, 9, 10])
    prompt = np.array([5, 10, 30, 9, 40])
    order = reorder_batch(q, computed < prompt, computed + q, decode_threshold=1 + k)
    computed, q, prompt = computed[order], q[order], prompt[order]
    cols = mamba_block_table_columns("align", mml, bs, k)
    table = np.arange(len(q) * cols).reshape(len(q), cols) + 1
    return dict(k=k, bs=bs, mml=mml, computed=computed, q=q, prompt=prompt, table=table)


ORACLE = r"""
import json, types
import numpy as np
import torch
from vllm.v1.attention.backends.utils import (
    split_decodes_and_prefills, reorder_batch_to_split_decodes_and_prefills, mamba_get_block_table_tensor)
from vllm.v1.attention.backends.mamba_attn import BaseMambaAttentionMetadataBuilder
from vllm.v1.kv_cache_interface import MambaSpec

data = json.loads(DATA)
out = {}

res = []
for c in data["split"]:
    q = torch.tensor(c["q"], dtype=torch.int32)
    qsl = torch.zeros(len(c["q"]) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q, 0)
    m = types.SimpleNamespace(max_query_len=int(q.max()), num_reqs=len(c["q"]), num_actual_tokens=int(q.sum()),
                              query_start_loc_cpu=qsl, is_prefilling=torch.tensor(c["prefilling"]))
    res.append(list(split_decodes_and_prefills(m, decode_threshold=c["thr"], require_uniform=c["uniform"],
                                               treat_short_extends_as_decodes=c["treat"])))
out["split"] = res

res = []
for c in data["chunks"]:
    q = torch.tensor(c["q"])
    qsl = torch.zeros(len(c["q"]) + 1, dtype=torch.int64)
    qsl[1:] = torch.cumsum(q, 0)
    cu, seq_idx, last, _ = BaseMambaAttentionMetadataBuilder._compute_chunk_metadata(
        c["cs"], len(c["q"]), torch.tensor(c["computed"]), qsl)
    res.append([list(map(int, cu)), list(map(int, seq_idx)), list(map(int, last))])
out["chunks"] = res

res = []
for c in data["reorder"]:
    n = len(c["q"])
    batch = types.SimpleNamespace(req_ids=[f"r{i}" for i in range(n)],
                                  num_computed_tokens_cpu=np.array(c["computed"]),
                                  num_prompt_tokens=np.array(c["prompt"]))
    def swap(i, j, b=batch):
        for name in ("num_computed_tokens_cpu", "num_prompt_tokens"):
            a = getattr(b, name); a[[i, j]] = a[[j, i]]
        b.req_ids[i], b.req_ids[j] = b.req_ids[j], b.req_ids[i]
    batch.swap_states = swap
    sched = types.SimpleNamespace(num_scheduled_tokens={f"r{i}": c["q"][i] for i in range(n)})
    reorder_batch_to_split_decodes_and_prefills(batch, sched, decode_threshold=c["thr"])
    res.append([int(r[1:]) for r in batch.req_ids])
out["reorder"] = res

cols = {}
for mode in ("none", "align"):
    for k in (0, 1, 3):
        for mml, bs in ((100, 16), (96, 16), (4096, 528), (7, 8)):
            spec = MambaSpec(block_size=bs, shapes=((4, 3), (2, 4, 8)), dtypes=(torch.float32, torch.float32),
                             mamba_cache_mode=mode, num_speculative_blocks=k)
            cfg = types.SimpleNamespace(cache_config=types.SimpleNamespace(mamba_cache_mode=mode))
            cols[f"{mode},{k},{mml},{bs}"] = int(spec.max_num_blocks_per_req(cfg, mml))
out["columns"] = cols

a = data["align"]
spec = MambaSpec(block_size=a["bs"], shapes=((4, 3), (2, 4, 8)), dtypes=(torch.float32, torch.float32),
                 mamba_cache_mode="align", num_speculative_blocks=a["k"])
seq = torch.tensor(a["computed"]) + torch.tensor(a["q"])
got = mamba_get_block_table_tensor(torch.tensor(a["table"], dtype=torch.int32), seq.to(torch.int32), spec, "align")
out["align"] = got.tolist()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def oracle(vllm_oracle):
    align = _align_case()
    data = dict(
        split=_split_cases(),
        chunks=_chunk_cases(),
        reorder=_reorder_cases(),
        align={k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in align.items()},
    )
    answer = vllm_oracle(f"DATA = {json.dumps(json.dumps(data))}\n" + ORACLE)
    return data, answer, align


def test_split_decodes_and_prefills_matches_vllm(oracle):
    data, answer, _ = oracle
    for case, expected in zip(data["split"], answer["split"]):
        got = split_decodes_and_prefills(
            case["q"],
            case["prefilling"],
            decode_threshold=case["thr"],
            treat_short_extends_as_decodes=case["treat"],
            require_uniform=case["uniform"],
        )
        assert list(got) == expected, case


def test_chunk_metadata_matches_vllm_builder(oracle):
    data, answer, _ = oracle
    for case, (cu, seq_idx, last) in zip(data["chunks"], answer["chunks"]):
        got = compute_chunk_metadata(case["computed"], case["q"], case["cs"])
        assert [list(map(int, g)) for g in got] == [cu, seq_idx, last], case


def test_reorder_batch_gives_vllm_regions(oracle):
    data, answer, _ = oracle
    for case, vllm_order in zip(data["reorder"], answer["reorder"]):
        q, computed, prompt = (np.array(case[key]) for key in ("q", "computed", "prompt"))
        thr = case["thr"]
        perm = reorder_batch(q, computed < prompt, computed + q, decode_threshold=thr)
        ours = batch_regions(q[perm], computed[perm], (computed < prompt)[perm], thr)
        theirs = batch_regions(q[vllm_order], computed[vllm_order], (computed < prompt)[vllm_order], thr)
        assert list(ours) == list(theirs), case
        # vLLM's order passes our order check.
        check_batch_order(q[vllm_order], computed[vllm_order], (computed < prompt)[vllm_order], thr)


def test_mamba_block_table_columns_match_vllm_spec(oracle):
    _, answer, _ = oracle
    for key, expected in answer["columns"].items():
        mode, k, mml, bs = key.split(",")
        assert mamba_block_table_columns(mode, int(mml), int(bs), int(k)) == expected, key


def test_align_destination_slots_match_vllm_gather(oracle):
    # vLLM 0.33 gathers each row's 1 + num_spec slots from the block of its last
    # scheduled token: jaxmamba's destination windows (and prefill final slots).
    _, answer, a = oracle
    n = len(a["q"])
    common = build_common_metadata(
        num_reqs=n,
        num_computed_tokens=a["computed"],
        num_scheduled_tokens=a["q"],
        num_prompt_tokens=a["prompt"],
        block_table=np.arange(n * 12).reshape(n, 12) + 1,
        block_size=a["bs"],
        num_reqs_padded=8,
        num_tokens_padded=32,
        max_model_len=a["mml"],
        decode_threshold=1 + a["k"],
    )
    md = build_mamba_metadata(
        common,
        state_indices=a["table"],
        cache_mode="align",
        block_size=a["bs"],
        num_speculative_blocks=a["k"],
        num_accepted_tokens=np.ones(n, dtype=int),
        chunk_size=2,
    )
    expected = np.array(answer["align"])
    nd = int(md.num_decodes)
    assert 0 < nd < n
    assert np.array_equal(np.asarray(md.state_indices_decode_dst)[:nd], expected[:nd])
    assert np.array_equal(np.asarray(md.state_indices_prefill)[: n - nd], expected[nd:, 0])
