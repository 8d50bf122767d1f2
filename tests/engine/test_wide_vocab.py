"""A real vocabulary's width (Qwen2's 151,936 rows, most of them ids no token maps to, as in real
checkpoints) through every sampler path at once: a grammar, penalties with `logit_bias`, `n` > 1
forks with top-k/top-p, greedy; on CUDA, the step's transient sampler memory stays inside what
the KV budget leaves for it (issue 51)."""

from __future__ import annotations

import re

import pytest
import torch

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.init_model import SHAPES, init_model
from halfmoon.engine.kv_sizing import activation_bytes
from halfmoon.engine.model_config import load_model_config
from halfmoon.engine.structured_output import StructuredOutput

PROMPTS = ["hello there", "count: 1 2 3", "abc", "xyz"]
BIASED = 70  # "a" in the byte-level tokenizer
PARAMS = [
    SamplingParams(
        max_tokens=8, temperature=0.0, structured_output=StructuredOutput("regex", "[ab]+c")
    ),
    SamplingParams(
        max_tokens=8,
        temperature=0.0,
        presence_penalty=1.0,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        logit_bias={BIASED: 100.0},
        ignore_eos=True,
    ),
    SamplingParams(
        max_tokens=8, temperature=0.9, top_k=50, top_p=0.9, n=2, seed=3, ignore_eos=True
    ),
    SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
]


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    return init_model(tmp_path_factory.mktemp("models") / "wide-vocab", SHAPES["wide-vocab"])


def _check(outputs, vocab_size: int) -> None:
    grammar, biased, first, second, greedy = outputs
    assert re.fullmatch(r"[ab]*c?", grammar.text) and grammar.token_ids
    assert biased.token_ids == [BIASED] * 8  # the bias outweighs every penalty
    assert (first.index, second.index) == (0, 1) and len(second.token_ids) == 8
    assert all(0 <= t < vocab_size for out in outputs for t in out.token_ids)
    assert len(greedy.token_ids) == 8


@pytest.mark.timeout(300)
def test_every_sampler_path_runs_at_a_real_vocabulary_width(wide_model):
    llm = LLM(str(wide_model), max_num_seqs=8)
    assert llm.engine.facts.vocab_size == 151_936
    outputs = llm.generate(PROMPTS, PARAMS)
    _check(outputs, 151_936)
    # Ids past the tokenizer's (no token maps to them) decode to nothing rather than failing.
    assert any(t >= 262 for t in outputs[4].token_ids)


@pytest.mark.gpu
@pytest.mark.timeout(600)
def test_on_cuda_the_samplers_transient_memory_fits_what_the_budget_leaves(wide_model):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run `make test-gpu` on a GPU host)")
    max_seqs, max_tokens = 64, 512
    llm = LLM(
        str(wide_model),
        device="cuda",
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max_tokens,
        kv_cache_memory_bytes=1 << 30,
        enforce_eager=True,
    )
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    repeats = max_seqs // len(PROMPTS)  # a full batch of sampled rows, every path in it
    outputs = llm.generate(PROMPTS * repeats, PARAMS * repeats)
    torch.cuda.synchronize()
    transient = torch.cuda.max_memory_allocated() - before
    budget = activation_bytes(load_model_config(wide_model), max_tokens, max_seqs)
    print(f"\nsampler + step transient {transient / 2**20:.0f} MiB of {budget / 2**20:.0f} MiB")
    _check(outputs[: len(PROMPTS) + 1], 151_936)
    assert transient <= budget
