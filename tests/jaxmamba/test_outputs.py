"""Incremental detokenization (``engine.outputs``): a streaming request's text (and the text its stop strings
are sought in), decoded a few tokens a step, equals the whole output decoded at every length."""

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from jaxmamba.engine.outputs import output_text, running_text
from jaxmamba.engine.request import Request, SamplingParams
from jaxmamba.random_checkpoint import _tokenizer_json


def _byte_level() -> Tokenizer:
    return Tokenizer.from_str(_tokenizer_json(512))


def _metaspace() -> Tokenizer:
    """SentencePiece-like: a word's first piece carries the space (``▁``), which the decoder drops at the
    start of a text only: the left context decides whether a token starts with a space."""
    words = ["▁the", "▁cat", "s", "▁sat", "▁on", "▁a", "▁mat", ".", "▁é", "t", "é"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return tok


@pytest.mark.parametrize("make_tokenizer", [_byte_level, _metaspace])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_is_the_whole_decode_at_every_length(make_tokenizer, skip_special_tokens):
    tok = make_tokenizer()
    rng = np.random.default_rng(0)
    for trial in range(20):
        req = Request("r", [1], SamplingParams(skip_special_tokens=skip_special_tokens), seed=0, arrival=0)
        ids = rng.integers(0, tok.get_vocab_size(), int(rng.integers(1, 60))).tolist()
        n = 0
        while n < len(ids):
            n = min(len(ids), n + int(rng.integers(1, 4)))  # a step appends one token, a window or drafts more
            req.output_token_ids[:] = ids[:n]
            want = tok.decode(ids[:n], skip_special_tokens=skip_special_tokens)
            assert running_text(tok, req) == want, (trial, n)  # stop strings are sought in this
            assert output_text(tok, req, final=False) == want.rstrip("\ufffd"), (trial, n)
            assert output_text(tok, req, final=True) == want
        assert req.text_state is not None and req.text_state.prefix >= 0  # it stayed incremental


def test_streamed_text_decodes_each_step_only_its_new_tokens():
    tok = _byte_level()
    calls: list[int] = []

    class Counting:
        def decode(self, ids, skip_special_tokens):
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens=skip_special_tokens)

    req = Request("r", [1], SamplingParams(), seed=0, arrival=0)
    for token in np.random.default_rng(1).integers(3, 300, 400).tolist():
        req.output_token_ids.append(token)
        output_text(Counting(), req, final=False)
    assert max(calls) < 16  # windows of a few tokens, never the whole output
