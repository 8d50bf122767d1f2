"""Incremental detokenization: the text each new token adds, without cutting a UTF-8 character.

It runs once per generated token inside the engine's step, so its cost is part of every decode
step (64 calls a step at batch 64). `TextDecoder` therefore goes straight to the Rust
tokenizer where that spells the same text as `tokenizer.decode`: transformers' wrapper first
walks the ids in Python (`to_py_obj`), which cost ~20 us a call.
"""

from __future__ import annotations

from collections.abc import Callable

from halfmoon.engine.sequence import Sequence

# Tokens held back while their text ends mid-character; past this many the text goes out as it
# is (a UTF-8 character spans at most 4 bytes, so only a broken stream gets here) and the window
# stops growing, which would make every later token decode it again.
MAX_HELD_TOKENS = 16


class TextDecoder:
    """`decoder(ids)`: their text with special tokens skipped, as `tokenizer.decode` spells it."""

    def __init__(self, tokenizer) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
            self._decode: Callable[[list[int]], str] = lambda ids: backend.decode(
                ids, skip_special_tokens=True
            )
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))

    def __call__(self, ids: list[int]) -> str:
        return self._decode(ids)


def append_text(decode: TextDecoder, seq: Sequence) -> str:
    """Extend `seq.text` with what its newest output tokens spell; returns the new text."""
    start, tokens = seq.num_prompt_tokens, seq.token_ids
    num_output = len(tokens) - start
    window = tokens[start + seq.prefix_offset :]
    after = decode(window)
    if not after and decode.special_ids.issuperset(window):
        # Special tokens only (skipped): later text needs none of them. (Other tokens can spell
        # nothing alone, like a sentencepiece "▁" at the start, and something after a word.)
        seq.prefix_offset = seq.read_offset = num_output
        return ""
    before = decode(window[: seq.read_offset - seq.prefix_offset])
    # Hold back text that ends mid-character; decode from the previous window so merges
    # across token boundaries come out right.
    held = num_output - seq.read_offset
    if len(after) <= len(before) or (after.endswith("\ufffd") and held < MAX_HELD_TOKENS):
        return ""
    delta = after[len(before) :]
    seq.prefix_offset = seq.read_offset
    seq.read_offset = num_output
    seq.text += delta
    return delta


def flush_text(decode: TextDecoder, seq: Sequence) -> str:
    """At finish: append whatever the held-back tail spells, even an incomplete character."""
    start, tokens = seq.num_prompt_tokens, seq.token_ids
    window = tokens[start + seq.prefix_offset :]
    before = decode(window[: seq.read_offset - seq.prefix_offset])
    after = decode(window)
    delta = after[len(before) :] if after.startswith(before) else ""
    seq.read_offset = len(tokens) - start
    seq.text += delta
    return delta
