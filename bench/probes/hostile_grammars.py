"""Fifty structured-output specs built to be expensive (issue 53): long length bounds, nested
counted repetitions, deep nesting, huge enums and choices, catastrophic regular expressions.
Each is one request's constraint, kept as JSON text (a schema nested thousands deep is past
Python's own `json.dumps`); the HTTP and gRPC tests and `bench hostile-grammars` send them all.
"""

from __future__ import annotations

import json


def _string(**keywords) -> dict:
    return {"type": "object", "properties": {"a": {"type": "string", **keywords}}}


def _nested_objects(depth: int) -> str:
    opening = '{"type": "object", "required": ["a"], "properties": {"a": '
    return opening * depth + '{"type": "string"}' + "}}" * depth


def _nested_arrays(depth: int) -> str:
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


def _enum(count: int, width: int) -> dict:
    return {
        "type": "object",
        "properties": {"a": {"enum": [f"{i:0{width}d}" for i in range(count)]}},
    }


def _any_of(count: int) -> dict:
    return {"anyOf": [{"const": f"v{i}"} for i in range(count)]}


def _patterns(count: int, pattern: str) -> dict:
    return {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": pattern} for i in range(count)},
    }


SCHEMAS: list[tuple[str, dict | str]] = [
    # Long bounds.
    ("maxLength 10^8", _string(maxLength=10**8)),
    ("minLength 10^6", _string(minLength=10**6)),
    ("minLength=maxLength 10^5", _string(minLength=100_000, maxLength=100_000)),
    ("maxItems 10^7", {"type": "array", "items": {"type": "integer"}, "maxItems": 10**7}),
    ("minItems 10^6", {"type": "array", "items": {"type": "string"}, "minItems": 10**6}),
    ("maxProperties 10^6", {"type": "object", "maxProperties": 10**6}),
    ("pattern a{1,10^6}", _string(pattern="a{1,1000000}")),
    ("pattern a{10^5}", _string(pattern="a{100000}")),
    (
        "200 strings of maxLength 10^5",
        {
            "type": "object",
            "properties": {f"s{i}": {"type": "string", "maxLength": 100_000} for i in range(200)},
        },
    ),
    # Nested counted repetitions (the issue's own first).
    ("(b{1,50000}){1,50000}", _string(pattern="(b{1,50000}){1,50000}")),
    ("((a{1,100}){1,100}){1,100}", _string(pattern="((a{1,100}){1,100}){1,100}")),
    ("(a{2,300}){2,300}", _string(pattern="(a{2,300}){2,300}")),
    ("(b{1,10}){1,1000}", _string(pattern="(b{1,10}){1,1000}")),
    ("(ab{1,64}c){1,64}", _string(pattern="(ab{1,64}c){1,64}")),
    ("(x{0,4096}y){0,2}", _string(pattern="(x{0,4096}y){0,2}")),
    ("60 patterns (b{1,60}){1,60}", _patterns(60, "(b{1,60}){1,60}")),
    ("[a-z]{1,99999} 3 times", _patterns(3, "[a-z]{1,99999}")),
    # Deep nesting.
    ("objects nested 40", _nested_objects(40)),
    ("objects nested 2000", _nested_objects(2000)),
    ("arrays nested 5000", _nested_arrays(5000)),
    ("groups nested 500", _string(pattern="(" * 500 + "a" + ")" * 500)),
    ("groups nested 33", _string(pattern="(" * 33 + "a" + ")" * 33)),
    (
        "$ref chain 30",
        {
            "$defs": {
                f"d{i}": {"type": "object", "properties": {"n": {"$ref": f"#/$defs/d{i + 1}"}}}
                for i in range(30)
            }
            | {"d30": {"type": "string"}},
            "$ref": "#/$defs/d0",
        },
    ),
    (
        "self-recursive $ref",
        {
            "$defs": {
                "t": {
                    "type": "object",
                    "properties": {"l": {"$ref": "#/$defs/t"}, "r": {"$ref": "#/$defs/t"}},
                }
            },
            "$ref": "#/$defs/t",
        },
    ),
    # Huge enums.
    ("enum of 4097", _enum(4097, 4)),
    ("enum of 100000", _enum(100_000, 6)),
    ("enum of 4096 long values", _enum(4096, 12)),
    ("anyOf 5000 consts", _any_of(5000)),
    ("oneOf 3000 objects", {"oneOf": [_string(maxLength=i + 1) for i in range(3000)]}),
    # Catastrophic regular expressions (for a backtracking engine) and wide alternations.
    ("(a+)+b", _string(pattern="(a+)+b")),
    ("(a|aa)*c", _string(pattern="(a|aa)*c")),
    ("(.*a){20}", _string(pattern="(.*a){20}")),
    ("(x+x+)+y", _string(pattern="(x+x+)+y")),
    ("^(([a-z])+.)+[A-Z]([a-z])+$", _string(pattern="^(([a-z])+.)+[A-Z]([a-z])+$")),
    (
        "(a|b|...){5000 alternatives}",
        _string(pattern="(" + "|".join(f"w{i}" for i in range(5000)) + ")"),
    ),
    ("(.*){1,4096}", _string(pattern="(.*){1,4096}")),
    ("([ab]*[ab]*)*c{1,4000}", _string(pattern="([ab]*[ab]*)*c{1,4000}")),
]
REGEXES: list[tuple[str, str]] = [
    ("regex (b{1,50000}){1,50000}", "(b{1,50000}){1,50000}"),
    ("regex a{1,2000000}", "a{1,2000000}"),
    ("regex groups nested 1000", "(" * 1000 + "a" + ")" * 1000),
    ("regex ((a|b){1,64}){1,64}", "((a|b){1,64}){1,64}"),
    ("regex (a*)*b", "(a*)*b"),
]
GRAMMARS: list[tuple[str, str]] = [
    ("ebnf x{1,50000} nested", 'root ::= ("a"{1,50000}){1,50000}'),
    (
        "ebnf rule chain 5000",
        "root ::= r0\n"
        + "".join(f'r{i} ::= r{i + 1} "x"\n' for i in range(5000))
        + 'r5000 ::= "y"',
    ),
    ("ebnf nested parens 800", "root ::= " + "(" * 800 + '"a"' + ")" * 800),
    ("ebnf 10000 alternatives", "root ::= " + " | ".join(f'"w{i}"' for i in range(10000))),
]
CHOICES: list[tuple[str, list[str]]] = [
    ("choice of 100000", [f"c{i}" for i in range(100_000)]),
    ("choice of 5000 long", [f"{i:040d}" for i in range(5000)]),
]
TOOL_SCHEMAS: list[tuple[str, dict | str]] = [
    ("tool parameters (b{1,50000}){1,50000}", _string(pattern="(b{1,50000}){1,50000}")),
    ("tool parameters nested 3000", _nested_objects(3000)),
]


