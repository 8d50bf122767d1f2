"""`bench step`'s host time: the step with the model stubbed out, then the engine as it was."""

from __future__ import annotations

from halfmoon.bench.probes.step import decode_step_times
from halfmoon.engine import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def test_host_time_is_measured_and_leaves_the_engine_untouched(tiny_model_dir):
    prompt = list(range(10, 40))
    expected = LLM(str(tiny_model_dir)).generate(prompt, PARAMS)[0].token_ids
    llm = LLM(str(tiny_model_dir), max_num_seqs=4)
    engine = llm.engine
    engine.use_decode_buffers(capture=False)
    wall_s, device_s, host_s = decode_step_times(llm, batch_size=3, context=20, steps=4)
    assert host_s > 0 and wall_s > 0 and device_s is None
    assert not engine.requests and not engine.has_unfinished_requests()
    model = engine.model
    assert "forward" not in vars(model) and "logits" not in vars(model)
    assert "run" not in vars(engine.decode_graphs)
    assert llm.generate(prompt, PARAMS)[0].token_ids == expected
