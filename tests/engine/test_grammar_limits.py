"""The static limits on structured-output grammars (`engine/grammar_limits.py`): what makes a
grammar large is refused before one is built, naming the field and the limit; ordinary
constraints pass."""

from __future__ import annotations

import json

import pytest

from halfmoon.engine.errors import InvalidRequestError
from halfmoon.engine.grammar_limits import MAX_DEPTH, MAX_ENUM, check_regex
from halfmoon.engine.structured_output import StructuredOutput


def pattern(regex: str) -> str:
    return json.dumps({"type": "object", "properties": {"a": {"type": "string", "pattern": regex}}})


@pytest.mark.parametrize(
    ("kind", "spec", "reason"),
    [
        ("json", pattern("(b{1,50000}){1,50000}"), "repetition {1,50000} is over 4,096"),
        ("json", pattern("(b{1,4000}){1,4000}"), "make 16,000,000 copies"),
        ("json", pattern("(b{1,10}){1,1000}"), "nested counted repetitions make 10,000 copies"),
        ("regex", "((a{20}){20}){20}", "8,000 copies"),
        ("regex", "x{1,4097}", "repetition {1,4097} is over 4,096"),
        ("regex", "c{10000}", "repetition {10000} is over 4,096"),
        ("regex", "(a{1000}b){1,1000}", "1,000,000 copies"),
        ("regex", "a{4000}b{4000}c{4000}d{4000}e{4000}", "over 16,384 copies"),
        ("json", json.dumps({"type": "string", "maxLength": 5000}), "maxLength 5000 is over 4,096"),
        ("regex", "(" * 40 + "a" + ")" * 40, f"deeper than {MAX_DEPTH}"),
        ("json", json.dumps({"type": "string", "maxLength": 10**8}), "maxLength 100000000"),
        ("json", json.dumps({"type": "array", "minItems": 10**6}), "minItems 1000000"),
        ("json", "[" * 100 + "]" * 100, f"deeper than {MAX_DEPTH}"),
        ("json", '{"a":' * 5000 + "1" + "}" * 5000, f"deeper than {MAX_DEPTH}"),
        ("json", json.dumps({"enum": list(range(MAX_ENUM + 1))}), "an enum of 4,097 values"),
        ("json", json.dumps({"patternProperties": {"(x{99}){99}": {}}}), "9,801 copies"),
        ("choice", json.dumps([str(i) for i in range(MAX_ENUM + 1)]), "4,097 choices"),
        ("grammar", 'root ::= ("ab"{1,100}){1,100}', "10,000 copies"),
    ],
)
def test_large_grammars_are_refused_naming_the_limit(kind, spec, reason):
    with pytest.raises(InvalidRequestError, match="too large a grammar") as raised:
        StructuredOutput(kind, spec).validate()
    assert raised.value.field == "structured_output"
    assert reason in raised.value.allowed


@pytest.mark.parametrize(
    ("kind", "spec"),
    [
        ("json", pattern("^[a-z]{1,64}@[a-z]{2,16}\\.com$")),
        ("json", json.dumps({"type": "string", "maxLength": 4096})),
        ("json", json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 1000})),
        ("json", json.dumps({"enum": [f"v{i}" for i in range(1000)]})),
        ("json", json.dumps({"type": "object", "properties": {"a": {"enum": ["{9999999}"]}}})),
        ("regex", "(b{1,100}){1,40}"),
        ("regex", "[{}(]{5}\\{99999999\\}"),  # braces in a class or escaped count for nothing
        ("grammar", 'root ::= "{1,99999999}" [a-z]{1,8}'),
        ("choice", json.dumps(["yes", "no"])),
    ],
)
def test_ordinary_constraints_pass(kind, spec):
    StructuredOutput(kind, spec).validate()


def test_regex_copies_are_summed_and_nests_multiplied():
    assert check_regex("a{3}b{4}") == 7
    assert check_regex("(a{3}b){4}") == 3 + 12
    assert check_regex("[a{9}](c)") == 0
