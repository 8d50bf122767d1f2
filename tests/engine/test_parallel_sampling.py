"""`n` > 1: one prefill, `n` sequences that share the prompt's pages (the partial last one
copied on write), each sampling on its own; seeded runs reproduce; nothing leaks."""

from __future__ import annotations

import pytest

from halfmoon.engine import LLM, InvalidRequestError, SamplingParams

BLOCK = 16
PARTIAL = list(range(40, 80))  # two full blocks and 8 tokens
ALIGNED = list(range(90, 122))  # exactly two blocks


def greedy(n: int = 1, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, n=n)


@pytest.fixture
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), num_pages=64, block_size=BLOCK, max_num_batched_tokens=256)


def test_greedy_n4_gives_four_copies_of_the_n1_output(llm):
    one = llm.generate([PARTIAL, ALIGNED], greedy())
    four = llm.generate([PARTIAL, ALIGNED], greedy(n=4))
    assert [(out.request_id, out.index) for out in four] == [
        (four[0].request_id, i) for i in range(4)
    ] + [(four[4].request_id, i) for i in range(4)]
    for want, outs in ((one[0], four[:4]), (one[1], four[4:])):
        assert [out.token_ids for out in outs] == [want.token_ids] * 4
        assert [out.text for out in outs] == [want.text] * 4
        assert [out.finish_reason for out in outs] == ["length"] * 4
        assert {out.num_prompt_tokens for out in outs} == {want.num_prompt_tokens}


def test_seeded_n4_reproduces_across_runs_and_its_sequences_differ(tiny_model_dir, llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True, n=4)
    first = [out.token_ids for out in llm.generate(PARTIAL, params)]
    again = [out.token_ids for out in llm.generate(PARTIAL, params)]
    fresh = LLM(str(tiny_model_dir), num_pages=64, block_size=BLOCK)
    assert first == again == [out.token_ids for out in fresh.generate(PARTIAL, params)]
    assert len({tuple(ids) for ids in first}) == 4  # sequence i draws with seed + i


def test_the_prompt_pages_are_held_once_and_only_the_partial_tail_is_copied(llm):
    engine, pool = llm.engine, llm.engine.pool
    engine.add_request(PARTIAL, greedy(n=1), "one")
    engine.step()
    pages_for_one = pool.num_used_pages
    engine.abort("one")

    engine.add_request(PARTIAL, greedy(n=4), "four")
    engine.step()  # the prompt, once; four first tokens
    group = engine.requests["four"].group
    assert pool.num_used_pages == pages_for_one == 3
    assert all(seq.block_table == group[0].block_table for seq in group)
    assert [pool.ref_counts[page] for page in group[0].block_table] == [4, 4, 4]

    engine.step()  # the first decode: three take a copy of the partial page, the last keeps it
    full = group[0].block_table[:2]
    assert all(seq.block_table[:2] == full for seq in group)
    assert len({seq.block_table[2] for seq in group}) == 4
    assert pool.num_used_pages == 3 + 3
    assert [pool.ref_counts[page] for page in full] == [4, 4]

    while engine.has_unfinished_requests():
        engine.step()
    assert_no_page_held(llm)


def test_a_block_aligned_prompt_shares_every_page_and_copies_none(llm):
    engine, pool = llm.engine, llm.engine.pool
    engine.add_request(ALIGNED, greedy(n=4), "aligned")
    engine.step()
    engine.step()  # each sequence's first decoded token opens a page of its own
    group = engine.requests["aligned"].group
    assert pool.num_used_pages == 2 + 4
    assert pool.take_copies() == []
    assert [pool.ref_counts[page] for page in group[0].block_table[:2]] == [4, 4]
    engine.abort("aligned")
    assert_no_page_held(llm)


def test_abort_ends_every_sequence_and_frees_all_pages(llm):
    engine = llm.engine
    engine.add_request(PARTIAL, greedy(n=4, max_tokens=50), "gone")
    for _ in range(3):
        engine.step()
    ended = engine.abort("gone")
    assert [(out.index, out.finish_reason, out.finished) for out in ended] == [
        (0, "abort", False),
        (1, "abort", False),
        (2, "abort", False),
        (3, "abort", True),
    ]
    assert not engine.requests and not engine.has_unfinished_requests()
    assert_no_page_held(llm)


def test_a_sequence_finishing_early_ends_its_choice_not_the_request(llm):
    engine = llm.engine
    engine.add_request(PARTIAL, greedy(n=2, max_tokens=4), "two")
    engine.step()
    engine.requests["two"].group[1].params = greedy(n=2, max_tokens=2)  # its own, shorter
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    ends = [(out.index, out.finish_reason, out.finished) for out in outputs if out.finish_reason]
    assert ends == [(1, "length", False), (0, "length", True)]
    assert_no_page_held(llm)


def test_siblings_preempted_for_room_still_give_the_greedy_output(tiny_model_dir, llm):
    want = llm.generate(PARTIAL, greedy(max_tokens=40))[0].token_ids
    # 8 pages: the prompt's 3 and 4 x 3 of output do not fit, so sequences are preempted and
    # recomputed from the prompt's cached blocks.
    small = LLM(str(tiny_model_dir), num_pages=8, block_size=BLOCK)
    outs = small.generate(PARTIAL, greedy(n=4, max_tokens=40))
    assert small.engine.scheduler.num_preemptions > 0
    assert [out.token_ids for out in outs] == [want] * 4
    assert_no_page_held(small)


def test_siblings_decode_from_the_decode_buffers_as_eagerly(tiny_model_dir, llm):
    # The decode graphs mirror block tables by identity: a copy on write must reach them.
    want = llm.generate([PARTIAL, ALIGNED], greedy(n=3, max_tokens=20))
    buffered = LLM(str(tiny_model_dir), num_pages=64, block_size=BLOCK)
    buffered.engine.use_decode_buffers(capture=False)
    outs = buffered.generate([PARTIAL, ALIGNED], greedy(n=3, max_tokens=20))
    assert [out.token_ids for out in outs] == [out.token_ids for out in want]


def test_n_above_max_num_seqs_is_refused_naming_n(tiny_model_dir):
    small = LLM(str(tiny_model_dir), num_pages=64, max_num_seqs=4)
    with pytest.raises(InvalidRequestError, match="max_num_seqs = 4") as caught:
        small.engine.add_request(PARTIAL, greedy(n=5))
    assert caught.value.field == "n"
    with pytest.raises(InvalidRequestError, match="n"):
        SamplingParams(n=0)


def assert_no_page_held(llm: LLM) -> None:
    pool = llm.engine.pool
    assert pool.num_used_pages == 0
    assert set(pool.ref_counts) == {0}
