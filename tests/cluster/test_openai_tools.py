"""Tool calling over the OpenAI API: `tools` and `tool_choice` checked naming the field at fault,
the tools and earlier calls rendered through the chat template (or, for a template without
them, a system message in Hermes' format), `required` and a named function constrained to valid
arguments, `auto` outputs read as Hermes or Llama 3 calls, and streams the `openai` SDK
accumulates into the same calls: with the official client, against a real HTTP server over a
LocalBackend (the tiny random model; `auto` outputs forced by a `guided_choice`), then once
against a disaggregated cluster."""

from __future__ import annotations

import json
import random

import openai
import pytest
from cluster_kit import running_cluster

from halfmoon.bench.probes.structured import validation_errors
from halfmoon.cluster.frontend.http_request import parse
from halfmoon.cluster.frontend.openai_schema import ChatCompletionRequest
from halfmoon.cluster.frontend.openai_tool_calls import ToolCalling, read_auto
from halfmoon.cluster.frontend.openai_tool_prompt import TOOLS_PROMPT, render_with_tools
from halfmoon.engine.init_model import build_tokenizer

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
TIME_PARAMETERS = {
    "type": "object",
    "properties": {"zone": {"type": "string", "maxLength": 6}, "hours": {"type": "integer"}},
    "required": ["zone"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "now", "parameters": WEATHER_PARAMETERS},
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
NAMES = ("get_weather", "get_time")
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
    "\n</tool_call>"
)
LLAMA3 = '{"name": "get_time", "parameters": {"zone": "CET"}}'
HISTORY = [
    *MESSAGES,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
]
# A template that renders tools and calls itself, as Hermes-style checkpoints' do.
NATIVE_TEMPLATE = (
    "{% if tools %}<|system|>TOOLS{% for t in tools %} {{ t.function.name }}{% endfor %}</s>"
    "{% endif %}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
    "{{ c.function.arguments | tojson }}{% endfor %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def _call(message) -> tuple[str, dict]:
    """A message's one call as (name, arguments); its arguments must validate."""
    assert message.content is None
    [call] = message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and len(call.id) == 29
    assert validation_errors(call.function.arguments, SCHEMAS[call.function.name]) is None
    return call.function.name, json.loads(call.function.arguments)


def _accumulate(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """What a client keeps of a stream's delta bodies: the content, and each call (by index)
    with its id, name and arguments concatenated, as the `openai` SDK accumulates them."""
    content, calls = None, {}
    for delta in deltas:
        if "content" in delta:
            content = (content or "") + delta["content"]
        for part in delta.get("tool_calls", []):
            call = calls.setdefault(part["index"], {"arguments": ""})
            call.update({k: part[k] for k in ("id", "type") if k in part})
            call.setdefault("name", part["function"].get("name"))
            call["arguments"] += part["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def _as_read(content: str | None, calls) -> tuple[str | None, list[tuple[str, str]]]:
    return content, [(c.name, c.arguments) for c in calls]


def _streamed(calling: ToolCalling, pieces: list[str]):
    stream = calling.stream()
    deltas = [d for i, p in enumerate(pieces) for d in stream.feed(p, i == len(pieces) - 1)]
    content, calls = _accumulate(deltas)
    return content, [(c["name"], c["arguments"]) for c in calls], stream.called


def _split(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        (HERMES, None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
        (
            "Let me see.\n" + HERMES + '\n<tool_call>{"name": "get_time", "arguments": {}}',
            "Let me see.\n\n",
            [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")],
        ),
        (LLAMA3, None, [("get_time", '{"zone": "CET"}')]),
        (
            ' <|python_tag|>{"name": "get_time", "parameters": {}}; ' + LLAMA3,
            None,
            [("get_time", "{}"), ("get_time", '{"zone": "CET"}')],
        ),
        ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', None, []),
        ("<tool_call>{not json}</tool_call>", None, []),
        ('{"name": "get_time"}', None, []),
        ('{"name": "get_time", "parameters": {}} and more', None, []),
        ("Sunny, 18 C.", None, []),
    ],
)
def test_auto_reads_hermes_and_llama3_calls_of_known_functions(text, content, calls):
    got_content, got_calls = read_auto(text, NAMES)
    expected_content = content if calls else text
    assert _as_read(got_content, got_calls) == (expected_content, calls)


@pytest.mark.parametrize(
    ("calling", "text"),
    [
        (ToolCalling("auto", NAMES), HERMES),
        (ToolCalling("auto", NAMES), "Checking.\n" + HERMES + "\nDone."),
        (ToolCalling("auto", NAMES), "\n " + LLAMA3),
        (ToolCalling("auto", NAMES), "A <tool_ca is not a call; {neither} is this."),
        (ToolCalling("auto", NAMES), '{"a": 1}'),
        (ToolCalling("required", NAMES), '{"name": "get_time", "arguments": {"zone": "}"}}'),
        (ToolCalling("required", NAMES), '{"name": "get_weather", "arguments": {"city": "Pa'),
        (ToolCalling("required", NAMES), '{"name": "get_we'),
        (ToolCalling("named", ("get_time",)), '{"zone": "UTC", "hours": 2}'),
    ],
)
def test_a_stream_split_anywhere_accumulates_to_the_whole_outputs_reading(calling, text):
    content, calls = calling.read(text)
    whole = _as_read(content, calls)
    rng = random.Random(0)
    for pieces in [[text], list(text), *(_split(text, rng) for _ in range(20))]:
        got_content, got_calls, called = _streamed(calling, pieces)
        assert (got_content, got_calls) == whole, pieces
        assert called == bool(calls)


def test_a_template_without_tools_gets_them_in_a_system_message_in_hermes_format():
    tokenizer = build_tokenizer()  # the tiny model's: it renders role and content only
    messages = [{"role": "system", "content": "Be brief."}, *_for_template(HISTORY)]
    token_ids = render_with_tools(tokenizer, messages, TOOLS)
    tools = "\n".join(json.dumps(tool) for tool in TOOLS)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    results = "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nsunny\n</tool_response>"
    expected = (
        f"<|system|>Be brief.\n\n{TOOLS_PROMPT.format(tools=tools)}</s>"
        f"<|user|>What is the weather in Paris?</s><|assistant|>{call}</s>"
        f"<|user|>{results}</s><|assistant|>"
    )
    assert tokenizer.decode(token_ids) == expected


def test_a_template_that_renders_tools_is_given_them_and_the_calls_as_objects():
    tokenizer = build_tokenizer()
    tokenizer.chat_template = NATIVE_TEMPLATE
    token_ids = render_with_tools(tokenizer, _for_template(HISTORY), TOOLS)
    expected = (
        "<|system|>TOOLS get_weather get_time</s><|user|>What is the weather in Paris?</s>"
        '<|assistant|>CALL get_weather {"city": "Paris"}</s><|tool|>18 C</s><|tool|>sunny</s>'
        "<|assistant|>"
    )
    assert tokenizer.decode(token_ids) == expected


def _request(**body) -> ChatCompletionRequest:
    return parse(ChatCompletionRequest, json.dumps({"messages": MESSAGES, **body}).encode())


def _for_template(messages: list[dict]) -> list[dict]:
    return _request(messages=messages).to_prompt()


def test_required_is_constrained_to_one_call_of_any_tool_and_a_named_one_to_its_arguments():
    required = json.loads(_request(tools=TOOLS, tool_choice="required").structured_output().spec)
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": SCHEMAS[name]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name in NAMES
    ]
    assert required == {"anyOf": calls}
    chosen = _request(tools=TOOLS, tool_choice=named("get_time")).structured_output()
    assert json.loads(chosen.spec) == TIME_PARAMETERS
    bare = {"type": "function", "function": {"name": "ping"}}
    assert json.loads(
        _request(tools=[bare], tool_choice=named("ping")).structured_output().spec
    ) == {
        "type": "object",
        "properties": {},
    }
    for choice in ("auto", "none", None):
        assert _request(tools=TOOLS, tool_choice=choice).structured_output() is None


def _chat(oai, api, **kwargs):
    body = {"model": api.model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 120}
    return oai.chat.completions.create(**(body | kwargs))


def _final(oai, api, **kwargs):
    body = {"model": api.model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 120}
    with oai.chat.completions.stream(**(body | kwargs)) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion().choices[0]


def test_a_named_function_is_called_with_arguments_valid_against_its_schema(oai, api):
    for seed in range(4):
        choice = _chat(oai, api, tool_choice=named("get_weather"), seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls"
        name, arguments = _call(choice.message)
        assert name == "get_weather" and set(arguments) == {"city", "unit"}


def test_required_makes_one_valid_call_of_one_of_the_tools(oai, api):
    names = set()
    for seed in range(6):
        choice = _chat(oai, api, tool_choice="required", seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls"
        names.add(_call(choice.message)[0])
    assert names <= set(NAMES) and names


@pytest.mark.parametrize("tool_choice", ["required", named("get_time")])
def test_a_streamed_call_accumulates_to_the_whole_responses_call(oai, api, tool_choice):
    for seed in range(3):
        whole = _chat(oai, api, tool_choice=tool_choice, seed=seed).choices[0]
        streamed = _final(oai, api, tool_choice=tool_choice, seed=seed)
        assert streamed.finish_reason == whole.finish_reason == "tool_calls"
        assert _call(streamed.message) == _call(whole.message)


@pytest.mark.parametrize(
    ("forced", "content", "call"),
    [
        (HERMES, None, ("get_weather", {"city": "Paris", "unit": "celsius"})),
        ("On it. " + HERMES, "On it. ", ("get_weather", {"city": "Paris", "unit": "celsius"})),
        (LLAMA3, None, ("get_time", {"zone": "CET"})),
        ("No call here.", "No call here.", None),
    ],
)
def test_auto_reads_the_models_hermes_or_llama3_calls_whole_and_streamed(
    oai, api, forced, content, call
):
    # The tiny model writes `forced`, made to by a one-choice grammar.
    extra = {"tool_choice": "auto", "extra_body": {"guided_choice": [forced]}}
    for choice in (_chat(oai, api, **extra).choices[0], _final(oai, api, **extra)):
        assert choice.message.content == content
        if call is None:
            assert not choice.message.tool_calls and choice.finish_reason == "stop"
            continue
        assert choice.finish_reason == "tool_calls"
        [got] = choice.message.tool_calls
        assert (got.function.name, json.loads(got.function.arguments)) == call


def test_tool_choice_none_leaves_a_call_in_the_text(oai, api):
    extra = {"tool_choice": "none", "extra_body": {"guided_choice": [HERMES]}}
    choice = _chat(oai, api, **extra).choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (HERMES, None)
    assert choice.finish_reason == "stop"


def test_a_history_of_calls_and_results_is_rendered_by_the_template(oai, api, tiny_model_dir):
    answer = _chat(oai, api, messages=HISTORY, tools=TOOLS, max_tokens=4, tool_choice="none")
    prompt = render_with_tools(build_tokenizer(), _for_template(HISTORY), TOOLS)
    assert answer.usage.prompt_tokens == len(prompt)
    without_tools = _chat(oai, api, messages=HISTORY, tools=openai.NOT_GIVEN, max_tokens=4)
    bare = render_with_tools(build_tokenizer(), _for_template(HISTORY), [])
    assert without_tools.usage.prompt_tokens == len(bare) < len(prompt)


@pytest.mark.parametrize(
    ("body", "param", "reason"),
    [
        ({"tool_choice": named("launch")}, "tool_choice", "names no function in tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": None, "tool_choice": named("get_time")}, "tool_choice", "needs tools"),
        ({"tool_choice": "sometimes"}, "tool_choice", '"required"'),
        ({"tool_choice": {"type": "function"}}, "tool_choice", '"required"'),
        ({"tools": [WEATHER, WEATHER]}, "tools", "names a function twice"),
        ({"tools": 5}, "tools", "valid array"),
        ({"tools": [{"type": "retrieval"}]}, "tools.0.type", "'function'"),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "required"),
        (
            {"tools": [{"type": "function", "function": {"name": "a b"}}]},
            "tools.0.function.name",
            "pattern",
        ),
        (
            {"tools": [TIME, {"type": "function", "function": {"name": "f", "parameters": 1}}]},
            "tools.1.function.parameters",
            "an object",
        ),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
                ]
            },
            "tools.0.function.parameters",
            '"type": "object"',
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"properties": {"a": {"type": "bogus"}}},
                        },
                    }
                ]
            },
            "tools.0.function.parameters",
            "bogus",
        ),
        (
            {"tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "response_format",
        ),
        ({"tools": None, "functions": [{"name": "f"}]}, "functions", "tools"),
        ({"tools": None, "function_call": {"name": "f"}}, "function_call", "tools"),
        (
            {
                "messages": [
                    {
                        "role": "assistant",
                        "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}],
                    }
                ]
            },
            "messages.0.tool_calls.0.function.arguments",
            "JSON object",
        ),
    ],
)
def test_a_bad_tool_field_is_a_400_naming_it(api, oai, body, param, reason):
    fields = {"model": api.model, "messages": MESSAGES, "tools": TOOLS, "max_tokens": 2} | body
    with pytest.raises(openai.BadRequestError) as raised:
        oai.chat.completions.create(**{k: v for k, v in fields.items() if v is not None})
    error = raised.value.body
    assert (error["param"], error["code"]) == (param, "invalid_argument"), error
    assert reason in error["message"]


def test_legacy_functions_with_function_call_none_are_still_ignored(oai, api):
    answer = _chat(
        oai,
        api,
        tools=openai.NOT_GIVEN,
        max_tokens=2,
        functions=[{"name": "f"}],
        function_call="none",
    )
    assert answer.choices[0].message.tool_calls is None


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_calls_through_a_disaggregated_cluster_validate_and_stream_alike(
    ray_session, tiny_model_dir
):
    with running_cluster(tiny_model_dir, served_model_name="tiny") as (cluster, _):
        url = f"http://127.0.0.1:{cluster.ports['http_port']}/v1"
        with openai.OpenAI(base_url=url, api_key="unused", max_retries=0) as client:
            body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 120}
            for tool_choice in ("required", named("get_weather")):
                whole = client.chat.completions.create(**body, tool_choice=tool_choice, seed=1)
                with client.chat.completions.stream(**body, tool_choice=tool_choice, seed=1) as s:
                    streamed = s.get_final_completion().choices[0]
                assert _call(whole.choices[0].message) == _call(streamed.message)
            forced = client.chat.completions.create(**body, extra_body={"guided_choice": [HERMES]})
            [call] = forced.choices[0].message.tool_calls
            assert call.function.name == "get_weather"
