"""Structured outputs in the engine: a constrained request's output always parses and validates
(from a random model too), free rows of the batch are untouched, grammars compile off the step
thread, and a joined or migrated request's matcher replays the tokens generated before."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import threading

import numpy as np
import pytest

from halfmoon.bench.probes.structured import random_schema, validation_errors
from halfmoon.engine import LLM, SamplingParams
from halfmoon.engine import grammar as grammar_module
from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.grammar import check
from halfmoon.engine.structured_output import StructuredOutput
from halfmoon.engine.utf8_guard import INVALID, Utf8Guard

NUM_SCHEMAS = 24
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"enum": ["small", "large"]},
        "tags": {"type": "array", "items": {"enum": [1, 22, 333]}, "maxItems": 2},
    },
    "required": ["name", "size"],
}


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), num_pages=1024, max_num_batched_tokens=512)


def _json(schema: dict, **params) -> SamplingParams:
    structured = StructuredOutput("json", json.dumps(schema))
    return SamplingParams(
        max_tokens=params.pop("max_tokens", 1024), structured_output=structured, **params
    )


def _run(engine, request_ids: set[str]) -> dict[str, str]:
    """Step `engine` until `request_ids` have finished; their texts."""
    texts = dict.fromkeys(request_ids, "")
    while request_ids & set(engine.requests):
        for out in engine.step():
            if out.request_id in texts:
                texts[out.request_id] += out.new_text
    return texts


def test_random_schemas_give_outputs_that_parse_and_validate_sampled_and_greedy(llm):
    rng = random.Random(32)
    schemas = [random_schema(rng) for _ in range(NUM_SCHEMAS)]
    params = [_json(s, temperature=1.0, seed=i) for i, s in enumerate(schemas)]
    params += [_json(s, temperature=0.0) for s in schemas]
    outputs = llm.generate([f"Request {i}: JSON.\n" for i in range(len(params))], params)
    for output, schema in zip(outputs, schemas + schemas, strict=True):
        assert output.finish_reason == "stop", (output.text, schema)
        assert validation_errors(output.text, schema) is None, (output.text, schema)
        assert "\ufffd" not in output.text  # every byte sequence was valid UTF-8


def test_regex_choice_and_grammar_outputs_match(llm):
    cases = [
        (StructuredOutput("regex", r"[a-z]{2,5}-\d{3}"), re.compile(r"[a-z]{2,5}-\d{3}")),
        (StructuredOutput("regex", r"(yes|no)( maybe)?"), re.compile(r"(yes|no)( maybe)?")),
        (StructuredOutput.choice(["red", 'say "hi"', "día"]), re.compile(r'red|say "hi"|día')),
        (StructuredOutput("grammar", 'root ::= "<" [a-c]+ ">"'), re.compile(r"<[a-c]+>")),
    ]
    for structured, pattern in cases:
        params = [
            SamplingParams(max_tokens=64, temperature=1.0, seed=seed, structured_output=structured)
            for seed in range(6)
        ]
        for output in llm.generate(["Hi"] * len(params), params):
            assert pattern.fullmatch(output.text), (structured, output.text)
            assert output.finish_reason == "stop"


def test_json_object_gives_an_object_whenever_it_ends(llm):
    # Any object: nothing bounds its strings, which a random model may run past max_tokens.
    structured = StructuredOutput("json_object")
    params = [
        SamplingParams(max_tokens=256, temperature=1.0, seed=seed, structured_output=structured)
        for seed in range(8)
    ]
    outputs = llm.generate(["Hi"] * len(params), params)
    ended = [output for output in outputs if output.finish_reason == "stop"]
    assert len(ended) >= len(outputs) // 2
    for output in ended:
        assert isinstance(json.loads(output.text), dict), output.text


def test_free_rows_of_a_mixed_batch_sample_as_they_do_without_the_grammar_rows(llm):
    free = [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=24, seed=7)]
    free_prompts = ["The cat", "A dog"]
    alone = llm.generate(free_prompts, free)
    mixed = llm.generate(
        ["x", *free_prompts, "y"],
        [_json(SCHEMA, temperature=0.0), *free, _json(SCHEMA, seed=3)],
    )
    assert [o.token_ids for o in mixed[1:3]] == [o.token_ids for o in alone]
    for output in (mixed[0], mixed[3]):
        assert validation_errors(output.text, SCHEMA) is None


def _gate(monkeypatch, kind: str) -> threading.Event:
    """Make compiles of `kind` wait until the returned event is set."""
    release, source = threading.Event(), grammar_module._source

    def slow(structured):
        if structured.kind == kind:
            assert release.wait(60)
        return source(structured)

    monkeypatch.setattr(grammar_module, "_source", slow)
    return release


def test_a_compiling_grammar_waits_out_of_the_batch_while_other_requests_step(llm, monkeypatch):
    engine = llm.engine
    release = _gate(monkeypatch, "grammar")
    structured = StructuredOutput("grammar", 'root ::= "slow " [0-9]')
    engine.add_request("x", SamplingParams(max_tokens=8, structured_output=structured), "slow")
    engine.add_request("y", SamplingParams(max_tokens=12, temperature=0.0), "fast")
    fast = _run(engine, {"fast"})
    assert len(fast["fast"]) > 0 and "fast" not in engine.requests
    slow = engine.requests["slow"]
    assert engine.grammars.parked == [slow] and slow.num_output_tokens == 0
    release.set()
    assert re.fullmatch(r"slow [0-9]", _run(engine, {"slow"})["slow"])


@pytest.mark.parametrize("compiled_at_join", [True, False])
def test_a_joined_request_replays_its_first_token_into_its_grammar(
    llm, monkeypatch, compiled_at_join
):
    # Disaggregated decode: the prefill worker sampled the first token under the grammar; the
    # decode worker's matcher must start after it (its KV here is whatever the pages held: the
    # grammar alone decides what is valid).
    engine = llm.engine
    n = {"type": "integer", "minimum": 0, "maximum": 99}
    schema = {**SCHEMA, "properties": {**SCHEMA["properties"], "n": n}}
    prefill = dataclasses.replace(
        _json(schema, temperature=0.0), max_tokens=1, ignore_eos=True
    )  # as the prefill worker asks for the first token
    first = llm.generate("Hello", prefill)[0]
    assert first.text == "{"
    # The same schema spelt differently: a grammar the decode side has not compiled yet.
    spec = json.dumps(schema, indent=None if compiled_at_join else 1)
    decode = SamplingParams(max_tokens=1024, structured_output=StructuredOutput("json", spec))
    release = None if compiled_at_join else _gate(monkeypatch, "json")
    request_id = f"joined-{compiled_at_join}"
    engine.reserve("Hello", decode, request_id)
    [out] = engine.join(request_id, first.token_ids[0])
    assert bool(engine.grammars.parked) is not compiled_at_join
    if release is not None:
        release.set()
    text = out.new_text + _run(engine, {request_id})[request_id]
    assert validation_errors(text, schema) is None, text


def test_a_migrated_request_continues_its_grammar_from_its_earlier_output(llm):
    # A migrated request is prefilled again with its output so far as prompt: its grammar must
    # go on from there, and greedy decoding ends as the undisturbed run did.
    engine = llm.engine
    prompt = engine.tokenizer.encode("Describe it:")
    whole = llm.generate(prompt, _json(SCHEMA, temperature=0.0))[0]
    cut = len(whole.token_ids) // 2
    engine.add_request(
        prompt + whole.token_ids[:cut],
        _json(SCHEMA, temperature=0.0),
        "migrated",
        num_prior_output_tokens=cut,
    )
    rest = _run(engine, {"migrated"})["migrated"]
    assert engine.tokenizer.decode(whole.token_ids[:cut]) + rest == whole.text


def test_each_of_n_sequences_follows_its_own_matcher(llm):
    outputs = llm.generate("Hi", _json(SCHEMA, temperature=1.0, seed=5, n=3))
    assert len(outputs) == 3 and len({o.text for o in outputs}) > 1
    for output in outputs:
        assert validation_errors(output.text, SCHEMA) is None, output.text


def test_ignore_eos_still_stops_once_the_grammar_is_complete(llm):
    params = SamplingParams(
        max_tokens=64, ignore_eos=True, structured_output=StructuredOutput.choice(["done"])
    )
    output = llm.generate("Hi", params)[0]
    assert (output.text, output.finish_reason) == ("done", "stop")


def test_a_grammar_that_fails_to_compile_ends_its_request_empty(llm):
    # The frontends refuse such a constraint (`check`); a direct engine user gets an empty stop.
    unsupported = StructuredOutput("json", '{"type": "no-such-type"}')
    with pytest.raises(InvalidRequestError, match="no-such-type"):
        check(unsupported)
    output = llm.generate("Hi", SamplingParams(max_tokens=8, structured_output=unsupported))[0]
    assert (output.text, output.finish_reason) == ("", "stop")


@pytest.mark.parametrize(
    ("structured", "reason"),
    [
        (StructuredOutput("xml", "<a/>"), "kind must be one of"),
        (StructuredOutput("json", "{not json"), "not JSON"),
        (StructuredOutput("json", "[1, 2]"), "object"),
        (StructuredOutput("json_object", "{}"), "takes no spec"),
        (StructuredOutput("choice", "[]"), "non-empty list"),
        (StructuredOutput("choice", '["a", ""]'), "non-empty string"),
        (StructuredOutput("grammar", "  "), "must not be empty"),
        (StructuredOutput("regex", "a" * 70_000), "at most"),
    ],
)
def test_a_constraint_no_grammar_comes_from_is_refused_naming_the_field(structured, reason):
    with pytest.raises(InvalidRequestError, match=reason) as raised:
        SamplingParams(structured_output=structured)
    assert raised.value.field == "structured_output"


@pytest.mark.parametrize(
    ("structured", "reason"),
    [
        (StructuredOutput("json", '{"type": "integer", "minimum": 5, "maximum": 1}'), "range"),
        (StructuredOutput("regex", "(("), "parenthesis"),
        (StructuredOutput("grammar", "root ::= undefined_rule"), "not defined"),
    ],
)
def test_check_names_what_xgrammar_refuses(structured, reason):
    with pytest.raises(InvalidRequestError, match=reason) as raised:
        check(structured)
    assert raised.value.field == "structured_output" and "json_schema_converter" not in str(
        raised.value
    )


def test_utf8_guard_allows_only_bytes_that_keep_the_text_decodable():
    guard = Utf8Guard([bytes([b]) for b in range(256)] + [b"\xc3\xa9", b""], 258)
    allowed = [set(np.nonzero(guard.next_state[s] != INVALID)[0]) for s in range(8)]
    assert allowed[0] == set(range(0x80)) | set(range(0xC2, 0xF5)) | {256, 257}
    assert allowed[4] == set(range(0xA0, 0xC0)) | {257}  # after E0: no overlong form
    assert allowed[5] == set(range(0x80, 0xA0)) | {257}  # after ED: no surrogate
    state = guard.advance(guard.advance(0, 0xF0), 0x9F)
    assert guard.advance(guard.advance(state, 0x98), 0x80) == 0  # U+1F600 in four tokens
    words = guard.masks[0].numpy().view(np.uint32)
    assert [int(words[t // 32] >> (t % 32) & 1) for t in (0x41, 0x80, 0xC2, 256)] == [1, 0, 1, 1]
