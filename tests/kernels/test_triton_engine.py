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
    monkeypatch.setenv("HALFMOON_KERNELS", "torch")
    expected = LLM(str(tiny_model_dir), num_pages=32, max_num_batched_tokens=32).generate(
        prompts, params
    )
    monkeypatch.setenv("HALFMOON_KERNELS", "triton")
    got = LLM(str(tiny_model_dir), num_pages=32, max_num_batched_tokens=32).generate(
        prompts, params
    )
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
