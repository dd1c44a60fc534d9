"""vLLM's request API: ``LLMEngine`` (caller ids, ``step() -> RequestOutput`` with output kinds, abort),
``n`` samples, stop strings, ``Logprob`` objects, stats snapshots, and ``AsyncLLM``'s async generators."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jaxmamba import LLM, LLMEngine, Logprob, RequestOutputKind, SamplingParams, random_model
from jaxmamba.engine.async_engine import AsyncLLM
from jaxmamba.errors import RequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = random_model("nemotron_h", path=tmp_path_factory.mktemp("api") / "ckpt")
    return LLM(path, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)


def _drain(engine):
    outs: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_output_kinds_stream_as_vllm(llm):
    engine = llm.llm_engine
    want = llm.generate([[5, 6, 7, 8]], GREEDY)[0].outputs[0]
    for kind in RequestOutputKind:
        engine.add_request(kind.name, [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                      output_kind=kind))
    outs = _drain(engine)
    cumulative, delta, final = outs["CUMULATIVE"], outs["DELTA"], outs["FINAL_ONLY"]
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].token_ids == want.token_ids
    assert len(cumulative) == 8 and [len(o.outputs[0].token_ids) for o in cumulative] == list(range(1, 9))
    assert [t for o in delta for t in o.outputs[0].token_ids] == want.token_ids
    assert "".join(o.outputs[0].text for o in delta) == want.text
    assert [o.finished for o in delta] == [False] * 7 + [True]
    assert delta[-1].outputs[0].finish_reason == "length"
    llm.check_invariants()


def test_caller_ids_abort_and_duplicates(llm):
    engine = LLMEngine(llm)
    engine.add_request("a", [1, 2, 3], GREEDY)
    with pytest.raises(RequestError, match="already in use"):
        engine.add_request("a", [4, 5], GREEDY)
    engine.add_request("b", [4, 5, 6], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.step()
    engine.step()
    assert llm.stats.blocks_in_use > 0
    engine.abort_request(["b", "unknown"])
    assert engine.get_num_unfinished_requests() == 1
    outs = _drain(engine)
    assert "b" not in outs and outs["a"][-1].finished
    assert llm.stats.blocks_in_use == 0 and llm.stats.slots_in_use == 0
    llm.check_invariants()
    with pytest.raises(RequestError, match="request_id"):
        engine.add_request(7, [1, 2], GREEDY)


def test_n_samples_and_their_seeds(llm):
    hot = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=6, ignore_eos=True)
    out = llm.generate([[9, 8, 7]], hot)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    # Sample i is the seed+i request (vLLM's parallel sampling).
    singles = [llm.generate([[9, 8, 7]], SamplingParams(temperature=1.0, seed=42 + i, max_tokens=6,
                                                        ignore_eos=True))[0].outputs[0].token_ids for i in range(3)]
    assert [c.token_ids for c in out.outputs] == singles
    with pytest.raises(RequestError, match="greedy"):
        SamplingParams(n=2, temperature=0)


def test_stop_strings_cut_the_text(llm):
    base = llm.generate("Hello, world", GREEDY)[0].outputs[0]
    assert base.text and len(base.text) > 4
    stop = base.text[2:4]
    cut = llm.generate("Hello, world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=stop))[0]
    c = cut.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == base.text[: base.text.index(stop)]
    kept = llm.generate("Hello, world", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, stop=[stop],
                                                       include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base.text[: base.text.index(stop) + len(stop)]
    ids = llm.generate([[1, 2, 3]], GREEDY)[0].outputs[0].token_ids
    by_id = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                     stop_token_ids=[ids[3]]))[0].outputs[0]
    assert by_id.token_ids == ids[: ids.index(ids[3]) + 1] and by_id.stop_reason == ids[3]


def test_logprobs_are_logprob_objects_with_ranks(llm):
    out = llm.generate([[3, 1, 4, 1, 5]], SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=3,
                                                         ignore_eos=True))[0].outputs[0]
    for token, entry in zip(out.token_ids, out.logprobs):
        assert all(isinstance(v, Logprob) for v in entry.values())
        top = sorted((v for k, v in entry.items() if v.rank is not None and v.rank <= 3), key=lambda v: v.rank)
        assert [v.rank for v in top][:3] == [1, 2, 3]
        assert all(a.logprob >= b.logprob for a, b in zip(top, top[1:]))
        sampled = entry[token]
        assert sampled.rank >= 1 and sampled.decoded_token == llm.tokenizer.decode([token], skip_special_tokens=False)
        assert all(sampled.logprob <= v.logprob + 1e-6 for v in top if v.rank < sampled.rank)
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for e, t in zip(out.logprobs, out.token_ids)))


def test_stats_is_a_snapshot(llm):
    before = llm.stats
    llm.generate([[1, 2]], GREEDY)
    assert llm.stats.num_generated_tokens == before.num_generated_tokens + 8
    before.num_steps = -1
    assert llm.stats.num_steps >= 0


def test_async_generators_stream_and_abort_on_close(llm):
    engine = AsyncLLM(LLMEngine(llm))
    want = llm.generate([[2, 4, 6]], GREEDY)[0].outputs[0].token_ids

    async def run():
        delta = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        streamed = [t async for o in engine.generate([2, 4, 6], delta, "s1") for t in o.outputs[0].token_ids]
        # A consumer that stops after two outputs aborts its request.
        long = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        gen = engine.generate([2, 4, 6], long, "s2")
        seen = 0
        async for _ in gen:
            seen += 1
            if seen == 2:
                break
        await gen.aclose()
        others = await asyncio.gather(*[_last(engine.generate([i + 1, 5], GREEDY)) for i in range(6)])
        return streamed, others

    try:
        streamed, others = asyncio.run(run())
        assert streamed == want
        assert all(o.finished and len(o.outputs[0].token_ids) == 8 for o in others)
        assert engine.num_unfinished_requests() == 0
        engine.check_invariants()
        assert llm.stats.slots_in_use == 0
    finally:
        engine.shutdown()


async def _last(gen):
    last = None
    async for o in gen:
        last = o
    return last


def test_generate_accepts_numpy_batches(llm):
    batch = np.array([[1, 2, 3], [4, 5, 6]], np.int64)
    outs = llm.generate(list(batch), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in
                                                      llm.generate([[1, 2, 3], [4, 5, 6]], GREEDY)]


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_random_checkpoints_ship_a_byte_level_tokenizer(tmp_path, size):
    import json

    from tokenizers import Tokenizer

    from jaxmamba.random_checkpoint import random_config_dict, write_tokenizer

    vocab = random_config_dict("nemotron_h", size)["vocab_size"]
    write_tokenizer(tmp_path, vocab)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    text = "Hello, wörld! 日本 \n\t 12345"
    ids = tok.encode(text).ids
    assert tok.decode(ids) == text, "byte-level: any text round-trips"
    assert max(tok.get_vocab().values()) < vocab and tok.token_to_id("<|endoftext|>") == 2
    assert "chat_template" in json.loads((tmp_path / "tokenizer_config.json").read_text())


def test_generate_alongside_request_api_callers_loses_none_of_their_outputs(llm):
    engine = llm.llm_engine
    delta = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("bystander", [2, 4, 6], delta)
    first = [t for o in engine.step() for t in o.outputs[0].token_ids]
    assert llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=3))[0].finished
    outs = _drain(engine)
    want = llm.generate([[2, 4, 6]], GREEDY)[0].outputs[0].token_ids
    assert first + [t for o in outs["bystander"] for t in o.outputs[0].token_ids] == want


def test_a_streaming_caller_gets_an_output_every_step_while_generate_runs(llm):
    """While ``generate`` steps the engine for its own final-only requests, a request-API caller that
    streams still gets an output for every step that gave it a token (DELTA: one token each, none held back
    and merged into a later one), then the same after ``generate`` returns."""
    engine = llm.llm_engine
    delta = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    engine.add_request("streamer", [3, 5, 7], delta)
    outs = engine.step()
    assert llm.generate([[1, 2]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].finished
    for _ in range(3):
        outs += engine.step()  # what generate stepped past, then new steps
    outs += _drain(engine).get("streamer", [])
    sizes = [len(o.outputs[0].token_ids) for o in outs if o.request_id == "streamer"]
    assert sizes == [1] * 12, sizes


def test_max_tokens_none_runs_to_max_model_len(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == llm.max_model_len - 3 and out.finish_reason == "length"


def test_min_p_and_min_tokens_run_on_device(llm):
    prompt = [7, 7, 3, 9]
    greedy = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0]
    # min_p=1 keeps only the most likely token: sampling at any temperature is then greedy.
    only_top = SamplingParams(temperature=1.5, min_p=1.0, seed=9, max_tokens=6, ignore_eos=True)
    assert llm.generate([prompt], only_top)[0].outputs[0].token_ids == greedy.token_ids
    wide = SamplingParams(temperature=1.5, seed=9, max_tokens=6, ignore_eos=True)
    assert llm.generate([prompt], wide)[0].outputs[0].token_ids != greedy.token_ids
    # min_tokens: the stop id greedy decoding hits at output 2 is banned until 4 outputs exist.
    stop_id = greedy.token_ids[1]
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_id]))[0]
    assert stopped.outputs[0].token_ids == greedy.token_ids[:2]
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, stop_token_ids=[stop_id],
                                                 min_tokens=4, logprobs=1))[0].outputs[0]
    assert stop_id not in held.token_ids[:4] and len(held.token_ids) >= 4
    assert held.token_ids[0] == greedy.token_ids[0]
    # logprobs stay the model's own: the banned token is still the most likely at output 2.
    assert held.logprobs[1][stop_id].rank == 1
    with pytest.raises(RequestError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)


def test_generate_builds_each_output_once_not_every_step(llm, monkeypatch):
    """``generate``'s caller sees only final outputs: building a cumulative output for every running request
    at every step made the host cost per token grow with the batch (it was the largest host phase at 256 rows).
    They are built together when it returns, none inside a step: a text decoded as its request finished found
    the tokenizer's tables out of the CPU caches (several times the cost of decodes in a row)."""
    built, stepping = [], []
    engine = llm.llm_engine  # LLMEngine builds the outputs (LLM wraps it)
    completion, step = engine.completion, engine.step
    monkeypatch.setattr(engine, "completion",
                        lambda req, i=0: (built.append((req.request_id, bool(stepping))), completion(req, i))[1])
    monkeypatch.setattr(engine, "step", lambda: (stepping.append(1), step(), stepping.clear())[1])
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([[5, 6, 7], [8, 9], [10, 11, 12, 13]], params)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert [rid for rid, _ in built] == [o.request_id for o in outs]  # once each, in the call's order
    assert not any(in_step for _, in_step in built), built


