"""Automatic prefix caching: shared prefixes are computed once and change nothing."""

from __future__ import annotations

from halfmoon.engine import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def test_shared_prefix_computes_only_uncached_tokens(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_pages=64, block_size=16)
    prefix = list(range(10, 10 + 70))  # 4 full blocks and 6 tokens
    first = llm.generate([prefix + [200, 201]], GREEDY)[0]
    before = llm.engine.stats().num_prompt_tokens_computed
    second = llm.generate([prefix + [202, 203, 204]], GREEDY)[0]
    computed = llm.engine.stats().num_prompt_tokens_computed - before
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == 64
    assert computed == 73 - 64
    uncached = LLM(str(tiny_model_dir), num_pages=64, enable_prefix_caching=False)
    assert second.token_ids == uncached.generate([prefix + [202, 203, 204]], GREEDY)[0].token_ids


def test_fully_cached_prompt_still_computes_its_last_block(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_pages=64, block_size=16)
    prompt = list(range(20, 52))  # exactly two blocks
    first = llm.generate([prompt], GREEDY)[0]
    again = llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == 16
    assert again.token_ids == first.token_ids


def test_finished_pages_stay_cached_until_evicted_lru(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_pages=8, block_size=16, max_num_seqs=1)
    old = list(range(30, 30 + 33))
    llm.generate([old], SamplingParams(max_tokens=1, temperature=0.0))
    pool = llm.engine.pool
    assert pool.num_used_pages == 0 and len(pool.key_to_page) == 2
    llm.generate(
        [list(range(100, 100 + 7 * 16 + 1))], SamplingParams(max_tokens=1, temperature=0.0)
    )
    again = llm.generate([old], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert again.num_cached_tokens == 0, "the old prefix was the least recently used and evicted"


def test_adopted_pages_extend_a_cached_chain_without_evicting_it():
    from halfmoon.engine.page_pool import PagePool
    from halfmoon.engine.sequence import Sequence

    pool = PagePool(num_pages=4, block_size=2, root_key=b"root")
    pool.events = []
    seq = Sequence("s", [1, 2, 3], 3, SamplingParams(), 0.0)
    pool.grow(seq, 3)
    seq.num_computed_tokens = 3
    pool.cache_full_blocks(seq)  # one full block cached
    (head,) = seq.block_keys
    pool.release(seq)
    assert pool.uncached([head, b"a"]) == [b"a"]
    adopted = pool.adopt([head, b"a", b"b", b"c", b"d"])
    # Three pages were free; the chain's own head stays, so only three blocks are adopted.
    assert [index for index, _ in adopted] == [1, 2, 3]
    assert head in pool.key_to_page and b"d" not in pool.key_to_page
    assert pool.num_free_pages == 4 and pool.num_used_pages == 0  # cached, unreferenced
    assert pool.events[-3:] == [("stored", b"a"), ("stored", b"b"), ("stored", b"c")]
    reader = Sequence("r", [1, 2, 9], 3, SamplingParams(), 0.0)
    assert pool.attach_cached_prefix(reader) == 2
