"""A real pretrained model served end to end: SmolLM2-135M-Instruct, passed to the cluster as
its GGUF file, on a live disaggregated cluster (1 prefill, 1 decode) through the official
`openai` client: a readable chat answer streamed, equal to the offline engine's greedy one;
`n` = 3 with penalties and `logit_bias`; a JSON schema whose grammar masks 49,152 tokens."""

from __future__ import annotations

import json

import openai
import pytest
from cluster_kit import running_cluster

from halfmoon.bench.probes.structured import validation_errors
from halfmoon.engine import LLM, SamplingParams

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(600), pytest.mark.slow]

MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "maxLength": 24},
    },
    "required": ["city", "country"],
}


@pytest.fixture(scope="module")
def oai(smollm2_gguf, smollm2_dir):
    settings = {"served_model_name": MODEL, "limits.grammar_builder_at_start": True}
    with running_cluster(smollm2_gguf, **settings) as (cluster, _):
        base_url = f"http://127.0.0.1:{cluster.ports['http_port']}/v1"
        with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            yield client


def test_a_chat_answer_streams_as_the_offline_engine_writes_it(oai, smollm2_dir):
    stream = oai.chat.completions.create(
        model=MODEL, messages=QUESTION, temperature=0, max_tokens=16, stream=True
    )
    chunks = list(stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert "Paris" in text and finish[-1] == "stop", text
    offline = LLM(str(smollm2_dir), num_pages=64)
    params = SamplingParams(max_tokens=16, temperature=0.0)
    assert text == offline.generate(QUESTION, params)[0].text


def test_three_samples_with_penalties_and_a_logit_bias(oai, smollm2_dir):
    from transformers import AutoTokenizer

    banned = AutoTokenizer.from_pretrained(smollm2_dir).encode(" the")[0]
    answer = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Write a sentence about the sea."}],
        n=3,
        temperature=0.8,
        seed=3,
        max_tokens=24,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        logit_bias={str(banned): -100},
        logprobs=True,
    )
    assert sorted(choice.index for choice in answer.choices) == [0, 1, 2]
    texts = [choice.message.content for choice in answer.choices]
    assert all(text.strip() for text in texts) and len(set(texts)) > 1, texts
    for choice in answer.choices:
        assert all(entry.token != " the" for entry in choice.logprobs.content)


def test_a_json_schema_answer_validates_at_the_real_vocabulary(oai):
    answer = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a city and its country, in JSON."}],
        temperature=0,
        max_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    )
    text = answer.choices[0].message.content
    assert validation_errors(text, SCHEMA) is None, text
    assert set(json.loads(text)) == {"city", "country"}
