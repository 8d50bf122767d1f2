"""Chat messages with tools through the model's chat template (transformers'
`apply_chat_template(tools=...)`). A template that does not render tools, or the assistant's
calls, gets them as text in Hermes' format, which the `auto` reader parses: the tools in a
system message, each call a `<tool_call>` block, each result a `<tool_response>` block in a
user message."""

from __future__ import annotations

import json

from jinja2 import TemplateError

from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.tokenizer import DEFAULT_CHAT_TEMPLATE

TOOLS_PROMPT = (
    "You may call one or more functions to help with the user's request. The functions, as "
    "JSON schemas:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, answer with one <tool_call></tool_call> block per call, each holding "
    "a JSON object of the function's name and its arguments:\n"
    '<tool_call>\n{{"name": <function name>, "arguments": <arguments object>}}\n</tool_call>'
)
# A conversation only a template that renders tools and calls shows both names of.
PROBE_TOOL, PROBE_CALL = "halfmoon_probe_tool", "halfmoon_probe_call"
PROBE_TOOLS = [{"type": "function", "function": {"name": PROBE_TOOL, "parameters": {}}}]
PROBE_MESSAGES = [
    {"role": "user", "content": "?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            # 9 alphanumerics: Mistral's templates refuse any other id
            {
                "id": "probe0001",
                "type": "function",
                "function": {"name": PROBE_CALL, "arguments": {}},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "probe0001", "content": "!"},
]
_native: dict[str, bool] = {}  # a template's text -> whether it renders tools and calls


def render_with_tools(tokenizer, messages: list[dict], tools: list[dict]) -> list[int]:
    """The token ids of `messages` (OpenAI's, calls' arguments as objects) and `tools` through
    the model's chat template, the generation prompt added."""
    # None: transformers picks the checkpoint's own (its `tool_use` one, where it has several)
    template = None if tokenizer.chat_template else DEFAULT_CHAT_TEMPLATE
    if not renders_tools(tokenizer, template):
        messages, tools = as_text(messages, tools), None
    try:
        text = _render(tokenizer, template, messages, tools)
    except TemplateError as error:  # the template's own refusal (raise_exception), or its bug
        raise InvalidRequestError(
            "messages",
            f"<{len(messages)} messages>",
            f"the chat template cannot render them: {error}",
        ) from None
    return tokenizer.encode(text, add_special_tokens=False)  # what apply_chat_template does


def renders_tools(tokenizer, template: str | None) -> bool:
    """Whether the template shows the tools and the assistant's calls (probed once each)."""
    key = str(template or tokenizer.chat_template)
    if key not in _native:
        try:
            text = _render(tokenizer, template, PROBE_MESSAGES, PROBE_TOOLS)
        except Exception:  # noqa: BLE001 - a template that fails on tools cannot render them
            text = ""
        _native[key] = PROBE_TOOL in text and PROBE_CALL in text
    return _native[key]


def _render(tokenizer, template: str | None, messages: list[dict], tools: list[dict] | None) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, chat_template=template, add_generation_prompt=True, tokenize=False
    )


def as_text(messages: list[dict], tools: list[dict]) -> list[dict]:
    """`messages` for a template that knows neither tools nor calls: the tools in the system
    message, calls and results as Hermes' blocks (consecutive results in one user message)."""
    rendered = [_with_calls_as_text(message) for message in messages]
    if tools:
        rendered = _with_tools_in_system(rendered, tools)
    merged: list[dict] = []
    for i, message in enumerate(rendered):
        if message["role"] != "tool":
            merged.append(message)
            continue
        result = f"<tool_response>\n{message['content']}\n</tool_response>"
        if i and rendered[i - 1]["role"] == "tool":
            merged[-1]["content"] += "\n" + result
        else:
            merged.append({"role": "user", "content": result})
    return merged


def _with_calls_as_text(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return {"role": message["role"], "content": message["content"]}
    blocks = [
        "<tool_call>\n"
        + json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]})
        + "\n</tool_call>"
        for c in calls
    ]
    content = "\n".join(([message["content"]] if message["content"] else []) + blocks)
    return {"role": message["role"], "content": content}


def _with_tools_in_system(messages: list[dict], tools: list[dict]) -> list[dict]:
    described = TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool) for tool in tools))
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{described}"}, *messages[1:]]
    return [{"role": "system", "content": described}, *messages]
