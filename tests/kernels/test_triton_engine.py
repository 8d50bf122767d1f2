"""The engine gives the same greedy tokens with the Triton kernels (interpreted) as with torch."""

from __future__ import annotations

import pytest

from halfmoon.engine import LLM, SamplingParams
from halfmoon.kernels import ops


# auto: first chunks take the dense prefill path, later chunks the paged kernel; paged: all.
@pytest.mark.parametrize("prefill", ["auto", "paged"])
def test_tiny_model_greedy_tokens_equal_between_triton_and_torch(
    tiny_model_dir, monkeypatch, prefill
):
    monkeypatch.setenv(ops.PREFILL_ENV, prefill)
    prompts = ["The cache", "x" * 40, "a"]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    # fp32 and eager on every device (on CUDA auto is bf16, where the backends' roundings
    # differ, and decode steps would replay graphs, which only the Triton backend has).
    args = dict(num_pages=32, max_num_batched_tokens=32, dtype="float32", enforce_eager=True)
    monkeypatch.setenv("HALFMOON_KERNELS", "torch")
    expected = LLM(str(tiny_model_dir), **args).generate(prompts, params)
    monkeypatch.setenv("HALFMOON_KERNELS", "triton")
    got = LLM(str(tiny_model_dir), **args).generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
