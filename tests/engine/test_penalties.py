"""Logit biases and repetition, frequency and presence penalties against transformers' own."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hf_reference import greedy_tokens, reference_model

from halfmoon.engine import InvalidRequestError, SamplingParams
from halfmoon.engine import penalties as penalties_module
from halfmoon.engine.penalties import apply_penalties
from halfmoon.engine.sampler import sample
from halfmoon.engine.sequence import Sequence

VOCAB = 64
NEW_TOKENS = 16
PROMPT = [40, 41, 42, 40, 41, 42, 40, 41, 42, 50, 51]


def _seq(token_ids: list[int], num_prompt_tokens: int, **params) -> Sequence:
    return Sequence("r", list(token_ids), num_prompt_tokens, SamplingParams(**params), 0.0)


def _openai_penalties(scores: torch.Tensor, generated: list[int], params: SamplingParams):
    """OpenAI's definition over the generated tokens (transformers has no processor for it)."""
    scores = scores.clone()
    for token_id, count in Counter(generated).items():
        scores[..., token_id] -= params.frequency_penalty * count + params.presence_penalty
    return scores


class OpenAIPenalties:
    """`_openai_penalties` as a transformers logits processor, for `generate`."""

    def __init__(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        self.params, self.num_prompt_tokens = params, num_prompt_tokens

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[0, self.num_prompt_tokens :].tolist()
        return _openai_penalties(scores, generated, self.params)


def _reference_row(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    from transformers import RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

    params, input_ids = seq.params, torch.tensor([seq.token_ids])
    scores = logits[None].clone()
    if params.logit_bias:
        bias = [[[token_id], value] for token_id, value in params.logit_bias.items()]
        scores = SequenceBiasLogitsProcessor(bias)(input_ids, scores)
    scores = RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))(input_ids, scores)
    return _openai_penalties(scores, seq.token_ids[seq.num_prompt_tokens :], params)[0]


def test_batch_mixing_penalties_matches_transformers_processors():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, VOCAB, generator=gen) * 4
    history = torch.randint(0, VOCAB, (7, 40), generator=gen).tolist()
    seqs = [
        _seq(history[0], 30),
        _seq(history[1], 25, repetition_penalty=1.7),
        _seq(history[2][:12], 4, frequency_penalty=0.8, presence_penalty=-0.5),
        _seq(history[3], 40, logit_bias={3: 7.5, 60: -100.0}),
        _seq(history[4][:33], 20, temperature=0.0, repetition_penalty=0.6, frequency_penalty=-2.0),
        _seq(history[5], 10, repetition_penalty=1.3, presence_penalty=2.0, logit_bias={9: 1.0}),
        _seq(history[6][:5], 5, frequency_penalty=1.0, repetition_penalty=1.2),
    ]
    out = apply_penalties(logits, seqs)
    for row, seq in enumerate(seqs):
        torch.testing.assert_close(out[row], _reference_row(logits[row], seq))
    assert torch.equal(out[0], logits[0])


def test_penalties_leave_the_model_logits_unchanged():
    logits = torch.randn(2, VOCAB)
    before = logits.clone()
    seqs = [_seq([1, 2, 2], 1, frequency_penalty=1.0), _seq([3], 1, logit_bias={3: 50.0})]
    assert not torch.equal(apply_penalties(logits, seqs), before)
    assert torch.equal(logits, before)


def test_a_batch_without_penalties_takes_the_fast_path(monkeypatch):
    for name in ("_add_bias", "_penalize_repeats", "_token_ids"):
        monkeypatch.setattr(
            penalties_module, name, lambda *a, name=name: pytest.fail(f"{name} ran")
        )
    logits = torch.randn(3, VOCAB)
    plain = [_seq([1, 1, 1], 2), _seq([5], 1, temperature=0.0), _seq([7, 7], 1, top_k=3)]
    assert apply_penalties(logits, plain) is logits
    assert len(sample(logits, plain).token_ids) == 3