def test_token_views_slice_without_the_whole_sequence():
    from jaxmamba.engine.request import Request

    req = Request("r", [1, 2, 3], SamplingParams(), seed=0, arrival=0, output_token_ids=[4, 5])
    whole = req.all_token_ids
    view = req.token_view
    assert len(view) == 5 and list(view) == whole
    for start in range(6):
        for stop in range(start, 6):
            assert req.token_ids(start, stop) == whole[start:stop] == view[start:stop]
    assert view[-1] == 5 and view[3] == 4 and view[::2] == [1, 3, 5] and view[4:2] == []
    with pytest.raises(IndexError):
        view[5]
    req.output_token_ids.append(6)  # a view follows its request
    assert len(view) == 6 and view[5:] == [6]
    # Identity, not field-wise equality: two requests with equal fields are different requests.
    twin = Request("r", [1, 2, 3], SamplingParams(), seed=0, arrival=0, output_token_ids=[4, 5, 6])
    assert twin != req and req in [req] and twin not in [req]


def test_text_that_is_not_utf8_is_refused_alone(llm):
    """A lone surrogate once raised TypeError from the tokenizer for the whole call; now that prompt
    alone comes back with ``error`` set (and ``text == ""``, as vLLM's text is always a str) while the
    good one runs as it would alone."""
    outs = llm.generate(["caf\udce9", "ok"], GREEDY)
    assert outs[0].error is not None and "UTF-8" in outs[0].error
    assert outs[0].outputs[0].text == "" and outs[0].outputs[0].finish_reason == "error"
    assert outs[0].prompt == "caf\udce9"
    assert outs[1].error is None and outs[1].outputs[0].token_ids == llm.generate("ok", GREEDY)[0].outputs[0].token_ids
    with pytest.raises(RequestError, match="UTF-8"):
        llm.llm_engine.add_request("bad", {"prompt": "\ud800 x"}, GREEDY)
    llm.check_invariants()


