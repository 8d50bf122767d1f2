"""Incremental detokenization: the text each new token adds, without cutting a UTF-8 character."""

from __future__ import annotations

from halfmoon.engine.sequence import Sequence


def append_text(tokenizer, seq: Sequence) -> str:
    """Extend `seq.text` with what its newest output tokens spell; returns the new text."""
    output = seq.output_token_ids
    before = tokenizer.decode(output[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
    after = tokenizer.decode(output[seq.prefix_offset :], skip_special_tokens=True)
    # Hold back text that ends mid-character; decode from the previous window so merges
    # across token boundaries come out right.
    if len(after) <= len(before) or after.endswith("\ufffd"):
        return ""
    delta = after[len(before) :]
    seq.prefix_offset = seq.read_offset
    seq.read_offset = len(output)
    seq.text += delta
    return delta


def flush_text(tokenizer, seq: Sequence) -> str:
    """At finish: append whatever the held-back tail spells, even an incomplete character."""
    output = seq.output_token_ids
    before = tokenizer.decode(output[seq.prefix_offset : seq.read_offset], skip_special_tokens=True)
    after = tokenizer.decode(output[seq.prefix_offset :], skip_special_tokens=True)
    delta = after[len(before) :] if after.startswith(before) else ""
    seq.read_offset = len(output)
    seq.text += delta
    return delta
