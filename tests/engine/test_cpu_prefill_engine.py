"""A bf16 engine on CPU prefills through the AMX kernel (`kernels/cpu_prefill`) where it
serves: the same greedy tokens and logprobs as the torch reference's prefill, over prompts
chunked across steps (runs continued over a cached prefix) and over a shared prefix."""

from __future__ import annotations

import pytest
import torch

from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine.init_model import TinyModelShape, init_model
from halfmoon.kernels import cpu_prefill, ops

pytestmark = pytest.mark.skipif(
    not cpu_prefill.available(),
    reason=cpu_prefill.LIBRARY.error()
    or "this CPU (or Linux) lends no AMX: the torch reference serves prefill attention",
)


@pytest.fixture(scope="module")
def head_64_model(tmp_path_factory):
    """A Llama of head size 64 (hidden 128, two heads, one KV head), the size the kernel takes."""
    return init_model(
        tmp_path_factory.mktemp("models") / "head-64", TinyModelShape(128, 256, 2, 2, 1)
    )


def greedy(model_dir, prompts):
    llm = LLM(
        str(model_dir),
        device="cpu",
        dtype="bfloat16",
        num_pages=128,
        max_num_batched_tokens=64,
        prefill_chunk_size=48,
    )
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    return [
        (out.token_ids, [entry.logprob for entry in out.logprobs])
        for out in llm.generate(prompts, params)
    ]


def test_the_kernel_gives_the_reference_prefill_tokens(head_64_model, monkeypatch):
    shared = list(range(10, 110))
    prompts = [shared + [7, 8, 9], list(range(40, 190)), shared + [200], [5, 6, 7]]
    served = []
    monkeypatch.setattr(
        cpu_prefill, "prefill_attention", _counted(cpu_prefill.prefill_attention, served)
    )
    with_kernel = greedy(head_64_model, prompts)
    assert served, "the kernel did not serve the bf16 prefills"
    monkeypatch.setattr(ops, "native_prefill", lambda *tensors: False)
    reference = greedy(head_64_model, prompts)
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(with_kernel, reference, strict=True):
        assert tokens == ref_tokens
        torch.testing.assert_close(
            torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=0.05, rtol=0
        )


def _counted(fn, calls):
    def counted(*args):
        calls.append(1)
        return fn(*args)

    return counted
