"""Greedy output and logits of our engine equal transformers' for every architecture."""

from __future__ import annotations

import random

import pytest
import torch
from hf_reference import greedy_tokens, reference_model
from isa_testkit import RUNNABLE, variant

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.sampler import sample as sample_tokens
from halfmoon.kernels import cpu_attention, cpu_elementwise, cpu_gemm

PROMPT_LENGTHS = [1, 7, 16, 17, 45, 128, 250, 300]
NEW_TOKENS = 12
# A page pool small enough that the prompts preempt each other, and chunked prefill.
ENGINE_ARGS = dict(block_size=16, num_pages=24, max_num_batched_tokens=96, max_num_seqs=8)


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(6, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def _reference(model_dir, prompts, device="cpu", dtype=torch.float32):
    model = reference_model(model_dir, device, dtype)
    tokens, logits = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.no_grad():
            logits.append(model(ids).logits[0, -1])
        tokens.append(greedy_tokens(model, ids, NEW_TOKENS))
    return tokens, logits


def _capture_first_logits(monkeypatch) -> dict[str, torch.Tensor]:
    """The logits each request's first token is sampled from, by request id."""
    captured: dict[str, torch.Tensor] = {}

    def sample(logits, seqs):
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens == 0 and seq.request_id not in captured:
                captured[seq.request_id] = logits[row].clone()
        return sample_tokens(logits, seqs)

    monkeypatch.setattr("halfmoon.engine.llm_engine.sample", sample)
    return captured


@pytest.mark.parametrize(
    "arch",
    ["llama", "llama3-rope", "mistral", "qwen2", "qwen3", "llama-sharded"]
    + ["mixtral", "qwen2-moe", "qwen3-moe"],
)
def test_greedy_tokens_and_logits_match_transformers_with_chunking_and_preemption(
    checkpoints, arch, monkeypatch
):
    model_dir = checkpoints[arch]
    llm = LLM(str(model_dir), **ENGINE_ARGS)
    prompts = _prompts(llm.engine.facts.vocab_size)
    captured = _capture_first_logits(monkeypatch)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    expected_tokens, expected_logits = _reference(model_dir, prompts)
    assert [o.token_ids for o in outputs] == expected_tokens
    assert llm.engine.stats().num_preemptions > 0, "the page pool should be small enough to preempt"
    for out, ref in zip(outputs, expected_logits, strict=True):
        torch.testing.assert_close(captured[out.request_id], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("isa", RUNNABLE)
def test_greedy_tokens_match_transformers_on_every_cpu_variant(checkpoints, isa, dtype):
    """What an AVX2 (or older) CPU runs, tested on this one: each kernel variant it can
    execute, fp32 and bf16 (the bf16 reference is transformers in bf16)."""
    model_dir = checkpoints["llama"]
    kernels = (cpu_attention.LIBRARY, cpu_elementwise.LIBRARY, cpu_gemm.LIBRARY)
    with variant(isa, *kernels):
        llm = LLM(str(model_dir), dtype=str(dtype).removeprefix("torch."), **ENGINE_ARGS)
        prompts = _prompts(llm.engine.facts.vocab_size)
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate(prompts, params)
    expected_tokens, _ = _reference(model_dir, prompts, dtype=dtype)
    tokens = [o.token_ids for o in outputs]
    if dtype == torch.float32:
        assert tokens == expected_tokens
        return
    # bf16 rounds every op's result: two correct engines part at near-ties (here one prompt of
    # eight, at its fourth token, on every variant and in torch's own ops alone).
    assert [t[0] for t in tokens] == [t[0] for t in expected_tokens]
    pairs = zip(sum(tokens, []), sum(expected_tokens, []), strict=True)
    agreeing = sum(a == b for a, b in pairs)
    assert agreeing >= 0.9 * NEW_TOKENS * len(prompts)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2-moe", "qwen3-moe"])
def test_greedy_tokens_on_cuda_in_fp32_match_transformers_on_cuda(checkpoints, arch):
    model_dir = checkpoints[arch]
    llm = LLM(str(model_dir), device="cuda", dtype="float32", **ENGINE_ARGS)
    prompts = _prompts(llm.engine.facts.vocab_size)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    expected_tokens, _ = _reference(model_dir, prompts, device="cuda")
    assert [o.token_ids for o in outputs] == expected_tokens
