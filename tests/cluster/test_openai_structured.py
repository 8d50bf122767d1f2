"""Structured outputs over HTTP: which request fields become which constraint, and which are
refused naming the field; then, through the official `openai` client against a real
disaggregated cluster (1 prefill, 1 decode: the prefill worker samples the first token under the
grammar, the decode worker replays it into its own), outputs parse and validate, greedy ones are
the offline engine's, and a bad constraint is refused before any worker sees it."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pytest
from cluster_kit import counters, running_cluster
from pydantic import BaseModel, Field

from halfmoon.bench.probes.structured import validation_errors
from halfmoon.cluster.frontend.grammar_checks import build_here
from halfmoon.cluster.frontend.http_request import parse
from halfmoon.cluster.frontend.openai_schema import CompletionRequest
from halfmoon.engine import SamplingParams
from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.structured_output import StructuredOutput

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Describe a shirt in JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"enum": ["small", "medium", "large"]},
        "price": {"type": "integer", "minimum": 1, "maximum": 500},
        "colors": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
    },
    "required": ["name", "size", "price"],
}


class Shirt(BaseModel):
    name: str = Field(max_length=8)
    size: Literal["small", "medium", "large"]
    price: int = Field(ge=1, le=500)


def _constraint(body: dict) -> StructuredOutput | None:
    """The constraint a completion request with `body`'s fields sets (chat shares the fields),
    its grammar built as the frontend's builders build it."""
    request = parse(CompletionRequest, json.dumps({"prompt": "x", **body}).encode())
    structured = request.structured_output()
    build_here(request.grammar_constraints())
    return structured


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"b": 1}}}},
            StructuredOutput("json", '{"b": 1}'),
        ),
        ({"guided_json": '{"type": "string"}'}, StructuredOutput("json", '{"type": "string"}')),
        (
            {"guided_regex": "a+", "guided_decoding_backend": "xgrammar"},
            StructuredOutput("regex", "a+"),
        ),
        ({"guided_choice": ["a", "b"]}, StructuredOutput("choice", '["a", "b"]')),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"')),
        (
            {"structured_outputs": {"json": {"enum": [1]}}},
            StructuredOutput("json", '{"enum": [1]}'),
        ),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            StructuredOutput("json_object"),
        ),
    ],
)
def test_each_field_becomes_its_constraint(body, expected):
    assert _constraint(body) == expected


@pytest.mark.parametrize(
    ("body", "param", "reason"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema.schema",
            "needs json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}},
            "response_format.json_schema.schema",
            "type",
        ),
        ({"response_format": {"type": "structural_tag"}}, "response_format.type", "json_schema"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "response_format is set too",
        ),
        ({"guided_json": "{not json"}, "guided_json", "not JSON"),
        ({"guided_regex": "(("}, "guided_regex", "parenthesis"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_grammar": "root ::= x"}, "guided_grammar", "not defined"),
        ({"structured_outputs": {}}, "structured_outputs", "set one of"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs.choice",
            "structured_outputs.regex is set too",
        ),
        (
            {"structured_outputs": {"whitespace_pattern": " "}},
            "structured_outputs.whitespace_pattern",
            "not supported",
        ),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "unknown field"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
        ({"structural_tag": "{}"}, "structural_tag", "not supported"),
    ],
)
def test_a_bad_or_second_constraint_is_refused_naming_its_field(body, param, reason):
    with pytest.raises(InvalidRequestError, match=re.escape(reason)) as raised:
        _constraint(body)
    assert raised.value.field == param


@pytest.fixture(scope="module")
def served(ray_session, tiny_model_dir):
    with running_cluster(tiny_model_dir, served_model_name=MODEL) as (cluster, client):
        yield cluster, f"http://127.0.0.1:{cluster.ports['http_port']}/v1"


@pytest.fixture(scope="module")
def oai(served):
    with openai.OpenAI(base_url=served[1], api_key="unused", max_retries=0) as client:
        yield client


def _offline(llm, prompt, structured: StructuredOutput) -> str:
    params = SamplingParams(max_tokens=512, temperature=0.0, structured_output=structured)
    return llm.generate(prompt, params)[0].text


@pytest.mark.slow
def test_greedy_json_schema_output_validates_and_is_the_offline_engines(oai, tiny_llm):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "shirt", "schema": SCHEMA, "strict": True},
    }
    answer = oai.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        temperature=0,
        max_tokens=512,
        response_format=response_format,
    )
    text = answer.choices[0].message.content
    assert answer.choices[0].finish_reason == "stop"
    assert validation_errors(text, SCHEMA) is None, text
    assert text == _offline(tiny_llm, MESSAGES, StructuredOutput("json", json.dumps(SCHEMA)))


@pytest.mark.slow
def test_sampled_json_schema_outputs_validate(oai):
    for seed in range(4):
        answer = oai.completions.create(
            model=MODEL,
            prompt=f"shirt {seed}:",
            temperature=1.0,
            seed=seed,
            max_tokens=512,
            extra_body={
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "shirt", "schema": SCHEMA},
                }
            },
        )
        assert validation_errors(answer.choices[0].text, SCHEMA) is None, answer.choices[0].text


@pytest.mark.slow
def test_json_object_output_is_an_object_equal_to_the_offline_engines(oai, tiny_llm):
    answer = oai.completions.create(
        model=MODEL,
        prompt="An object:",
        temperature=0,
        max_tokens=256,
        extra_body={"response_format": {"type": "json_object"}},
    )
    text = answer.choices[0].text
    assert isinstance(json.loads(text), dict)
    assert text == _offline(tiny_llm, "An object:", StructuredOutput("json_object"))


@pytest.mark.slow
def test_the_sdks_parse_helper_gets_its_pydantic_model_back(oai):
    parsed = oai.chat.completions.parse(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=512, response_format=Shirt
    )
    shirt = parsed.choices[0].message.parsed
    assert isinstance(shirt, Shirt) and 1 <= shirt.price <= 500


@pytest.mark.slow
def test_vllm_extras_constrain_streamed_outputs(oai):
    cases = [
        ({"guided_choice": ["yes", "no"]}, re.compile(r"yes|no")),
        ({"structured_outputs": {"regex": r"[A-Z][0-9]{3}"}}, re.compile(r"[A-Z][0-9]{3}")),
        ({"structured_outputs": {"choice": ["día", "noche"]}}, re.compile(r"día|noche")),
    ]
    for extra, pattern in cases:
        for seed in range(3):
            chunks = oai.completions.create(
                model=MODEL,
                prompt="Answer:",
                temperature=1.0,
                seed=seed,
                max_tokens=32,
                stream=True,
                extra_body=extra,
            )
            text = "".join(chunk.choices[0].text for chunk in chunks)
            assert pattern.fullmatch(text), (extra, text)


@pytest.mark.slow
def test_a_bad_schema_is_refused_naming_the_field_before_any_worker_work(served, oai):
    cluster = served[0]
    prefill = next(name for name in cluster.workers if "prefill" in name)
    before = counters(cluster, prefill)["num_prompt_tokens_computed"]
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wrong"}}}
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=8, response_format=bad
        )
    error = raised.value.body
    assert error["param"] == "response_format.json_schema.schema"
    assert 'Unsupported type "wrong"' in error["message"]
    assert counters(cluster, prefill)["num_prompt_tokens_computed"] == before
