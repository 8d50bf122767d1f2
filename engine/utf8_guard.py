"""Which tokens keep a constrained sequence's bytes valid UTF-8.

xgrammar 0.2 matches characters byte by byte and lets through UTF-8 that no decoder takes
(surrogates, overlong forms), which a byte-level vocabulary can spell: the text then holds
U+FFFD, one per bad byte, and a string breaks its schema's `maxLength`. The guard follows each
sequence's bytes through UTF-8's states and masks the tokens that would break them.
"""

from __future__ import annotations

import numpy as np
import torch

# States: 0 between characters; 1-3 that many continuation bytes (80-BF) due; then the lead
# bytes whose next byte has a narrower range: E0 (A0-BF), ED (80-9F), F0 (90-BF), F4 (80-8F).
NUM_STATES, INVALID = 8, 8


def _byte_table() -> np.ndarray:
    """[state, byte] -> the next state (INVALID: not UTF-8; it stays INVALID)."""
    table = np.full((NUM_STATES + 1, 256), INVALID, dtype=np.int64)
    table[0, :0x80] = 0
    table[0, 0xC2:0xE0] = 1
    table[0, 0xE1:0xF0] = 2
    table[0, 0xF1:0xF4] = 3
    table[0, [0xE0, 0xED, 0xF0, 0xF4]] = [4, 5, 6, 7]
    for state, first, last, then in [
        (1, 0x80, 0xBF, 0),
        (2, 0x80, 0xBF, 1),
        (3, 0x80, 0xBF, 2),
        (4, 0xA0, 0xBF, 1),
        (5, 0x80, 0x9F, 1),
        (6, 0x90, 0xBF, 2),
        (7, 0x80, 0x8F, 2),
    ]:
        table[state, first : last + 1] = then
    return table


class Utf8Guard:
    """For a vocabulary (each token's bytes): the tokens allowed in each state, as bitmask rows
    of xgrammar's layout, and the state each token leads to."""

    def __init__(self, token_bytes: list[bytes], vocab_size: int) -> None:
        self.next_state = _next_states(token_bytes, vocab_size)  # [state, token]
        allowed = np.zeros((NUM_STATES, (vocab_size + 31) // 32 * 32), dtype=bool)
        allowed[:, :vocab_size] = self.next_state[:NUM_STATES] != INVALID
        words = np.packbits(allowed, axis=1, bitorder="little").view("<i4")
        self.masks = torch.from_numpy(words.astype(np.int32))  # [state, words]

    def advance(self, state: int, token_id: int) -> int:
        """The state after `token_id` (0 again after a token that would break the text, which
        a masked sequence never samples)."""
        following = int(self.next_state[state, token_id])
        return 0 if following == INVALID else following


def _next_states(token_bytes: list[bytes], vocab_size: int) -> np.ndarray:
    """Every token run through the byte table from every state at once, byte position by byte
    position (a token without bytes, such as one beyond the tokenizer's, leaves the state)."""
    lengths = [len(raw) for raw in token_bytes[:vocab_size]]
    width = max(lengths, default=0)
    padded = np.full((vocab_size, max(width, 1)), -1, dtype=np.int64)
    for token_id, raw in enumerate(token_bytes[:vocab_size]):
        padded[token_id, : len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    table = _byte_table()
    states = np.repeat(np.arange(NUM_STATES + 1)[:, None], vocab_size, axis=1)
    for position in range(width):
        column = padded[:, position]
        has_byte = column >= 0
        states[:, has_byte] = table[states[:, has_byte], column[has_byte]]
    return states
