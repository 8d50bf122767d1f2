"""Sampling, stopping and logprobs on hand-checked cases."""

from __future__ import annotations

import math

import pytest
import torch

from halfmoon.engine import SamplingParams
from halfmoon.engine.sampler import sample
from halfmoon.engine.sequence import Sequence


def _seq(**params) -> Sequence:
    seq = Sequence("r", [1], 1, SamplingParams(**params), 0.0)
    if seq.params.seed is not None:
        seq.generator = torch.Generator().manual_seed(seq.params.seed)
    return seq


def test_same_seed_same_output_and_different_seed_differs(tiny_llm):
    prompt = "Once upon a time"
    runs = [
        tiny_llm.generate([prompt], SamplingParams(max_tokens=24, temperature=1.0, seed=s))[
            0
        ].token_ids
        for s in (42, 42, 43)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_seeded_output_does_not_depend_on_batch_neighbours(tiny_llm):
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=5)
    alone = tiny_llm.generate(["abc"], params)[0].token_ids
    crowded = tiny_llm.generate(
        ["abc", "xyz", "hello"],
        [params, SamplingParams(max_tokens=20), SamplingParams(max_tokens=3)],
    )[0].token_ids
    assert alone == crowded


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.tensor([[0.1, 2.0, 1.9, -1.0], [3.0, 0.0, 2.9, 1.0]])
    for params in (dict(top_k=1), dict(top_p=1e-6), dict(min_p=0.999)):
        seqs = [_seq(temperature=1.0, **params), _seq(temperature=1.0, **params)]
        assert sample(logits, seqs).token_ids == [1, 0]


def test_top_k_never_samples_outside_the_k_best():
    logits = torch.tensor([[5.0, 4.9, 4.8, 0.0, 0.0, 0.0]]).repeat(400, 1)
    seqs = [_seq(temperature=5.0, top_k=2) for _ in range(400)]
    assert set(sample(logits, seqs).token_ids) == {0, 1}


def test_logprobs_are_log_softmax_with_top_n():
    logits = torch.tensor([[0.0, math.log(3.0), 0.0, 0.0]])
    out = sample(logits, [_seq(temperature=0.0, logprobs=2)]).logprobs[0]
    assert out.token_id == 1
    assert out.logprob == pytest.approx(math.log(0.5))
    assert out.top[0] == (1, pytest.approx(math.log(0.5)))
    assert out.top[1][1] == pytest.approx(math.log(1 / 6))


def test_sampling_reads_the_device_once_per_batch(monkeypatch):
    # On a GPU every read of a tensor's value waits for the step's kernels: the filters are
    # chosen from the parameters, and the tokens (and logprobs) come back in one copy each.
    reads = []
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda t: pytest.fail("bool() of a tensor"))
    original = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.append(t.shape) or original(t))
    logits = torch.randn(4, 50)
    mixed = [
        _seq(temperature=0.0, logprobs=3),
        _seq(temperature=0.7, top_k=5, seed=1),
        _seq(temperature=1.0, top_p=0.9, min_p=0.05, logprobs=0),
        _seq(temperature=1.0),
    ]
    out = sample(logits, mixed)
    assert len(reads) == 3, reads  # the tokens, the top ids, the logprob values
    assert out.logprobs[1] is None and len(out.logprobs[0].top) == 3 and not out.logprobs[2].top
    assert out.logprobs[0].token_id == out.token_ids[0] == int(logits[0].argmax())
    reads.clear()
    sample(logits, [_seq(temperature=0.5, top_k=3, min_p=0.1) for _ in range(4)])
    assert len(reads) == 1


def test_stop_string_truncates_text_and_finishes(tiny_llm):
    free = tiny_llm.generate(["stop test"], SamplingParams(max_tokens=30, temperature=0.0))[0]
    assert len(free.text) >= 6, free.text
    stop = free.text[3:5]
    cut = tiny_llm.generate(
        ["stop test"], SamplingParams(max_tokens=30, temperature=0.0, stop=[stop])
    )[0]
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]


def test_stop_token_id_finishes_and_max_tokens_is_length(tiny_llm):
    free = tiny_llm.generate(
        ["tokens"], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    )[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    target = free.token_ids[4]
    stopped = tiny_llm.generate(
        ["tokens"], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[target])
    )[0]
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(target) + 1]
