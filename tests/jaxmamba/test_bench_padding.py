"""``python -m jaxmamba.bench padding``: the padding each bucket ladder costs on a recorded workload."""

from __future__ import annotations

import json

import pytest

from jaxmamba.bench.__main__ import main as bench_main


def test_padding_records_every_step_and_prices_each_ladder(tmp_path, capsys):
    out = tmp_path / "padding.json"
    assert bench_main(["padding", "--num-requests", "12", "--max-num-seqs", "8", "--max-num-batched-tokens", "64",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    # 12 requests of 8-48 output tokens through 8 rows: dozens of steps, every one recorded.
    assert data["steps"] >= 8
    for name in ("default", "pow2"):
        r = data["results"][name]
        assert r["buckets"] >= 1 and r["programs"] >= r["buckets"]
        assert r["tokens_padded"] >= 0 and r["rows_padded"] >= 0 and r["prefill_rows_padded"] >= 0
        # The chosen buckets hold the batches: their mean size is at least the padding.
        assert r["bucket_tokens"] > r["tokens_padded"] and r["bucket_rows"] > r["rows_padded"]
    assert "workload mixed at max_num_seqs=8" in capsys.readouterr().out


def test_every_step_is_recorded_not_only_each_new_batch_shape():
    """The runner remembers each batch shape's bucket, so ``select_bucket`` runs only for a shape it has not met;
    the recorder counts the runner's selection, which runs every step (it once priced each shape once)."""
    from jaxmamba.bench import padding, serve
    from jaxmamba.random_checkpoint import default_checkpoint

    prompts, max_tokens = serve.workload(12, 512, (8, 40), (8, 48), 0)
    batches = padding.record_batches(default_checkpoint(), prompts, max_tokens,
                                     dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=160))
    # One token a step per request: the longest request alone takes max(max_tokens) steps.
    assert len(batches) >= max(max_tokens)
    assert len(set(batches)) < len(batches)  # full decode steps repeat one shape
    decode = [b for b in batches if b[3]]
    assert decode and all(prefills == 0 for _, _, prefills, _ in decode)


def test_a_failed_step_is_an_error_not_a_table_of_nothing(monkeypatch):
    """A step that fails ends its requests with an error; the bench says so instead of pricing the ladders on the
    steps that happened to run (it printed NaNs, then an IndexError)."""
    from jaxmamba.bench import padding, serve
    from jaxmamba.engine import runner
    from jaxmamba.random_checkpoint import default_checkpoint

    def failing(*args, **kwargs):
        raise RuntimeError("no bucket today")

    monkeypatch.setattr(runner, "select_bucket", failing)
    prompts, max_tokens = serve.workload(4, 512, (8, 16), (4, 8), 0)
    with pytest.raises(RuntimeError, match="4 of 4 requests did not finish normally"):
        padding.record_batches(default_checkpoint(), prompts, max_tokens,
                               dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64))
