"""The KV API of a tensor-parallel engine is whole-head: a layer read at T = 2 gathers both
ranks' heads into the layout T = 1 reads, a write gives each rank its heads, and blocks read at
one degree are a cached prefix at the other (real rank processes, gloo on CPU)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from halfmoon.engine import LLM, InvalidRequestError, SamplingParams
from halfmoon.engine.kv_shards import ShardedKvCache
from halfmoon.kernels.kv_quant import dequantize
from halfmoon.kvstore.keys import block_keys
from halfmoon.kvstore.layout import LayerKV

ENGINE_ARGS = dict(num_pages=32, max_num_batched_tokens=128)
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

pytestmark = pytest.mark.timeout(120)


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 262) for _ in range(length)]


@pytest.fixture(scope="module")
def one(tiny_model_dir):
    return LLM(str(tiny_model_dir), **ENGINE_ARGS)


@pytest.fixture(scope="module")
def two(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), tensor_parallel_size=2, **ENGINE_ARGS)
    yield llm
    llm.close()


def _blocks(llm: LLM, prompt: list[int]) -> tuple[list[bytes], list[LayerKV]]:
    """The keys of `prompt`'s full blocks, computed by `llm`, and every layer of them read
    through its KV API."""
    engine = llm.engine
    keys = block_keys(engine.root_key, prompt, engine.config.block_size)
    llm.generate([prompt], GREEDY)
    pages = [engine.pool.key_to_page[key] for key in keys]
    kv_cache = engine.kv_cache
    layers = [kv_cache.read_layer(layer, pages).wait() for layer in range(kv_cache.num_layers)]
    return keys, layers


def test_a_layer_read_at_two_ranks_is_the_layer_one_rank_reads(one, two):
    prompt = _prompt(1, 40)
    keys, at_one = _blocks(one, prompt)
    assert _blocks(two, prompt)[0] == keys, "block keys do not depend on the degree"
    at_two = _blocks(two, prompt)[1]
    assert len(keys) == 2 and at_two[0].k.shape == at_one[0].k.shape == (2, 16, 2, 32)
    # Layer 0's K and V come from the embedding alone: the same bytes; the later layers' inputs
    # went through all-reduces, which round differently.
    assert torch.equal(at_two[0].k, at_one[0].k) and torch.equal(at_two[0].v, at_one[0].v)
    for ours, theirs in zip(at_two, at_one, strict=True):
        torch.testing.assert_close(ours.k, theirs.k, atol=1e-5, rtol=0)
        torch.testing.assert_close(ours.v, theirs.v, atol=1e-5, rtol=0)


def test_a_layer_written_at_two_ranks_gives_each_rank_its_heads(two):
    kv_cache = two.engine.kv_cache
    # Pages no cached block is in: the other tests' prefixes stay intact.
    first, second, third = [p for p in range(32) if p not in two.engine.pool.page_to_key][-3:]
    written = LayerKV(torch.randn(2, 16, 2, 32), torch.randn(2, 16, 2, 32))
    kv_cache.write_layer(3, [third, first], written)
    read = kv_cache.read_layer(3, [third, first]).wait()
    assert torch.equal(read.k, written.k) and torch.equal(read.v, written.v)
    for rank, shard in enumerate(kv_cache.shards):
        k_cache, v_cache = shard[3]
        assert torch.equal(k_cache[[third, first]], written.k[:, :, rank : rank + 1])
        assert torch.equal(v_cache[[third, first]], written.v[:, :, rank : rank + 1])
    kv_cache.copy_within([third], [second])
    copied = kv_cache.read_layer(3, [second]).wait()
    assert torch.equal(copied.k, written.k[:1]) and torch.equal(copied.v, written.v[:1])
    assert kv_cache.page_shape == (32, 16, 2, 32) and kv_cache.export() is None


def test_without_the_other_ranks_pages_kv_moves_and_forks_are_refused_saying_why(two):
    """As on CUDA, where rank 0 maps only its own pages: every KV move, and a request with
    n > 1 (its sequences copy pages on write), is refused before it can break a step."""
    kv_cache = two.engine.kv_cache
    assert kv_cache.unmapped is None and two.engine.intake.forks_refused is None
    rank_0_only = ShardedKvCache(kv_cache.shards[:1], 2)
    reason = rank_0_only.unmapped
    assert reason == (
        "the other ranks' KV pages (tensor_parallel_size=2, on cpu) are not mapped into rank 0, "
        "which works on CPU with memfd_create only so far"
    )
    layer = LayerKV(torch.zeros(1, 16, 2, 32), torch.zeros(1, 16, 2, 32))
    moves = [
        lambda: rank_0_only.read_layer(0, [1]),
        lambda: rank_0_only.write_layer(0, [1], layer),
        lambda: rank_0_only.copy_within([1], [2]),
    ]
    for move in moves:
        with pytest.raises(NotImplementedError) as error:
            move()
        assert str(error.value) == (
            f"moving KV in or out of this engine is not supported yet: {reason}; "
            "use tensor_parallel_size = 1 for this worker"
        )
    intake = dataclasses.replace(two.engine.intake, forks_refused=reason)
    with pytest.raises(InvalidRequestError) as error:
        intake.sequence([7, 8, 9], SamplingParams(n=2), "forked", None)
    assert str(error.value) == (
        "n=2 is invalid: must be 1 on this engine: its sequences would copy KV pages on write, "
        f"not supported yet: {reason}"
    )
    assert intake.sequence([7, 8, 9], SamplingParams(), "single", None).num_forks == 1


@pytest.mark.parametrize("direction", ["2->1", "1->2"])
def test_blocks_read_at_one_degree_are_a_cached_prefix_at_the_other(one, two, tiny_llm, direction):
    source, target = (two, one) if direction == "2->1" else (one, two)
    prompt = _prompt(2 if direction == "2->1" else 3, 48)
    keys, layers = _blocks(source, prompt)
    assert target.engine.adopt_blocks(keys, layers) == 3
    longer = [*prompt, 7, 8, 9]
    (out,) = target.generate([longer], GREEDY)
    assert out.num_cached_tokens == 48
    assert out.token_ids == tiny_llm.generate([longer], GREEDY)[0].token_ids


def test_8_bit_kv_at_two_ranks_reads_the_layer_and_tokens_of_one_rank(tiny_model_dir):
    """Each rank's pages hold its heads' quantized rows with their scales; read whole-head,
    they are the bytes one rank stores, and the tokens are one rank's."""
    args = {**ENGINE_ARGS, "kv_cache_dtype": "int8"}
    single = LLM(str(tiny_model_dir), **args)
    double = LLM(str(tiny_model_dir), tensor_parallel_size=2, **args)
    try:
        prompt = _prompt(7, 40)
        _, layers_one = _blocks(single, prompt)
        _, layers_two = _blocks(double, prompt)
        assert layers_two[0].k.dtype == torch.int8 and layers_two[0].k.shape[-1] == 32 + 2
        # Layer 0 from the embedding alone: the same bytes. Later layers' inputs went through
        # all-reduces, which round differently: the same rows within one int8 step.
        assert torch.equal(layers_one[0].k, layers_two[0].k)
        for a, b in zip(layers_one, layers_two, strict=True):
            for x, y in ((a.k, b.k), (a.v, b.v)):
                step = dequantize(x, torch.float32).abs().amax(-1, keepdim=True) / 127
                close = dequantize(x, torch.float32) - dequantize(y, torch.float32)
                assert (close.abs() <= 1.01 * step + 1e-6).all()
        new = _prompt(8, 30)
        assert double.generate([new], GREEDY)[0].token_ids == (
            single.generate([new], GREEDY)[0].token_ids
        )
    finally:
        double.close()
