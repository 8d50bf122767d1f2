"""The start-up warm-up runs every batch and context size, then leaves the engine as new."""

from __future__ import annotations

import dataclasses
import threading

import pytest
import torch

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.async_engine import AsyncEngine
from halfmoon.engine.grammar import warm_mask_kernel
from halfmoon.engine.outputs import StepTiming
from halfmoon.engine.structured_output import StructuredOutput
from halfmoon.engine.warmup import SAMPLED, _doubling, warm_up, warm_up_step_thread

ENGINE_ARGS = dict(block_size=16, num_pages=80, max_num_batched_tokens=256, max_num_seqs=5)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def test_doubling_sizes_end_at_the_limit():
    assert _doubling(1, 5) == [1, 2, 4, 5]
    assert _doubling(256, 600) == [256, 512, 600]
    assert _doubling(256, 100) == []


def test_the_mask_warm_up_runs_every_kind_of_row_count_on_this_device():
    # On CUDA each count is another Triton specialisation (the GPU test below checks none is
    # compiled later); here, the CPU path of the same call, for 1, 2 and 16 rows and fewer.
    warm_mask_kernel(torch.device("cpu"), vocab_size=300, max_rows=5)
    warm_mask_kernel(torch.device("cpu"), vocab_size=49_152, max_rows=256)


def test_warm_up_leaves_the_engine_idle_with_counters_at_zero(checkpoints):
    llm = LLM(str(checkpoints["llama"]), **ENGINE_ARGS)
    engine = llm.engine
    steps = _record_steps(engine)
    assert warm_up(engine) > 0
    sizes = {len(step.prefill_chunks) + step.decode_seqs for step in steps}
    assert {1, 2, 4, 5} <= sizes, "every batch size up to max_num_seqs ran"
    contexts = [new + cached for step in steps for new, cached in step.prefill_chunks]
    assert max(contexts) >= 512, "contexts doubled from 256"
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
    steps = _record_steps(engine)
    warm_up(engine)
    counts = set()
    for step in steps:
        runs = [(new, cached) for new, cached in step.prefill_chunks if new > 1]
        if any(cached for _, cached in runs):
            counts.add(len(runs))
    assert {1, 2, 4, 5} <= counts


def _record_steps(engine) -> list[StepTiming]:
    """What each step the engine runs from now on computed, as its step log says (the warm-up
    clears the log once done)."""
    steps, step = [], engine.step

    def recorded():
        last = engine.step_log[-1] if engine.step_log else None
        outputs = step()
        if engine.step_log and engine.step_log[-1] is not last:
            steps.append(engine.step_log[-1])
        return outputs

    engine.step = recorded
    return steps


def _record_params(engine) -> list[SamplingParams]:
    seen, original = [], engine.add_request

    def add_request(prompt, params=None, *args, **kwargs):
        seen.append(params)
        return original(prompt, params, *args, **kwargs)

    engine.add_request = add_request
    return seen


def test_warm_up_also_samples_a_seeded_request_with_every_filter(checkpoints):
    engine = LLM(str(checkpoints["llama"]), **ENGINE_ARGS).engine
    seen = _record_params(engine)
    warm_up(engine)
    assert SAMPLED in seen and any(p.greedy for p in seen)
    assert SAMPLED.seed is not None and SAMPLED.temperature > 0 and SAMPLED.logprobs
    assert SAMPLED.top_p < 1 and SAMPLED.top_k > 0 and SAMPLED.min_p > 0


def test_the_step_threads_warm_up_runs_on_it_and_leaves_no_trace(checkpoints):
    engine = LLM(str(checkpoints["llama"]), **ENGINE_ARGS).engine
    seen, ran_on, done = _record_params(engine), [], threading.Event()

    def on_step_thread(engine) -> None:
        ran_on.append(threading.current_thread().name)
        warm_up_step_thread(engine)
        done.set()

    engine.on_step_thread.append(on_step_thread)  # as warm_up_cuda leaves it on a GPU
    engine.record_page_events()  # as a worker does: the router's prefix index reads them
    front = AsyncEngine(engine)
    try:
        assert done.wait(60)
        front.call(lambda e: None)  # after the warm-up's call: what it left is published
        stats, _ = front.stats()
        events = front.take_page_events()
    finally:
        front.shutdown()
    assert ran_on == ["engine-step"] and not engine.on_step_thread
    assert events == [], "the warm-up's random prompts are not news for the router"
    assert SAMPLED in seen and any(p.greedy for p in seen)
    assert stats.num_steps == stats.num_generated_tokens == stats.num_used_pages == 0


@pytest.mark.gpu
def test_no_kernel_compiles_after_a_cuda_engine_is_ready(checkpoints):
    from xgrammar.kernels.apply_token_bitmask_inplace_triton import (
        apply_token_bitmask_inplace_kernel,
    )

    from halfmoon.kernels import triton_cache, triton_decode, triton_norm, triton_prefill

    kernels = [
        apply_token_bitmask_inplace_kernel,  # xgrammar's mask, warmed too
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
    structured = dataclasses.replace(PARAMS, structured_output=StructuredOutput("regex", "[ab]+"))
    llm.generate(prompts[:1], structured)  # one masked row, then two
    llm.generate(prompts[:2], structured)
    assert compiled() == before
