"""Bad input raises a specific error naming the field; the engine keeps serving."""

from __future__ import annotations

import math

import pytest

from halfmoon.engine import LLM, InvalidRequestError, ModelLoadError, SamplingParams


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", True),
    ],
)
def test_out_of_range_sampling_field_is_named(field, value):
    with pytest.raises(InvalidRequestError, match=field) as caught:
        SamplingParams(**{field: value})
    assert caught.value.field == field


def test_the_largest_seed_samples_and_repeats(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_pages=64)
    params = SamplingParams(max_tokens=4, seed=2**63 - 1, ignore_eos=True)
    first, again = llm.generate(["hi", "hi"], params)
    assert first.token_ids == again.token_ids and len(first.token_ids) == 4


def test_empty_and_too_long_prompts_are_rejected_and_others_continue(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_pages=64, max_model_len=128)
    engine = llm.engine
    good = engine.add_request("fine", SamplingParams(max_tokens=3, temperature=0.0))
    with pytest.raises(InvalidRequestError, match="prompt.*must not be empty"):
        engine.add_request("")
    with pytest.raises(InvalidRequestError, match="context length of 128"):
        engine.add_request("x" * 200)
    with pytest.raises(InvalidRequestError, match="prompt_token_ids"):
        engine.add_request([1, 99999])
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == [good]


def test_missing_model_directory_names_the_fix(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="neither config.json nor a .gguf"):
        LLM(str(tmp_path / "empty"))


def test_unsupported_architecture_lists_the_supported_ones(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=1, n_embd=16, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_abort_frees_pages(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_pages=64)
    engine = llm.engine
    rid = engine.add_request("a long enough prompt " * 4, SamplingParams(max_tokens=50))
    engine.step()
    assert engine.stats().num_used_pages > 0
    engine.abort(rid)
    assert engine.stats().num_used_pages == 0
    assert not engine.has_unfinished_requests()
