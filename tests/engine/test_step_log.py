"""The engine's step log: what each step computed and how long it took (the router's cost
model is fitted from it)."""

from __future__ import annotations

from halfmoon.engine import LLM, SamplingParams


def test_step_log_records_chunks_and_decode_steps(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_pages=64, block_size=16, prefill_chunk_size=64)
    llm.engine.step_log.clear()
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(10, 110))], params)  # 100 tokens: chunks of 64 and 36
    steps = list(llm.engine.step_log)
    assert [s.prefill_chunks for s in steps[:2]] == [((64, 0),), ((36, 64),)]
    assert all(s.decode_seqs == 0 for s in steps[:2])
    decode = steps[2:]
    assert [(s.prefill_chunks, s.decode_seqs) for s in decode] == [((), 1), ((), 1)]
    assert [s.decode_kv_tokens for s in decode] == [101, 102]
    assert all(s.seconds > 0 and s.waited_s >= 0 for s in steps)
    assert steps[0].waited_s == 0.0  # the engine was idle before it


def test_steps_of_two_prompts_share_the_budget(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_pages=64, block_size=16, prefill_chunk_size=64)
    llm.engine.step_log.clear()
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate([list(range(10, 90)), list(range(100, 140))], params)
    first = llm.engine.step_log[0]
    assert first.prefill_chunks == ((64, 0), (40, 0))


def test_start_up_profile_of_a_small_chunk_engine_fits(tiny_model_dir):
    from halfmoon.engine.profiling import profile_engine
    from halfmoon.router.cost_model import CostModel

    llm = LLM(str(tiny_model_dir), num_pages=128, block_size=16, prefill_chunk_size=16)
    samples = profile_engine(llm.engine)
    assert samples.chunk_tokens == 16
    assert max(new for new, _, _ in samples.prefill) == 16
    CostModel.fit(samples.prefill, samples.decode)  # every term is spanned
    assert not llm.engine.step_log  # the profile's own steps are not left for the router


def test_a_worker_profiles_only_the_side_it_serves(tiny_model_dir):
    from halfmoon.engine.profiling import profile_engine

    llm = LLM(str(tiny_model_dir), num_pages=128, block_size=16, prefill_chunk_size=16)
    prefill_only = profile_engine(llm.engine, decode=False)
    assert prefill_only.prefill and not prefill_only.decode
    decode_only = profile_engine(llm.engine, prefill=False)
    assert decode_only.decode and not decode_only.prefill
