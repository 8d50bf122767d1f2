"""Decode steps through the static, padded graph buffers give the eager engine's tokens.

On CPU the padded buffers run eagerly (`capture=False`), which checks the padding and the
buffer copies; on a GPU the suite also checks captured CUDA graphs against eager mode.
"""

from __future__ import annotations

import random

import pytest

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.cuda_graphs import batch_buckets

ENGINE_ARGS = dict(block_size=16, num_pages=64, max_num_batched_tokens=128, max_num_seqs=6)
# Different lengths so the decode batch shrinks 5 -> 4 -> 3 and pads into smaller buckets.
PARAMS = [
    SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (4, 10, 12, 6, 10)
]


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(6, vocab_size) for _ in range(n)] for n in (3, 17, 40, 5, 70)]


def _count_graph_steps(llm: LLM) -> list[int]:
    """Batch sizes the graph path served, recorded as the engine runs."""
    graphs, sizes = llm.engine.runner.decode_graphs, []
    original = graphs.run

    def run(batch):
        sizes.append(len(batch))
        return original(batch)

    graphs.run = run
    return sizes


def test_batch_buckets_cover_every_size_up_to_the_maximum():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]


def test_padded_decode_buffers_give_the_eager_tokens(checkpoints):
    model_dir = str(checkpoints["llama"])
    eager = LLM(model_dir, **ENGINE_ARGS)
    prompts = _prompts(eager.engine.model_config.vocab_size)
    expected = [out.token_ids for out in eager.generate(prompts, PARAMS)]

    padded = LLM(model_dir, **ENGINE_ARGS)
    runner = padded.engine.runner
    runner.enable_decode_graphs(6, padded.engine.max_model_len, capture=False)
    sizes = _count_graph_steps(padded)
    assert [out.token_ids for out in padded.generate(prompts, PARAMS)] == expected
    assert {5, 3} <= set(sizes), "batches of 5 (bucket 6) and 3 (bucket 4) went through"


def test_the_torch_reference_kernels_never_capture_graphs(checkpoints, monkeypatch):
    # They call .tolist() (a host sync), which CUDA graph capture refuses: a CUDA engine with
    # HALFMOON_KERNELS=torch failed to start. On CPU the references serve by default.
    monkeypatch.setenv("HALFMOON_KERNELS", "torch")
    engine = LLM(str(checkpoints["llama"]), **ENGINE_ARGS).engine
    engine._warm_up(graphs=True)  # what a CUDA engine runs at start
    assert engine.runner.decode_graphs is None


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_graph_decode_equals_eager_on_cuda(checkpoints, arch):
    model_dir = str(checkpoints[arch])
    args = dict(ENGINE_ARGS, device="cuda", dtype="float32")
    eager = LLM(model_dir, enforce_eager=True, **args)
    assert eager.engine.runner.decode_graphs is None
    prompts = _prompts(eager.engine.model_config.vocab_size)
    expected = [out.token_ids for out in eager.generate(prompts, PARAMS)]

    graphed = LLM(model_dir, **args)
    assert sorted(graphed.engine.runner.decode_graphs.graphs) == [1, 2, 4, 6]
    sizes = _count_graph_steps(graphed)
    assert [out.token_ids for out in graphed.generate(prompts, PARAMS)] == expected
    assert sizes, "decode steps were replayed from graphs"
