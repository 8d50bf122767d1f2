"""The structured-output fields of an OpenAI request: OpenAI's `response_format` and vLLM's
`structured_outputs` and older `guided_*` extras, each turned into one `StructuredOutput` and
checked (its grammar built) before any worker sees the request."""

from __future__ import annotations

import json
from functools import partial
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.structured_output import StructuredOutput

STRICT = ConfigDict(extra="forbid", strict=True)
ONE_ONLY = "one structured-output constraint per request; {other} is set too"


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema is always enforced, `strict` or not."""

    model_config = STRICT

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = STRICT

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        schema = self.json_schema.schema_ if self.json_schema is not None else None
        if self.type == "json_schema" and not schema:
            raise InvalidRequestError(
                "response_format.json_schema.schema",
                None,
                'type "json_schema" needs json_schema.schema, a JSON schema object',
            )
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json, regex, choice, grammar, json_object."""

    model_config = STRICT

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # Taken and ignored: JSON never has free whitespace here, properties a schema does not
    # name are never generated unless it allows them, and there is one backend.
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    @model_validator(mode="after")
    def _supported(self) -> StructuredOutputs:
        for name in ("whitespace_pattern", "structural_tag"):
            if (value := getattr(self, name)) is not None:
                raise InvalidRequestError(f"structured_outputs.{name}", value, "not supported")
        return self

    def constraints(self) -> list[tuple[str, StructuredOutput]]:
        kinds = (self.json_, self.regex, self.choice, self.grammar)
        found = _constraints_of("structured_outputs.", *kinds)
        if self.json_object:
            found.append(("structured_outputs.json_object", StructuredOutput("json_object")))
        if not found:
            raise InvalidRequestError(
                "structured_outputs", {}, "set one of json, regex, choice, grammar, json_object"
            )
        return found


class StructuredOutputFields(BaseModel):
    """The request fields that constrain the output to a grammar; at most one may be set."""

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["auto", "xgrammar"] | None = None  # the one there is

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the request sets (None for none), checked against its limits
        (its grammar is built by `grammar_constraints`' caller); an `InvalidRequestError`
        names the field at fault."""
        found = self._constraints()
        if len(found) > 1:
            raise InvalidRequestError(found[1][0], "<set>", ONE_ONLY.format(other=found[0][0]))
        if not found:
            return None
        field, structured = found[0]
        try:
            structured.validate()
        except InvalidRequestError as error:
            raise error.renamed(field) from None
        return structured

    def grammar_constraints(self) -> list[tuple[str, StructuredOutput]]:
        """Each constraint whose grammar the frontend builds before serving the request, with
        the field a client named it by."""
        return self._constraints()[:1]

    def _constraints(self) -> list[tuple[str, StructuredOutput]]:
        found = []
        if self.response_format is not None and self.response_format.type != "text":
            found.append(_response_format(self.response_format))
        if self.structured_outputs is not None:
            found += self.structured_outputs.constraints()
        guided = (self.guided_json, self.guided_regex, self.guided_choice, self.guided_grammar)
        return found + _constraints_of("guided_", *guided)


def _constraints_of(
    prefix: str, json_: Any, regex: str | None, choice: list[str] | None, grammar: str | None
) -> list[tuple[str, StructuredOutput]]:
    """Each constraint set among a JSON schema, a regex, a choice and a grammar, named by
    `prefix` and its kind (`structured_outputs.json`, `guided_regex`)."""
    made = [
        ("json", json_, _json_schema),
        ("regex", regex, partial(StructuredOutput, "regex")),
        ("choice", choice, StructuredOutput.choice),
        ("grammar", grammar, partial(StructuredOutput, "grammar")),
    ]
    return [(prefix + kind, make(value)) for kind, value, make in made if value is not None]


def _response_format(response_format: ResponseFormat) -> tuple[str, StructuredOutput]:
    if response_format.type == "json_object":
        return "response_format", StructuredOutput("json_object")
    schema = response_format.json_schema.schema_
    return "response_format.json_schema.schema", _json_schema(schema)


def _json_schema(schema: dict[str, Any] | str) -> StructuredOutput:
    """A schema sent as an object or as JSON text; an object's key order is kept (xgrammar
    generates properties in the order the schema names them)."""
    text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False)
    return StructuredOutput("json", text)
