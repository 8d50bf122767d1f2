"""When a sequence stops: each new token appended, its text decoded, and the first stop that
applies (a stop token or EOS, a grammar's end, a stop string, the length limit) named."""

from __future__ import annotations

from halfmoon.engine.detokenizer import TextDecoder, append_text, emit_text, find_stop, flush_text
from halfmoon.engine.sequence import Sequence, TokenLogprobs


class Stopping:
    """Appends sampled tokens to sequences and says which sequence stops, and why."""

    def __init__(self, decode_text: TextDecoder, eos_token_ids: set[int], max_model_len: int):
        self.decode_text = decode_text
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def append(
        self, seq: Sequence, token_id: int, logprobs: TokenLogprobs | None
    ) -> tuple[str | None, str]:
        """Append `token_id`; returns the finish reason (None: it goes on) and the new text."""
        seq.token_ids.append(token_id)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        params = seq.params
        # A grammar ends only on a stop token it accepted (or one it could not take).
        grammar_ended = seq.grammar is not None and seq.grammar.advance(seq)
        stop_token = (
            grammar_ended
            or token_id in params.stop_token_ids
            or (not params.ignore_eos and token_id in self.eos_token_ids)
        )
        reason = "stop" if stop_token else None
        if not stop_token:
            added = append_text(self.decode_text, seq)
            if params.stop and (cut := find_stop(seq.text, added, params.stop)) is not None:
                seq.text = seq.text[:cut]
                reason = "stop"
        if reason is None and (
            seq.num_output_tokens >= params.max_tokens or len(seq) >= self.max_model_len
        ):
            reason = "length"
            flush_text(self.decode_text, seq)
        return reason, emit_text(seq, finished=reason is not None)
