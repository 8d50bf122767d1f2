"""A joined request (its KV written from outside) waits while the running batch holds
`max_num_seqs`, the largest decode graph, and goes on in order as sequences finish."""

from __future__ import annotations

from halfmoon.engine import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_joins_past_max_num_seqs_wait_for_room_and_all_finish(tiny_model_dir):
    engine = LLM(str(tiny_model_dir), num_pages=64, max_num_seqs=2).engine
    for name in ("a", "b", "c", "d"):
        engine.reserve([5, 6, 7, 8, 9], PARAMS, name)
        engine.join(name, 7)
    assert [s.request_id for s in engine.scheduler.running] == ["a", "b"]
    assert [group[0].request_id for group in engine.scheduler.joined] == ["c", "d"]
    engine.abort("d")  # aborted while it waits: dropped, never run
    engine.step_log.clear()
    finished = set()
    while engine.has_unfinished_requests():
        finished |= {out.request_id for out in engine.step() if out.finished}
    sizes = [len(step.prefill_chunks) + step.decode_seqs for step in engine.step_log]
    assert finished == {"a", "b", "c"}
    assert max(sizes) == 2 and sizes.count(1) == 3, "c ran alone once a and b were done"
    assert not engine.scheduler.joined and engine.stats().num_used_pages == 0