def test_bias_alone_builds_no_token_counts(monkeypatch):
    monkeypatch.setattr(penalties_module, "_penalize_repeats", lambda *a: pytest.fail("counted"))
    logits = torch.zeros(2, VOCAB)
    out = apply_penalties(logits, [_seq([1], 1), _seq([1], 1, logit_bias={4: 2.5})])
    assert out[1, 4] == 2.5 and out.sum() == 2.5


def test_a_request_s_biases_become_arrays_once_and_a_step_adds_them_in_one_call(monkeypatch):
    seqs = [_seq([1], 1, logit_bias={i: 1.0 for i in range(300)}) for _ in range(4)]
    made = [seq.params.bias_arrays() for seq in seqs]
    calls = []
    original = torch.Tensor.index_put_
    monkeypatch.setattr(
        torch.Tensor, "index_put_", lambda t, *a, **k: calls.append(1) or original(t, *a, **k)
    )
    for _ in range(3):
        out = apply_penalties(torch.zeros(4, 512), seqs)
    assert [seq.params.bias_arrays() for seq in seqs] == made  # the same arrays, not rebuilt
    assert len(calls) == 3 and out.sum() == 4 * 300


def test_more_than_300_biases_are_refused_as_openai_refuses_them():
    SamplingParams(logit_bias={i: 1.0 for i in range(300)})
    with pytest.raises(InvalidRequestError, match="at most 300 entries") as raised:
        SamplingParams(logit_bias={i: 1.0 for i in range(301)})
    assert raised.value.field == "logit_bias"


def test_greedy_honours_biases_and_penalties_and_logprobs_stay_raw():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0], [0.0, 3.0, 2.0, 1.0], [0.0, 3.0, 2.0, 1.0]])
    seqs = [
        _seq([1], 1, temperature=0.0, repetition_penalty=2.0, logprobs=0),  # 3 / 2 < 2
        _seq([0], 1, temperature=0.0, logit_bias={1: -100.0}),
        _seq([0], 1, temperature=1.0, seed=3, logit_bias={3: 100.0}),
    ]
    out = sample(logits, seqs)
    assert out.token_ids == [2, 2, 3]
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[0].token_id == 2 and out.logprobs[0].logprob == pytest.approx(raw[2].item())


def test_penalties_read_the_device_once_per_batch(monkeypatch):
    reads = []
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: pytest.fail("bool() of a tensor"))
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or original(t))
    seqs = [
        _seq([1, 2, 2, 5], 2, temperature=0.0, repetition_penalty=1.5, logit_bias={7: 3.0}),
        _seq([4, 4], 1, temperature=0.8, frequency_penalty=0.5, presence_penalty=0.5),
        _seq([9], 1),
    ]
    sample(torch.randn(3, VOCAB), seqs)
    assert len(reads) == 1  # the tokens


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 2.5),
        ("frequency_penalty", float("nan")),
        ("presence_penalty", -2.01),
        ("presence_penalty", True),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", float("inf")),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"5": 1.0}),
        ("logit_bias", {5: 100.5}),
        ("logit_bias", {5: float("nan")}),
        ("logit_bias", [(5, 1.0)]),
    ],
)
def test_out_of_range_penalty_field_is_named(field, value):
    with pytest.raises(InvalidRequestError, match=field) as caught:
        SamplingParams(**{field: value})
    assert caught.value.field == field


def test_penalty_bounds_are_accepted():
    SamplingParams(frequency_penalty=-2.0, presence_penalty=2.0, repetition_penalty=5.0)
    SamplingParams(logit_bias={0: -100.0, 10**6: 100})


def test_logit_bias_beyond_the_vocabulary_is_refused_by_the_engine(tiny_llm):
    vocab_size = tiny_llm.engine.model_config.vocab_size
    params = SamplingParams(logit_bias={vocab_size: 1.0})
    with pytest.raises(InvalidRequestError, match=rf"logit_bias.*\[0, {vocab_size}\)"):
        tiny_llm.engine.add_request([5, 6], params)
    assert not tiny_llm.engine.has_unfinished_requests()


