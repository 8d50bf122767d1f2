"""Tool calling, the request's side: `tools` and `tool_choice` checked (each function's
parameters by the grammar engine), the assistant's earlier calls in `messages`, and the
constraint `required` and a named function put on the output: the arguments, valid against
the function's parameters."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from halfmoon.cluster.frontend.openai_tool_calls import ToolCalling
from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.structured_output import StructuredOutput, shown

STRICT = ConfigDict(extra="forbid", strict=True)
ECHOED = ConfigDict(extra="ignore", strict=True)  # what a client echoes back from a response
NO_PARAMETERS = {"type": "object", "properties": {}}
CHOICES = 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


class FunctionDefinition(BaseModel):
    """A function the model may call; `parameters` is the JSON schema of its arguments (an
    object), enforced whenever the output is constrained to a call, `strict` or not."""

    model_config = STRICT

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def arguments_schema(self) -> dict[str, Any]:
        """The schema of the arguments; none given is an object without properties."""
        return {**NO_PARAMETERS, **(self.parameters or {})}


class Tool(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = STRICT

    name: str


class NamedToolChoice(BaseModel):
    model_config = STRICT

    type: Literal["function"]
    function: FunctionName


def _one_of(value: Any, handler) -> Any:
    try:
        return handler(value)
    except ValidationError:
        raise PydanticCustomError("union_type", CHOICES) from None


ToolChoiceField = Annotated[
    Literal["none", "auto", "required"] | NamedToolChoice, WrapValidator(_one_of)
]


class CalledFunction(BaseModel):
    model_config = ECHOED

    name: str
    arguments: str

    @field_validator("arguments")
    @classmethod
    def _an_object(cls, arguments: str) -> str:
        try:
            value = json.loads(arguments)
        except ValueError:
            value = None
        if not isinstance(value, dict):
            raise ValueError(f"{shown(arguments)!r} is not a JSON object as text")
        return arguments


class MessageToolCall(BaseModel):
    """A call in an assistant message of the history, as a response gave it."""

    model_config = ECHOED

    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction

    def for_template(self) -> dict:
        """The call as chat templates read it: its arguments an object, not JSON text."""
        function = {"name": self.function.name, "arguments": json.loads(self.function.arguments)}
        call = {"type": "function", "function": function}
        return call if self.id is None else {"id": self.id, **call}


class ToolFields(BaseModel):
    """A chat request's tool fields: the functions the model may call and which it must."""

    tools: list[Tool] | None = None
    tool_choice: ToolChoiceField | None = None

    @model_validator(mode="after")
    def _check_tools(self) -> ToolFields:
        names = [tool.function.name for tool in self.tools or []]
        for i, tool in enumerate(self.tools or []):
            if names.index(tool.function.name) != i:
                raise InvalidRequestError("tools", tool.function.name, "names a function twice")
            _check_parameters(f"tools.{i}.function.parameters", tool.function)
        _check_choice(self.tool_choice, names)
        return self

    def tool_calling(self) -> ToolCalling | None:
        """How the outputs become calls; None when the model may call nothing."""
        choice = self.tool_choice or "auto"
        if not self.tools or choice == "none":
            return None
        if isinstance(choice, NamedToolChoice):
            return ToolCalling("named", (choice.function.name,))
        return ToolCalling(choice, tuple(tool.function.name for tool in self.tools))

    def tool_constraint(self) -> StructuredOutput | None:
        """The output's grammar for `required` (an object of a function's name and arguments)
        and a named function (its arguments); None for `auto` and `none`."""
        calling = self.tool_calling()
        if calling is None or calling.mode == "auto":
            return None
        functions = {tool.function.name: tool.function for tool in self.tools}
        if calling.mode == "named":
            return _json(functions[calling.names[0]].arguments_schema())
        calls = [_call_schema(name, functions[name]) for name in calling.names]
        return _json(calls[0] if len(calls) == 1 else {"anyOf": calls})

    def tool_grammars(self) -> list[tuple[str, StructuredOutput]]:
        """Each function's arguments schema, whose grammar the frontend builds (`auto` holds
        a call's arguments to it too)."""
        return [
            (f"tools.{i}.function.parameters", _json(tool.function.arguments_schema()))
            for i, tool in enumerate(self.tools or [])
        ]

    def tools_for_template(self) -> list[dict]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools or []]


def _check_parameters(field: str, function: FunctionDefinition) -> None:
    parameters = function.parameters or {}
    if parameters.get("type", "object") != "object":
        raise InvalidRequestError(
            field, shown(json.dumps(parameters)), 'must describe an object ("type": "object")'
        )
    try:
        _json(function.arguments_schema()).validate()
    except InvalidRequestError as error:
        raise error.renamed(field) from None


def _check_choice(choice: str | NamedToolChoice | None, names: list[str]) -> None:
    if choice in (None, "none", "auto"):
        return
    if not names:
        raise InvalidRequestError("tool_choice", _shown(choice), "needs tools to choose from")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequestError(
            "tool_choice", choice.function.name, f"names no function in tools ({names})"
        )


def _call_schema(name: str, function: FunctionDefinition) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": function.arguments_schema()},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _json(schema: dict) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema, ensure_ascii=False))


def _shown(choice: Any) -> Any:
    return choice.model_dump() if isinstance(choice, BaseModel) else choice
