"""The start-up warm-up runs every batch and context size, then leaves the engine as new."""

from __future__ import annotations

import pytest

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.warmup import _doubling, warm_up

ENGINE_ARGS = dict(block_size=16, num_pages=80, max_num_batched_tokens=256, max_num_seqs=5)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_doubling_sizes_end_at_the_limit():
    assert _doubling(1, 5) == [1, 2, 4, 5]
    assert _doubling(256, 600) == [256, 512, 600]
    assert _doubling(256, 100) == []


def test_warm_up_leaves_the_engine_idle_with_counters_at_zero(checkpoints):
    llm = LLM(str(checkpoints["llama"]), **ENGINE_ARGS)
    engine = llm.engine
    sizes = []
    original = engine.runner.run

    def run(batch, hooks=None):
        sizes.append((len(batch), max(item.seq.num_computed_tokens for item in batch)))
        return original(batch, hooks)

    engine.runner.run = run
    assert warm_up(engine) > 0
    assert {1, 2, 4, 5} <= {n for n, _ in sizes}, "every batch size up to max_num_seqs ran"
    assert max(context for _, context in sizes) >= 512, "contexts doubled from 256"
    assert not engine.has_unfinished_requests() and not engine.requests
    assert engine.stats().num_used_pages == 0
    stats = engine.stats()
    assert stats.num_steps == stats.num_generated_tokens == stats.num_prompt_tokens_computed == 0
    assert not engine.step_log

    prompt = list(range(10, 60))
    fresh = LLM(str(checkpoints["llama"]), **ENGINE_ARGS)
    assert llm.generate(prompt, PARAMS)[0].token_ids == fresh.generate(prompt, PARAMS)[0].token_ids


def test_warm_up_prefills_over_a_cached_prefix_with_every_count_of_runs(checkpoints):
    # The paged prefill kernel is specialised by its number of runs (a power-of-two tile of
    # them, and a count of 1): a step of several runs over cached prefixes compiled it anew
    # after start-up until the warm-up ran such steps too.
    engine = LLM(str(checkpoints["llama"]), **ENGINE_ARGS).engine
    counts = set()
    original = engine.runner.run

    def run(batch, hooks=None):
        runs = [item for item in batch if item.num_new_tokens > 1]
        if any(item.seq.num_computed_tokens for item in runs):
            counts.add(len(runs))
        return original(batch, hooks)

    engine.runner.run = run
    warm_up(engine)
    assert {1, 2, 4, 5} <= counts


@pytest.mark.gpu
def test_no_kernel_compiles_after_a_cuda_engine_is_ready(checkpoints):
    from halfmoon.kernels import triton_cache, triton_decode, triton_norm, triton_prefill

    kernels = [
        triton_cache._store_kv_kernel,
        triton_decode._decode_split_kernel,
        triton_decode._decode_reduce_kernel,
        triton_norm._rms_norm_kernel,
        triton_norm._rotary_kernel,
        triton_prefill._prefill_kernel,
    ]

    def compiled() -> int:
        total = 0
        for kernel in kernels:
            caches = getattr(kernel, "device_caches", None)
            if caches is not None:
                total += sum(len(entry[0]) for entry in caches.values())
            else:
                total += sum(len(cache) for cache in kernel.cache.values())
        return total

    llm = LLM(str(checkpoints["llama"]), device="cuda", dtype="float32", **ENGINE_ARGS)
    before = compiled()
    vocab = llm.engine.facts.vocab_size  # 262: ids wrap to stay inside it
    prompts = [[10 + i % (vocab - 10) for i in range(n)] for n in (3, 40, 17, 300, 90)]
    llm.generate(prompts, PARAMS)
    llm.generate(prompts[:2], PARAMS)
    assert compiled() == before
