"""Tool calling, the response's side: a choice's output read as `tool_calls`, whole or streamed
as the deltas the `openai` SDK accumulates (a call's `index`, `id`, `type` and `function.name`
first, then `function.arguments` in fragments)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

HERMES_OPEN = "<tool_call>"
PYTHON_TAG = "<|python_tag|>"  # Llama 3.1's mark before a call
# A Hermes block; the last one may be cut before its closing tag.
HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
# `required`'s output up to its arguments: {"name": "NAME", "arguments": ... (the grammar writes
# the name first); matched only once the arguments' first character is there.
REQUIRED_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]+)"\s*,\s*"arguments"\s*:\s*(?=\S)')
ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes' name, Llama 3's


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(slots=True)
class ToolCall:
    """One call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def as_json(self) -> dict:
        function = {"name": self.name, "arguments": self.arguments}
        return {"id": self.id, "type": "function", "function": function}

    def as_delta(self, index: int) -> dict:
        return {"tool_calls": [{"index": index, **self.as_json()}]}


def arguments_delta(index: int, arguments: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


def finish_reason(called: bool, reason: str | None) -> str | None:
    """`tool_calls` for an output that ended as calls; a cut one keeps `length`."""
    return "tool_calls" if called and reason == "stop" else reason


@dataclass(frozen=True, slots=True)
class ToolCalling:
    """How one request's outputs become calls. `mode`: `named` (the output is the arguments of
    `names[0]`), `required` (an object of a name and its arguments) or `auto` (text, parsed for
    Hermes or Llama 3 calls of the functions in `names`)."""

    mode: str
    names: tuple[str, ...]

    def read(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole output as its content (None when there is none) and its calls."""
        if self.mode == "named":
            return None, [ToolCall(self.names[0], text)]
        if self.mode == "required":
            return read_required(text, self.names)
        return read_auto(text, self.names)

    def stream(self) -> CallStream:
        """A reader of one choice's output as it streams."""
        if self.mode == "named":
            return NamedStream(self.names[0])
        if self.mode == "required":
            return RequiredStream(self)
        return AutoStream(self)


def read_required(text: str, names: tuple[str, ...]) -> tuple[str | None, list[ToolCall]]:
    head = REQUIRED_HEAD.match(text)
    if head is None or head.group(1) not in names:  # cut before the arguments began
        return text, []
    return None, [ToolCall(head.group(1), _required_arguments(text, head.end(), True))]


def _required_arguments(text: str, start: int, finished: bool) -> str:
    """The arguments' text: all after the head but the object's closing brace, which is the last
    character once the output is complete (no whitespace follows it); a cut output keeps all."""
    arguments = text[start:]
    if not finished or _is_json(text):
        return arguments[:-1]
    return arguments


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def read_auto(text: str, names: tuple[str, ...]) -> tuple[str | None, list[ToolCall]]:
    """Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (the text around
    them is the content), else Llama 3's bare `{"name": ..., "parameters": {...}}` objects (the
    whole output, `;`-separated); calls of functions not in `names` make it plain text."""
    bodies = HERMES_BLOCK.findall(text)
    calls = [_call(_loads(body), names) for body in bodies]
    if calls and all(calls):
        content = HERMES_BLOCK.sub("", text)
        return (content if content.strip() else None), calls
    calls = _llama3_calls(text, names)
    return (None, calls) if calls else (text, [])


def _llama3_calls(text: str, names: tuple[str, ...]) -> list[ToolCall]:
    rest = text.strip().removeprefix(PYTHON_TAG).strip()
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(rest):
        try:
            value, at = decoder.raw_decode(rest, at)
        except ValueError:
            return []
        if (call := _call(value, names)) is None:
            return []
        calls.append(call)
        at = len(rest) - len(rest[at:].lstrip().removeprefix(";").lstrip())
    return calls


def _loads(body: str) -> object:
    try:
        return json.loads(body)
    except ValueError:
        return None


def _call(value: object, names: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = next((value[key] for key in ARGUMENT_KEYS if key in value), None)
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class NamedStream:
    """A named function's arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.call = ToolCall(name, "")
        self.called = False

    def feed(self, text: str, finished: bool) -> list[dict]:
        """The delta bodies `text`, the output's next piece, adds (`finished`: the last piece)."""
        if not self.called:
            self.called = True
            return [ToolCall(self.call.name, text, self.call.id).as_delta(0)]
        return [arguments_delta(0, text)] if text else []


class RequiredStream:
    """`required`'s output: held until the function's name is complete, then its arguments
    streamed one character behind (the last may be the object's closing brace)."""

    def __init__(self, calling: ToolCalling) -> None:
        self.names = calling.names
        self.text = ""
        self.call: ToolCall | None = None
        self.start = 0  # where the arguments begin in `text`
        self.num_sent = 0  # characters of the arguments sent
        self.called = False

    def feed(self, text: str, finished: bool) -> list[dict]:
        self.text += text
        if self.call is None:
            head = REQUIRED_HEAD.match(self.text)
            if head is None or head.group(1) not in self.names:
                return [{"content": self.text}] if finished and self.text else []
            self.call, self.start = ToolCall(head.group(1), ""), head.end()
        arguments = _required_arguments(self.text, self.start, finished)
        piece, self.num_sent = arguments[self.num_sent :], len(arguments)
        if not self.called:
            self.called = True
            return [ToolCall(self.call.name, piece, self.call.id).as_delta(0)]
        return [arguments_delta(0, piece)] if piece else []


class AutoStream:
    """`auto`'s output: text streams as content until a call may begin (a `<tool_call>` tag, or
    an output opening with `{` or `<|python_tag|>`); from there it is held, and read at the end."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self.text = ""
        self.num_sent = 0  # characters of `text` sent as content
        self.called = False

    def feed(self, text: str, finished: bool) -> list[dict]:
        self.text += text
        if finished:
            return self._finish()
        end = self._safe_end()
        if not self.text[:end].strip():  # nothing but whitespace yet: a call may still open
            return []
        piece, self.num_sent = self.text[self.num_sent : end], end
        return [{"content": piece}] if piece else []

    def _safe_end(self) -> int:
        """Where a call may begin: the text before it is content whatever comes next."""
        text = self.text
        if self.num_sent == 0:
            lead = len(text) - len(stripped := text.lstrip())
            if stripped.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(stripped):
                return lead
        found = text.find(HERMES_OPEN, self.num_sent)
        if found >= 0:
            return found
        for size in range(min(len(text), len(HERMES_OPEN) - 1), 0, -1):
            if text.endswith(HERMES_OPEN[:size]):
                return len(text) - size
        return len(text)

    def _finish(self) -> list[dict]:
        content, calls = self.calling.read(self.text)
        self.called = bool(calls)
        rest = content[self.num_sent :] if content is not None else ""
        deltas = [{"content": rest}] if rest else []
        return deltas + [call.as_delta(index) for index, call in enumerate(calls)]


CallStream = NamedStream | RequiredStream | AutoStream
