"""The CUDA paths no fp32 test reaches: bf16 against transformers, seeded sampling, two engines
sizing their KV on one GPU, writes ordered by the reserve's fence, uploads and waits that
leave the host free, mixed prefill+decode steps in bf16, and graphs at production sizes.

Every test needs a GPU (`make test-gpu`); tests/ops/test_gpu_session.py rehearses the suite's
run on CPU, where these are collected and skipped."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import replace

import pytest
import torch

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.device_copy import device_tensor
from halfmoon.engine.init_model import SHAPES, ensure_model
from halfmoon.kvstore.layout import LayerKV

pytestmark = pytest.mark.gpu
# bf16 keeps 8 bits of mantissa: a logprob of a few units differs by up to ~0.1 between two
# correct implementations that round in another order.
LOGPROB_ATOL = 0.15
AGREEMENT = 0.95
SMALL_KV = dict(num_pages=256)  # never the whole GPU: each test sizes its own small pool
BUSY_CYCLES = 2_000_000_000  # torch.cuda._sleep: about a second of one GPU's clock


def _prompts(vocab: int, count: int = 8, seed: int = 5) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(rng.randrange(8, 120))] for _ in range(count)]


def greedy_agreement(model_dir: str, device: str, dtype: str, max_tokens: int = 16):
    """(share of our greedy tokens that transformers' argmax repeats given the same prefix,
    largest gap between our and its top-5 logprobs at the last prompt position)."""
    from transformers import AutoModelForCausalLM

    ours = LLM(model_dir, device=device, dtype=dtype, **SMALL_KV)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    prompts = _prompts(ours.engine.facts.vocab_size)
    agree = total = 0
    gap = 0.0
    for prompt, out in zip(prompts, ours.generate(prompts, params), strict=True):
        ids = torch.tensor([prompt + out.token_ids[:-1]], device=device)
        with torch.no_grad():
            logits = hf(ids).logits[0, len(prompt) - 1 :].float()
        theirs_ids = logits.argmax(-1).tolist()
        agree += sum(int(a == b) for a, b in zip(theirs_ids, out.token_ids, strict=True))
        total += len(out.token_ids)
        theirs = torch.log_softmax(logits[0], -1)
        gap = max(gap, *(abs(theirs[t].item() - lp) for t, lp in out.logprobs[0].top))
    return agree / total, gap


def test_bf16_engine_agrees_with_transformers_in_bf16(checkpoints):
    share, gap = greedy_agreement(str(checkpoints["llama"]), "cuda", "bfloat16")
    assert share >= AGREEMENT, f"{share:.1%} of greedy tokens agree"
    assert gap <= LOGPROB_ATOL, f"top-5 logprobs at the last prompt position differ by {gap:.3f}"


def test_seeded_sampling_reproduces_on_cuda(checkpoints):
    llm = LLM(str(checkpoints["llama"]), device="cuda", dtype="bfloat16", **SMALL_KV)
    prompts = _prompts(llm.engine.facts.vocab_size, count=4)

    def sampled(seed: int) -> list[list[int]]:
        params = SamplingParams(
            max_tokens=12,
            temperature=0.9,
            top_k=50,
            top_p=0.9,
            min_p=0.02,
            seed=seed,
            logprobs=2,
            ignore_eos=True,
        )
        return [out.token_ids for out in llm.generate(prompts, params)]

    first = sampled(7)
    assert sampled(7) == first
    assert sampled(8) != first


def test_two_engines_on_one_gpu_size_their_kv_within_their_share(checkpoints):
    # What two workers with num_gpus 0.3 each get (launcher: utilization x share).
    total = torch.cuda.mem_get_info()[1]
    share = 0.9 * 0.3
    engines = [
        LLM(str(checkpoints["llama"]), device="cuda", gpu_memory_utilization=share).engine
        for _ in range(2)
    ]
    for engine in engines:
        kv_cache = engine.kv_cache
        kv_bytes = engine.num_pages * kv_cache.page_layer_bytes * kv_cache.num_layers
        assert kv_bytes <= share * total
    # What this process took (weights, pools, activations), not the GPU's free memory: other
    # processes share the GPU (the suite runs its files side by side on it).
    assert torch.cuda.memory_reserved() <= 2 * share * total


def test_a_write_after_a_reserve_waits_for_its_fence_not_for_later_steps(tiny_model_dir):
    kv = LLM(str(tiny_model_dir), device="cuda", **SMALL_KV).engine.kv_cache
    fence = kv.mark()  # just after a reserve: the pages' last readers are before it
    torch.cuda._sleep(BUSY_CYCLES)  # a step queued after the reserve
    shape = (2, *kv.page_shape[1:])
    ones = LayerKV(torch.ones(shape), torch.ones(shape))
    written = kv.write_layer(0, [3, 4], ones, ordered=False, after=fence)
    written.wait()
    assert not torch.cuda.current_stream().query(), "the write waited for the later step"
    torch.cuda.synchronize()
    assert kv.layers[0][0][3].float().mean().item() == 1.0


def test_a_page_index_upload_returns_while_the_gpu_is_busy():
    torch.cuda._sleep(BUSY_CYCLES)
    started = time.perf_counter()
    index = device_tensor(list(range(64)), torch.device("cuda"), torch.int64)
    assert time.perf_counter() - started < 0.05
    torch.cuda.synchronize()
    assert index.tolist() == list(range(64))


def test_a_thread_waiting_on_a_kv_event_sleeps_instead_of_spinning(tiny_model_dir):
    kv = LLM(str(tiny_model_dir), device="cuda", **SMALL_KV).engine.kv_cache
    torch.cuda._sleep(BUSY_CYCLES)
    event, cpu_s = kv.mark(), []

    def wait() -> None:
        started = time.thread_time()
        event.synchronize()
        cpu_s.append(time.thread_time() - started)

    waiter = threading.Thread(target=wait)
    waiter.start()
    waiter.join()
    assert cpu_s[0] < 0.2, f"the waiting thread used {cpu_s[0]:.2f} s of CPU"


def test_mixed_prefill_and_decode_steps_in_bf16_give_the_one_at_a_time_tokens(checkpoints):
    args = dict(device="cuda", dtype="bfloat16", prefill_chunk_size=32, **SMALL_KV)
    model_dir = str(checkpoints["llama"])
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = LLM(model_dir, **args)
    prompts = _prompts(alone.engine.facts.vocab_size)
    expected = [alone.generate([p], params)[0].token_ids for p in prompts]
    mixed = LLM(model_dir, **args)
    got = [out.token_ids for out in mixed.generate(prompts, params)]
    steps = list(mixed.engine.step_log)
    assert any(step.prefill_chunks and step.decode_seqs for step in steps), "no mixed step ran"
    pairs = [(a, b) for x, y in zip(got, expected, strict=True) for a, b in zip(x, y, strict=True)]
    assert sum(a == b for a, b in pairs) / len(pairs) >= AGREEMENT


@pytest.mark.timeout(300)
def test_decode_graphs_capture_at_production_sizes(tmp_path):
    # The serving engine's batch (deploy/configs/gpu-cluster.yaml: 256 sequences) and a 32k
    # context: graphs per batch bucket and per context bucket (split-K sized per bucket).
    shape = replace(SHAPES["tiny"], max_position_embeddings=32768)
    model_dir = str(ensure_model(tmp_path / "tiny-32k", shape))
    args = dict(device="cuda", dtype="bfloat16", max_num_seqs=256, num_pages=4096)
    started = time.perf_counter()
    graphed = LLM(model_dir, **args)
    print(f"start-up with graph capture: {time.perf_counter() - started:.1f} s")
    graphs = graphed.engine.decode_graphs
    assert len(graphs.graphs) == len(graphs.buckets) * len(graphs.widths)
    assert len(graphs.widths) > 1
    eager = LLM(model_dir, enforce_eager=True, **args)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = _prompts(graphed.engine.facts.vocab_size, count=3)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == [
        o.token_ids for o in eager.generate(prompts, params)
    ]