def _greedy(llm, prompt: list[int], **params) -> list[int]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, **params)
    return llm.generate([prompt], params)[0].token_ids


def _transformers_greedy(model_dir, prompt: list[int], params: SamplingParams) -> list[int]:
    bias = [[[token_id], value] for token_id, value in params.logit_bias.items()] or None
    return greedy_tokens(
        reference_model(model_dir),
        torch.tensor([prompt]),
        NEW_TOKENS,
        repetition_penalty=params.repetition_penalty,
        sequence_bias=bias,
        logits_processor=[OpenAIPenalties(params, len(prompt))],
    )


def test_greedy_repetition_penalty_equals_transformers_generate(tiny_llm, tiny_model_dir):
    plain = _greedy(tiny_llm, PROMPT)
    penalized = _greedy(tiny_llm, PROMPT, repetition_penalty=2.0)
    assert penalized != plain
    reference = _transformers_greedy(tiny_model_dir, PROMPT, SamplingParams(repetition_penalty=2.0))
    assert penalized == reference


def test_batch_of_mixed_penalties_equals_transformers_generate_per_request(
    tiny_llm, tiny_model_dir
):
    mixed = [
        SamplingParams(repetition_penalty=1.4, frequency_penalty=0.7, presence_penalty=0.4),
        SamplingParams(),
        SamplingParams(logit_bias={PROMPT[0]: 4.0, PROMPT[-1]: -3.0}, presence_penalty=1.5),
    ]
    prompts = [PROMPT, PROMPT[2:], PROMPT[1:]]
    batch = [
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, **_penalties(p))
        for p in mixed
    ]
    outputs = tiny_llm.generate(prompts, batch)
    for out, prompt, params in zip(outputs, prompts, mixed, strict=True):
        assert out.token_ids == _transformers_greedy(tiny_model_dir, prompt, params)


def _penalties(params: SamplingParams) -> dict:
    names = ("frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias")
    return {name: getattr(params, name) for name in names}


def test_migrated_sequence_counts_its_earlier_output_as_generated():
    # A migrated request is prefilled again with its output so far as prompt; its frequency
    # and presence penalties must still count that output.
    tokens, params = [5, 6, 7, 7, 8, 7], dict(frequency_penalty=0.9, presence_penalty=0.4)
    original = _seq(tokens, 3, repetition_penalty=1.3, **params)
    migrated = _seq(tokens, 5, repetition_penalty=1.3, **params)
    logits = torch.randn(1, VOCAB)
    assert not torch.equal(apply_penalties(logits, [migrated]), apply_penalties(logits, [original]))
    migrated.num_prior_output_tokens = 2
    assert torch.equal(apply_penalties(logits, [migrated]), apply_penalties(logits, [original]))


def test_decode_side_sequence_sees_the_prefill_token_as_generated(tiny_llm):
    # Disaggregated: the decode worker reserves the prompt and joins with the prefill worker's
    # first token; its penalties must count what a colocated sequence counts at that point.
    engine, prompt = tiny_llm.engine, [33, 34, 33, 35]  # under a block: no KV is cached
    params = SamplingParams(max_tokens=8, frequency_penalty=1.0, repetition_penalty=1.5)
    engine.reserve(prompt, params, "disagg")
    engine.join("disagg", 7)
    seq = engine.requests["disagg"]
    try:
        assert seq.token_ids == [*prompt, 7] and seq.num_prompt_tokens == len(prompt)
        colocated = _seq([*prompt, 7], len(prompt), **_penalties(params))
        logits = torch.randn(1, engine.model_config.vocab_size)
        assert torch.equal(apply_penalties(logits, [seq]), apply_penalties(logits, [colocated]))
    finally:
        engine.abort("disagg")
