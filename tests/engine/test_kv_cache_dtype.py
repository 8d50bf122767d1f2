"""The engine with its KV cache in 8 bits (`kv_cache_dtype`): the same memory holds about twice
the pages, blocks of two formats never share a key, prefixes cached quantized are reused, and
greedy tokens stay those of the unquantized engine (on the real SmolLM2 model, where logits
are not the near-ties of random weights)."""

from __future__ import annotations

import pytest
import torch

from halfmoon.bench.probes import agreement
from halfmoon.engine import LLM, SamplingParams
from halfmoon.kernels.kv_quant import SCALE_BYTES

pytestmark = pytest.mark.timeout(600)

FORMATS = ("int8", "fp8", "fp8_e5m2")
STORAGE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("kv", FORMATS)
def test_pages_hold_quantized_rows_and_twice_as_many_fit(tiny_model_dir, kv):
    budget = 4 << 20
    plain = LLM(str(tiny_model_dir), kv_cache_memory_bytes=budget, dtype="float32")
    small = LLM(str(tiny_model_dir), kv_cache_memory_bytes=budget, kv_cache_dtype=kv)
    cache = small.engine.kv_cache
    assert cache.dtype == STORAGE[kv]
    assert cache.page_shape[-1] == plain.engine.kv_cache.page_shape[-1] + SCALE_BYTES
    head_dim = plain.engine.model_config.head_dim  # 32: rows of 34 bytes against 128 in fp32
    assert cache.page_layer_bytes / plain.engine.kv_cache.page_layer_bytes == pytest.approx(
        (head_dim + SCALE_BYTES) / (4 * head_dim)
    )
    assert small.engine.num_pages // plain.engine.num_pages == (4 * head_dim) // (head_dim + 2)
    assert cache.layout.block_bytes == cache.page_layer_bytes * cache.num_layers
    # Blocks are keyed by the KV format too: never shared between formats.
    assert small.engine.root_key != plain.engine.root_key


def test_blocks_are_keyed_by_the_kv_format_fp8_being_e4m3(tiny_model_dir):
    def root(kv: str) -> bytes:
        return LLM(str(tiny_model_dir), num_pages=8, kv_cache_dtype=kv).engine.root_key

    keys = {kv: root(kv) for kv in ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")}
    assert keys["fp8"] == keys["fp8_e4m3"]
    assert len(set(keys.values())) == 4


def test_a_prefix_cached_quantized_is_reused_and_gives_the_same_tokens(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), kv_cache_dtype="int8", num_pages=64)
    prompt = list(range(5, 5 + 40))  # two full blocks and a part
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 32
    assert again.token_ids == first.token_ids
    # Chunked prefill reads the quantized chunks before it: the same tokens as in one go.
    chunked = LLM(
        str(tiny_model_dir), kv_cache_dtype="int8", num_pages=64, prefill_chunk_size=16
    ).generate([prompt], GREEDY)[0]
    assert chunked.token_ids == first.token_ids


@pytest.fixture(scope="module")
def chat_prompts(smollm2_dir):
    """The first 12 chat turns of `bench agreement` (the 9th: "Write one sentence about
    Paris.")."""
    from transformers import AutoTokenizer

    return agreement.chat_prompts(AutoTokenizer.from_pretrained(str(smollm2_dir)), 12)


@pytest.fixture(scope="module")
def unquantized(smollm2_dir, chat_prompts):
    """The engine with bf16 KV: each prompt's greedy continuation."""
    llm = LLM(str(smollm2_dir), dtype="bfloat16", num_pages=96, enable_prefix_caching=False)
    return [out.token_ids for out in llm.generate(chat_prompts, GREEDY)]


@pytest.mark.parametrize("kv", FORMATS)
def test_a_real_model_keeps_its_greedy_tokens_with_8_bit_kv(
    smollm2_dir, chat_prompts, unquantized, kv
):
    """Teacher-forced, as `bench agreement` counts: at each position of the bf16-KV engine's
    continuation, the 8-bit engine's next greedy token after the same prefix (read from its
    quantized prefix cache). Free-running text departs at a first near-tie and never rejoins."""
    llm = LLM(str(smollm2_dir), dtype="bfloat16", num_pages=256, kv_cache_dtype=kv)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    equal = positions = 0
    for prompt, continuation in zip(chat_prompts, unquantized, strict=True):
        prefixes = [prompt + continuation[:k] for k in range(len(continuation))]
        picks = [out.token_ids[0] for out in llm.generate(prefixes, one)]
        equal += sum(a == b for a, b in zip(picks, continuation, strict=True))
        positions += len(continuation)
    assert equal / positions >= 0.9
    answer = llm.generate(chat_prompts[8:9], GREEDY)[0]
    assert "Paris" in llm.tokenizer.decode(answer.token_ids)
