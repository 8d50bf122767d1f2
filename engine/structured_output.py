"""A request's structured-output constraint as plain data: which kind of grammar, and its text.

The grammar itself is built per worker from this (`engine/grammar.py`); here are only the checks
that need no grammar engine, so every part may hold and send one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.grammar_limits import check_limits

# json: a JSON schema; json_object: any JSON object (no spec); regex: a regular expression;
# choice: a JSON list of the strings allowed; grammar: an EBNF grammar (xgrammar's dialect).
KINDS = ("json", "json_object", "regex", "choice", "grammar")
# A frontend builds the grammar once to check it, in a process of its own under a deadline
# (~1 ms per KB of schema); what makes one large is limited in `grammar_limits`.
MAX_SPEC_CHARS = 64 * 1024
FIELD = "structured_output"


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """The output must match `spec`, read as `kind` says (one of `KINDS`)."""

    kind: str
    spec: str = ""

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(choices, ensure_ascii=False))

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec)

    def validate(self) -> None:
        """Raise `InvalidRequestError` for a kind or spec that no grammar can come from."""
        if self.kind not in KINDS:
            raise InvalidRequestError(FIELD, self.kind, f"kind must be one of {', '.join(KINDS)}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(
                FIELD, shown(self.spec), f"spec must be a string of at most {MAX_SPEC_CHARS} chars"
            )
        if self.kind == "json_object" and self.spec:
            raise InvalidRequestError(FIELD, shown(self.spec), "json_object takes no spec")
        check_limits(self.kind, self.spec, FIELD, shown(self.spec))
        if self.kind == "json":
            _check_schema(self.spec)
        if self.kind == "choice":
            _check_choices(self.spec)
        if self.kind == "grammar" and not self.spec.strip():
            raise InvalidRequestError(FIELD, self.spec, "the grammar must not be empty")


def _check_schema(spec: str) -> None:
    try:
        schema = json.loads(spec)
    except ValueError as error:
        raise InvalidRequestError(FIELD, shown(spec), f"not JSON: {error}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(FIELD, shown(spec), "a JSON schema is an object (or a bool)")


def _check_choices(spec: str) -> None:
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices:
        raise InvalidRequestError(FIELD, shown(spec), "choices must be a non-empty list")
    if not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError(FIELD, shown(spec), "each choice must be a non-empty string")


def shown(value: object, limit: int = 80) -> object:
    """`value` cut to `limit` characters for an error message (a schema may be long)."""
    if isinstance(value, str) and len(value) > limit:
        return f"{value[:limit]}...<{len(value)} chars>"
    return value
