"""Decode steps through the static, padded graph buffers give the eager engine's tokens.

On CPU the padded buffers run eagerly (`capture=False`), which checks the padding and the
buffer copies; on a GPU the suite also checks captured CUDA graphs against eager mode.
"""

from __future__ import annotations

import random

import pytest
import torch

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.cuda_graphs import DecodeBatch, DecodeGraphs, batch_buckets, context_widths
from halfmoon.engine.warmup import warm_up_cuda

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
    graphs, sizes = llm.engine.decode_graphs, []
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


def test_context_buckets_double_from_the_longest_context_of_short_splits():
    # The decode kernel's splits are 256 tokens up to 32 of them (8192 tokens, 512 pages).
    assert context_widths(64, 16) == [64]
    assert context_widths(600, 16) == [512, 600]
    assert context_widths(2048, 16) == [512, 1024, 2048]
    assert context_widths(2048, 32) == [256, 512, 1024, 2048]


def test_a_long_context_engine_decodes_short_sequences_over_the_narrowest_tables(checkpoints):
    # At a 40k-token context a graph over the full tables would give a short sequence a few
    # long splits; its steps go through the 512-page bucket instead, with the eager tokens.
    model_dir = str(checkpoints["llama"])
    prompts, expected = _eager_tokens(model_dir)
    padded = LLM(model_dir, **ENGINE_ARGS)
    padded.engine.use_decode_buffers(capture=False, max_model_len=40_000)
    graphs, widths = padded.engine.decode_graphs, []
    forward = graphs._forward
    graphs._forward = lambda size, width: widths.append(width) or forward(size, width)
    assert [out.token_ids for out in padded.generate(prompts, PARAMS)] == expected
    assert graphs.widths == [512, 1024, 2048, 2500] and set(widths) == {512}


def test_padded_decode_buffers_give_the_eager_tokens(checkpoints):
    model_dir = str(checkpoints["llama"])
    prompts, expected = _eager_tokens(model_dir)

    padded = LLM(model_dir, **ENGINE_ARGS)
    padded.engine.use_decode_buffers(capture=False)
    sizes = _count_graph_steps(padded)
    assert [out.token_ids for out in padded.generate(prompts, PARAMS)] == expected
    assert {5, 3} <= set(sizes), "batches of 5 (bucket 6) and 3 (bucket 4) went through"


def test_block_tables_are_written_incrementally_and_rewritten_when_replaced():
    kv = torch.zeros(32, 4, 1, 8)
    graphs = DecodeGraphs(None, [(kv, kv)], None, max_batch=4, max_blocks_per_seq=8, capture=False)
    a, b = [3, 4], [5]

    def load(*tables):
        n = len(tables)
        batch = DecodeBatch([1] * n, [2] * n, [7] * n, list(tables))
        graphs._load(batch, graphs.bucket_for(n))

    def rows(n):
        return [row[: len(t)] for row, t in zip(graphs.block_tables.tolist(), n, strict=False)]

    load(a, b)
    assert rows([a, b]) == [[3, 4], [5]]
    a.append(9)  # grows in place: only the new page is written
    graphs.block_tables[0, :2] = -7  # (so a rewrite of the old pages would show)
    load(a, b)
    assert graphs.block_tables[0, :3].tolist() == [-7, -7, 9]
    c = [11, 12]  # another sequence at row 0 (a new list): the whole row is written
    load(c, b)
    assert rows([c, b]) == [[11, 12], [5]]
    graphs.block_tables[3, 0] = 13
    load(b, c, a)  # rows move; bucket 4, so row 3 is padding: no KV written, page 0 read
    assert rows([b, c, a]) == [[5], [11, 12], [3, 4, 9]]
    assert graphs.block_tables[3, 0] == 0
    assert graphs.slots[:4].tolist() == [7, 7, 7, -1] and graphs.seq_lens[:4].tolist() == [
        3
    ] * 3 + [1]
    load(c, b)
    assert rows([c, b]) == [[11, 12], [5]]


def test_decode_graphs_survive_preemption_and_new_arrivals(checkpoints):
    # Few pages: sequences are preempted (their block tables replaced) and re-admitted at
    # other rows while others decode; the tokens still equal the eager engine's.
    model_dir = str(checkpoints["llama"])
    args = dict(ENGINE_ARGS, num_pages=14)
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)] * 5
    eager = LLM(model_dir, **args)
    prompts = _prompts(eager.engine.facts.vocab_size)
    expected = [out.token_ids for out in eager.generate(prompts, params)]
    assert eager.engine.scheduler.num_preemptions > 0

    padded = LLM(model_dir, **args)
    padded.engine.use_decode_buffers(capture=False)
    sizes = _count_graph_steps(padded)
    assert [out.token_ids for out in padded.generate(prompts, params)] == expected
    assert padded.engine.scheduler.num_preemptions > 0 and sizes


def test_the_torch_reference_kernels_never_capture_graphs(checkpoints, monkeypatch):
    # They call .tolist() (a host sync), which CUDA graph capture refuses: a CUDA engine with
    # HALFMOON_KERNELS=torch failed to start. On CPU the references serve by default.
    monkeypatch.setenv("HALFMOON_KERNELS", "torch")
    engine = LLM(str(checkpoints["llama"]), **ENGINE_ARGS).engine
    warm_up_cuda(engine, graphs=True)  # what a CUDA engine runs at start
    assert not engine.decode_buffers_in_use


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_graph_decode_equals_eager_on_cuda(checkpoints, arch):
    model_dir = str(checkpoints[arch])
    args = dict(ENGINE_ARGS, device="cuda", dtype="float32")
    eager = LLM(model_dir, enforce_eager=True, **args)
    assert eager.engine.decode_graphs is None
    prompts = _prompts(eager.engine.facts.vocab_size)
    expected = [out.token_ids for out in eager.generate(prompts, PARAMS)]

    graphed = LLM(model_dir, **args)
    assert sorted(size for size, _ in graphed.engine.decode_graphs.graphs) == [1, 2, 4, 6]
    sizes = _count_graph_steps(graphed)
    assert [out.token_ids for out in graphed.generate(prompts, PARAMS)] == expected
    assert sizes, "decode steps were replayed from graphs"


def _eager_tokens(model_dir: str) -> tuple[list, list[list[int]]]:
    """The test prompts and an eager engine's greedy tokens for them."""
    eager = LLM(model_dir, **ENGINE_ARGS)
    prompts = _prompts(eager.engine.facts.vocab_size)
    return prompts, [out.token_ids for out in eager.generate(prompts, PARAMS)]