def _text(schema: dict | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema)


def http_bodies(model: str) -> list[tuple[str, str, bytes]]:
    """(name, the constraint's field, a chat completion body as JSON bytes) for each spec."""
    head = json.dumps(
        {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    )[:-1]

    def body(field: str, value: str) -> bytes:
        return f"{head}, {json.dumps(field)}: {value}}}".encode()

    bodies = [
        (
            name,
            "response_format",
            body(
                "response_format",
                (
                    '{"type": "json_schema", "json_schema": {"name": "x", "schema": '
                    f"{_text(schema)}}}}}"
                ),
            ),
        )
        for name, schema in SCHEMAS
    ]
    for field, specs in (("guided_regex", REGEXES), ("guided_grammar", GRAMMARS)):
        bodies += [(name, field, body(field, json.dumps(spec))) for name, spec in specs]
    bodies += [(n, "guided_choice", body("guided_choice", json.dumps(c))) for n, c in CHOICES]
    for name, schema in TOOL_SCHEMAS:
        tool = (
            f'[{{"type": "function", "function": {{"name": "f", "parameters": {_text(schema)}}}}}]'
        )
        bodies.append((name, "tools", body("tools", tool)[:-1] + b', "tool_choice": "required"}'))
    return bodies


def grpc_constraints() -> list[tuple[str, str, str]]:
    """(name, the StructuredOutput kind, its spec) for each hostile spec gRPC can carry."""
    specs = [(name, "json", _text(schema)) for name, schema in SCHEMAS]
    specs += [(name, "regex", spec) for name, spec in REGEXES]
    specs += [(name, "grammar", spec) for name, spec in GRAMMARS]
    specs += [(name, "choice", json.dumps(spec)) for name, spec in CHOICES]
    return specs