def test_temperature_above_2_is_accepted_as_vllm_and_negative_refused(llm):
    hot = llm.generate([[5, 6, 7]], SamplingParams(temperature=3.5, seed=1, max_tokens=4, ignore_eos=True))[0]
    assert hot.error is None and len(hot.outputs[0].token_ids) == 4
    with pytest.raises(RequestError, match="temperature=-0.5 must be >= 0"):
        SamplingParams(temperature=-0.5)


def test_chat_and_get_tokenizer_as_vllm(llm):
    from jaxmamba.engine.chat import load_chat_template, render_chat

    assert llm.get_tokenizer() is llm.tokenizer and llm.get_tokenizer().encode("hi").ids
    template = load_chat_template(llm.checkpoint)
    plain = [{"role": "user", "content": "hi\nthere"}]
    parts = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]}]
    want = llm.generate(render_chat(template, plain), GREEDY)[0].outputs[0].text
    # One conversation, content as a string or as OpenAI's text parts; then a batch of two.
    assert [o.outputs[0].text for o in llm.chat(plain, GREEDY)] == [want]
    assert [o.outputs[0].text for o in llm.chat(parts, GREEDY)] == [want]
    batch = llm.chat([plain, [{"role": "user", "content": "other"}]], GREEDY)
    assert len(batch) == 2 and batch[0].outputs[0].text == want and batch[1].error is None
    with pytest.raises(RequestError, match=r"messages\[0\].content\[0\] has type 'image_url'"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], GREEDY)
    with pytest.raises(RequestError, match=r"messages\[0\].role"):
        llm.chat([{"content": "hi"}], GREEDY)
    # A surrogate inside a message: that conversation is refused alone, as in generate.
    bad = llm.chat([[{"role": "user", "content": "caf\udce9"}], plain], GREEDY)
    assert "UTF-8" in bad[0].error and bad[1].outputs[0].text == want
    llm.check_invariants()


def test_use_tqdm_as_vllm(llm, capsys):
    """``use_tqdm`` defaults to True (vLLM's); stderr here is no terminal, so no bar is drawn; a callable
    is the bar's class."""
    made = []

    class Bar:
        def __init__(self, total, **kwargs):
            made.append(self)
            self.total, self.n = total, 0

        def update(self, n):
            self.n += n

        def close(self):
            self.closed = True

    llm.generate([[1, 2], [3, 4, 5]], GREEDY)
    assert "Processed prompts" not in capsys.readouterr().err
    llm.generate([[1, 2], [3, 4, 5], [9]], GREEDY, use_tqdm=Bar)
    assert len(made) == 1 and made[0].total == 3 and made[0].n == 3 and made[0].closed
