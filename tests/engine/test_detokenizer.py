"""Streamed text, token by token, spells what decoding the whole output at once spells."""

from __future__ import annotations

import random

import pytest

from halfmoon.engine.detokenizer import MAX_HELD_TOKENS, TextDecoder, append_text, flush_text
from halfmoon.engine.init_model import build_tokenizer
from halfmoon.engine.sampling_params import SamplingParams
from halfmoon.engine.sequence import Sequence

PROMPT = [5, 6, 7]


def _metaspace_tokenizer():
    """A sentencepiece-style tokenizer: the decoder drops the first token's leading space, so
    a token's text depends on what comes before it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["▁Hello", "▁world", "▁wide", "!", "▁", "o", "l"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Metaspace()
    core.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def _decoder(tokenizer, byte_level: bool = True) -> TextDecoder:
    decode = TextDecoder(tokenizer)
    if not byte_level:
        decode.token_bytes = None  # the general path, which every tokenizer can take
    return decode


def _stream(tokenizer, output: list[int], byte_level: bool = True) -> tuple[str, Sequence]:
    """Feed `output` one token at a time, as the engine does; the deltas and a final flush."""
    decode = _decoder(tokenizer, byte_level)
    seq = Sequence("r", list(PROMPT), len(PROMPT), SamplingParams(), 0.0)
    text = ""
    for token in output:
        seq.token_ids.append(token)
        text += append_text(decode, seq)
    text += flush_text(decode, seq)
    assert seq.text == text
    return text, seq


def test_byte_level_tokenizers_take_the_byte_table():
    assert TextDecoder(build_tokenizer()).token_bytes is not None
    assert TextDecoder(_metaspace_tokenizer()).token_bytes is None


@pytest.mark.parametrize(
    "build, byte_level",
    [(build_tokenizer, True), (build_tokenizer, False), (_metaspace_tokenizer, False)],
    ids=["byte-table", "byte-level-general", "metaspace"],
)
def test_streamed_text_equals_the_whole_decode(build, byte_level):
    tokenizer = build()
    rng = random.Random(0)
    specials = tokenizer.all_special_ids
    samples = [
        tokenizer.encode(
            "Hello world! héllo wörld, 日本語 🙂 wide world", add_special_tokens=False
        ),
        [rng.randrange(len(tokenizer)) for _ in range(200)],  # broken UTF-8 and specials
    ]
    # Specials in the middle of text: skipped, and the window around them stays right.
    samples.append(samples[0][:5] + specials + samples[0][5:] + specials)
    # Ids past the tokenizer's vocabulary (a model's padded embeddings) spell nothing.
    samples.append(samples[0][:3] + [len(tokenizer) + 5] + samples[0][3:])
    for output in samples:
        expected = tokenizer.decode(output, skip_special_tokens=True)
        assert _stream(tokenizer, output, byte_level)[0] == expected


def test_the_fast_decoder_spells_what_transformers_decode_spells():
    rng = random.Random(1)
    for tokenizer in (build_tokenizer(), _metaspace_tokenizer()):
        decode = TextDecoder(tokenizer)
        for _ in range(50):
            ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(0, 12))]
            assert decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_tokenizers_that_clean_up_spaces_keep_the_transformers_path():
    tokenizer = build_tokenizer()
    tokenizer.clean_up_tokenization_spaces = True
    calls = []
    original = tokenizer.decode
    tokenizer.decode = lambda ids, **kw: calls.append(ids) or original(ids, **kw)
    ids = tokenizer.encode("hi", add_special_tokens=False)
    assert TextDecoder(tokenizer)(ids) == "hi"
    assert calls == [ids]


def test_a_run_of_special_tokens_does_not_grow_the_decode_window():
    # Every token decodes the window from `prefix_offset`: if nothing moved it, a model that
    # emits special tokens (skipped) would decode its whole output again at every token.
    tokenizer = build_tokenizer()
    text, seq = _stream(tokenizer, [tokenizer.pad_token_id] * 300, byte_level=False)
    assert text == ""
    assert seq.prefix_offset == seq.read_offset == 300


def test_a_stream_that_never_completes_a_character_is_not_held_forever():
    # The second byte of "é" alone is a UTF-8 continuation byte: every window ends in U+FFFD.
    tokenizer = build_tokenizer()
    continuation = tokenizer.encode("é", add_special_tokens=False)[1]
    decode = _decoder(tokenizer, byte_level=False)
    seq = Sequence("r", list(PROMPT), len(PROMPT), SamplingParams(), 0.0)
    emitted = []
    for _ in range(3 * MAX_HELD_TOKENS):
        seq.token_ids.append(continuation)
        emitted.append(append_text(decode, seq))
    assert any(emitted), "text went out once MAX_HELD_TOKENS tokens were held"
    assert seq.num_output_tokens - seq.prefix_offset <= 2 * MAX_HELD_TOKENS + 1


def test_a_byte_table_that_misspells_a_token_is_not_used(monkeypatch):
    from halfmoon.engine import detokenizer

    right = detokenizer._byte_to_char()
    wrong = {byte: right[(byte + 1) % 256] for byte in right}
    monkeypatch.setattr(detokenizer, "_byte_to_char", lambda: wrong)
    assert TextDecoder(build_tokenizer()).token_bytes is None
