"""Incremental detokenization: the text each new token adds, without cutting a UTF-8 character.

It runs once per generated token inside the engine's step, so its cost is part of every decode
step (64 calls a step at batch 64). Two ways, both spelling what `tokenizer.decode` spells:

- byte-level BPE tokenizers (GPT-2, Llama 3, Qwen and the default tiny model): a token is a
  fixed string of bytes, so the text is those bytes through an incremental UTF-8 decoder, ~1 us
  a token. The table of every token's bytes is checked against the tokenizer at load.
- any other tokenizer: the tokens since the last emitted ones are decoded again with the one
  before them as context, by the Rust tokenizer directly where that spells the same text
  (transformers' wrapper walks the ids in Python first, ~20 us a call).
"""

from __future__ import annotations

import codecs
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
        direct = backend is not None and not getattr(
            tokenizer, "clean_up_tokenization_spaces", True
        )
        if direct:
            self._decode: Callable[[list[int]], str] = lambda ids: backend.decode(
                ids, skip_special_tokens=True
            )
        else:
            self._decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
        self.special_ids = frozenset(getattr(tokenizer, "all_special_ids", ()))
        # Each token's bytes (None: a special token, skipped), or None if not byte-level.
        self.token_bytes = _byte_level_table(backend) if direct else None

    def __call__(self, ids: list[int]) -> str:
        return self._decode(ids)


def _byte_to_char() -> dict[int, str]:
    """The byte-level alphabet: printable Latin-1 bytes stand for themselves, the other bytes
    for the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {byte: chr(byte) for byte in printable}
    others = (byte for byte in range(256) if byte not in table)
    table.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return table


def _byte_level_table(backend) -> list[bytes | None] | None:
    """Every token's bytes if `backend` decodes byte-level and the table spells, for every
    token, what the tokenizer does; None otherwise."""
    from tokenizers import decoders

    if backend is None or not isinstance(backend.decoder, decoders.ByteLevel):
        return None
    to_byte = {char: byte for byte, char in _byte_to_char().items()}
    # str.translate to latin-1 characters whose code points are the bytes: a C loop (0.3 s for a
    # 150k vocabulary char by char in Python). A character outside the alphabet stands for its
    # own UTF-8 bytes.
    latin = {ord(char): chr(byte) for char, byte in to_byte.items()}
    for code in range(0x80, 0x100):
        latin.setdefault(code, chr(code).encode("utf-8").decode("latin-1"))
    special = {i for i, token in backend.get_added_tokens_decoder().items() if token.special}
    size = backend.get_vocab_size(with_added_tokens=True)
    table: list[bytes | None] = []
    for token_id in range(size):
        token = backend.id_to_token(token_id)
        if token_id in special:
            table.append(None)
        elif token is None:
            table.append(b"")
        else:
            try:
                table.append(token.translate(latin).encode("latin-1"))
            except UnicodeEncodeError:  # characters beyond U+00FF outside the alphabet
                table.append(
                    b"".join(bytes((to_byte[c],)) if c in to_byte else c.encode() for c in token)
                )
    spelled = [b.decode("utf-8", "replace") if b is not None else "" for b in table]
    expected = backend.decode_batch([[i] for i in range(size)], skip_special_tokens=True)
    return table if spelled == expected else None


def append_text(decode: TextDecoder, seq: Sequence) -> str:
    """Extend `seq.text` with what its newest output tokens spell; returns the new text."""
    if decode.token_bytes is not None:
        return _append_bytes(decode.token_bytes, seq)
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


def _append_bytes(token_bytes: list[bytes | None], seq: Sequence) -> str:
    if seq.utf8 is None:
        seq.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    new = seq.token_ids[seq.num_prompt_tokens + seq.read_offset :]
    # Ids past the tokenizer's vocabulary (models pad their embeddings) spell nothing, as there.
    size = len(token_bytes)
    data = b"".join((token_bytes[t] or b"") if t < size else b"" for t in new)
    seq.read_offset = seq.num_output_tokens
    delta = seq.utf8.decode(data)  # holds back the bytes of an unfinished character
    seq.text += delta
    return delta


def flush_text(decode: TextDecoder, seq: Sequence) -> str:
    """At finish: append whatever the held-back tail spells, even an incomplete character."""
    if decode.token_bytes is not None:
        delta = _append_bytes(decode.token_bytes, seq)
        tail = seq.utf8.decode(b"", final=True)
        seq.text += tail
        return delta + tail
    start, tokens = seq.num_prompt_tokens, seq.token_ids
    window = tokens[start + seq.prefix_offset :]
    before = decode(window[: seq.read_offset - seq.prefix_offset])
    after = decode(window)
    delta = after[len(before) :] if after.startswith(before) else ""
    seq.read_offset = len(tokens) - start
    seq.text += delta
    return delta


def emit_text(seq: Sequence, finished: bool) -> str:
    """Text ready to stream; a tail that could still grow into a stop string is held back."""
    hold = 0 if finished or not seq.params.stop else max(len(s) for s in seq.params.stop) - 1
    end = max(seq.num_emitted_chars, len(seq.text) - hold)
    text = seq.text[seq.num_emitted_chars : end]
    seq.num_emitted_chars = end
    return text


def find_stop(text: str, new_text: str, stops: list[str]) -> int | None:
    """Index in `text` where the earliest stop string that the new text completed starts."""
    window = len(new_text) + max(len(s) for s in stops) - 1
    start = max(0, len(text) - window)
    hits = [i for s in stops if (i := text.find(s, start)) != -1]
    return min(hits) if hits else None
