"""Limits on what makes a structured-output grammar large, checked before any is built.

xgrammar expands a counted repetition `x{m,n}` of a regular expression (a JSON schema's
`pattern`, a `regex` constraint, an EBNF rule) into copies of `x`, so nested ones multiply:
`"pattern": "(b{1,50000}){1,50000}"` kept a server's event loop busy for minutes (issue 53);
`(b{1,10}){1,1000}` (10,000 copies) takes 0.7 s to build, `c{5000}` 1.5 s and `c{10000}` over
30 s (xgrammar 0.2.9 on a Zen 4 core; a string's length bounds become such a repetition). A
JSON text nested thousands deep overflows Python's recursion in `json.loads`. The limits here
are checked in one pass over the text, without recursion, wherever a `StructuredOutput` is
validated; the frontends then build the grammar in a separate process under a deadline
(`cluster/frontend/grammar_checks.py`) for what no static limit can foresee.
"""

from __future__ import annotations

import json
import re

from halfmoon.engine.errors import InvalidRequestError

# The largest bound of one counted repetition (a string's `maxLength` becomes one).
MAX_REPEAT = 4_096
# The copies nested counted repetitions make: the product of their upper bounds.
MAX_NESTED_REPEAT = 4_096
# All copies a spec's counted repetitions make, summed (each nested product counted).
MAX_TOTAL_REPEAT = 16_384
# Nesting of a JSON text (objects, arrays) and of a regular expression's groups.
MAX_DEPTH = 32
# Values of one `enum`, and choices of a `choice` constraint.
MAX_ENUM = 4_096
# The schema keywords that bound a count (strings' length, arrays' items, objects' properties).
COUNT_KEYWORDS = frozenset(
    {
        *("minLength", "maxLength", "minItems", "maxItems"),
        *("minProperties", "maxProperties", "minContains", "maxContains"),
    }
)
_COUNTED = re.compile(r"\{(\d+)(,(\d*))?\}")


class LimitError(ValueError):
    """A spec over one of the limits; the message says which and by how much."""


def check_json_text(text: str) -> None:
    """Raise `LimitError` if `text` (JSON) nests deeper than `MAX_DEPTH`."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                raise LimitError(f"nests deeper than {MAX_DEPTH} levels")
        elif char in "]}":
            depth -= 1


def check_schema(schema: object) -> None:
    """Raise `LimitError` for a JSON schema (already loaded) over the limits: its count
    keywords, enums and every `pattern` (and `patternProperties` key) as regular expressions."""
    total = 0
    todo = [schema]
    while todo:
        node = todo.pop()
        if isinstance(node, list):
            todo.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            if key in COUNT_KEYWORDS and isinstance(value, int) and value > MAX_REPEAT:
                raise LimitError(f"{key} {value} is over {MAX_REPEAT:,}")
            if key == "enum" and isinstance(value, list) and len(value) > MAX_ENUM:
                raise LimitError(f"an enum of {len(value):,} values is over {MAX_ENUM:,}")
            if key == "pattern" and isinstance(value, str):
                total += check_regex(value)
            elif key == "patternProperties" and isinstance(value, dict):
                total += sum(check_regex(pattern) for pattern in value)
            if key not in ("enum", "const", "default", "examples"):  # data, not schemas
                todo.append(value)
        if total > MAX_TOTAL_REPEAT:
            raise LimitError(f"its counted repetitions make over {MAX_TOTAL_REPEAT:,} copies")


def check_regex(pattern: str, quoted_strings: bool = False) -> int:
    """The copies `pattern`'s counted repetitions make (summed); `LimitError` if one bound, one
    nest of them, all of them or its groups' nesting is over its limit. `quoted_strings`: skip
    `"..."` literals (EBNF)."""
    frames = [1]  # per open group: the largest copy count inside it so far
    last, total, i = 1, 0, 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            i, last = i + 2, 1
            continue
        if char == "[" or (quoted_strings and char == '"'):
            i, last = _past_literal(pattern, i), 1
            continue
        if char == "(":
            frames.append(1)
            if len(frames) > MAX_DEPTH + 1:
                raise LimitError(f"nests groups deeper than {MAX_DEPTH} levels")
            i += 1
            continue
        if char == ")" and len(frames) > 1:
            last = frames.pop()
            frames[-1] = max(frames[-1], last)
            i += 1
            continue
        counted = _COUNTED.match(pattern, i) if char == "{" else None
        if counted is None:
            i, last = i + 1, 1
            continue
        copies = _bound(counted) * last
        if copies > MAX_NESTED_REPEAT and last > 1:
            over = f"over {MAX_NESTED_REPEAT:,}"
            raise LimitError(f"nested counted repetitions make {copies:,} copies ({over})")
        total += copies
        if total > MAX_TOTAL_REPEAT:
            raise LimitError(f"its counted repetitions make over {MAX_TOTAL_REPEAT:,} copies")
        frames[-1] = max(frames[-1], copies)
        i, last = counted.end(), copies
    return total


def _bound(counted: re.Match) -> int:
    low, comma, high = counted.group(1), counted.group(2), counted.group(3)
    bound = int(high) if comma and high else int(low)
    if bound > MAX_REPEAT or int(low) > MAX_REPEAT:
        raise LimitError(f"a counted repetition {counted.group(0)} is over {MAX_REPEAT:,}")
    return max(bound, 1)


def _past_literal(pattern: str, start: int) -> int:
    """The index past the character class (or quoted string) opening at `start`."""
    close = "]" if pattern[start] == "[" else '"'
    i = start + 1
    if close == "]" and pattern[i : i + 1] == "^":
        i += 1
    if close == "]" and pattern[i : i + 1] == "]":
        i += 1  # a leading ']' is a member
    while i < len(pattern) and pattern[i] != close:
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def check_limits(kind: str, spec: str, field: str, shown: object) -> None:
    """Raise `InvalidRequestError` (naming `field`) for a constraint over the limits."""
    try:
        if kind == "json":
            check_json_text(spec)
            check_schema(json.loads(spec))
        elif kind == "regex":
            check_regex(spec)
        elif kind == "grammar":
            check_regex(spec, quoted_strings=True)
        elif kind == "choice":
            check_json_text(spec)
            choices = json.loads(spec)
            if isinstance(choices, list) and len(choices) > MAX_ENUM:
                raise LimitError(f"{len(choices):,} choices are over {MAX_ENUM:,}")
    except LimitError as error:
        raise InvalidRequestError(field, shown, f"too large a grammar: {error}") from None
    except ValueError:
        return  # not JSON: the structural checks say so
