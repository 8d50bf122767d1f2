"""OpenAI response bodies and stream chunks, built from the backend's deltas."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from halfmoon.cluster.frontend.openai_tool_calls import CallStream, ToolCalling, finish_reason
from halfmoon.cluster.serving.backend import TokenDelta, Usage
from halfmoon.engine.sequence import TokenLogprobs

CHAT, COMPLETION = "chat", "completion"
OBJECTS = {
    CHAT: ("chat.completion", "chat.completion.chunk", "chatcmpl-"),
    COMPLETION: ("text_completion", "text_completion", "cmpl-"),
}


def usage_json(usage: Usage, cached: bool = True) -> dict:
    """OpenAI's usage object; `cached` False leaves out the cached tokens (not known yet)."""
    body = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if cached:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


@dataclass
class ResponseShape:
    """Shapes one request's deltas as a chat or a text completion (whole, or as chunks)."""

    kind: str
    request_id: str
    model: str
    tokenizer: object
    include_usage: bool = False
    continuous_usage: bool = False  # usage so far in every chunk (vLLM's continuous_usage_stats)
    echo: str = ""  # completions with `echo`: the prompt's text, before the completion
    created: int = field(default_factory=lambda: int(time.time()))
    # Completions logprobs: characters of each choice's tokens so far.
    text_offsets: dict[int, int] = field(default_factory=dict)
    n: int = 1  # choices: the request's sequences, each delta naming its own (`index`)
    calling: ToolCalling | None = None  # chat with tools to call: each output read as calls
    _streams: dict[int, CallStream] = field(default_factory=dict)  # choice -> its reader
    _held_logprobs: dict[int, list[TokenLogprobs]] = field(default_factory=dict)
    _sofar: Usage = field(default_factory=lambda: Usage(0, 0, 0))  # streamed up to now

    def response(self, deltas: list[TokenDelta]) -> dict:
        """The whole (non-streamed) response."""
        choices = [self._choice(i, [d for d in deltas if d.index == i]) for i in range(self.n)]
        usage = next((d.usage for d in reversed(deltas) if d.usage), None)
        body = self._envelope(0, choices)
        body["usage"] = usage_json(usage) if usage else None
        return body

    def _choice(self, index: int, deltas: list[TokenDelta]) -> dict:
        text = self.echo + "".join(d.text for d in deltas)
        logprobs = [lp for d in deltas for lp in d.logprobs]
        choice = {"index": index, "logprobs": self._logprobs(logprobs, bool(logprobs), index)}
        reason = deltas[-1].finish_reason if deltas else None
        if self.kind == CHAT:
            choice["message"], reason = self._message(text, reason)
        else:
            choice["text"] = text
        choice["finish_reason"] = reason
        return choice

    def _message(self, text: str, reason: str | None) -> tuple[dict, str | None]:
        """The assistant's message, and the choice's finish reason (`tool_calls` for calls)."""
        content, calls = self.calling.read(text) if self.calling else (text, [])
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.as_json() for call in calls]
        return message, finish_reason(bool(calls), reason)

    def first_chunks(self, first: TokenDelta | None) -> list[dict]:
        """The chunks before any token, one per choice: a chat stream opens with the
        assistant's role, a completion with `echo` with the prompt. `first` is the stream's
        first delta (its prompt's size, for the usage)."""
        if first is not None:
            self._sofar.prompt_tokens = first.num_prompt_tokens
        if self.kind == CHAT:
            # null where calls may come, as OpenAI's streams of calls open
            body = {"role": "assistant", "content": "" if self.calling is None else None}
            return [self._chunk(body, None, None, i) for i in range(self.n)]
        return [self._chunk(self.echo, None, None, i) for i in range(self.n)] if self.echo else []

    def chunks(self, delta: TokenDelta) -> list[dict]:
        """The stream chunks for `delta`: none when it carries nothing a client would see."""
        self._sofar.completion_tokens += len(delta.token_ids)
        if self.calling is not None:
            return self._call_chunks(delta)
        if not (delta.text or delta.logprobs or delta.finish_reason):
            return []
        logprobs = self._logprobs(delta.logprobs, bool(delta.logprobs), delta.index)
        body = {"content": delta.text} if self.kind == CHAT else delta.text
        return [self._chunk(body, logprobs, delta.finish_reason, delta.index)]

    def _call_chunks(self, delta: TokenDelta) -> list[dict]:
        """A chat choice read as calls: what its reader lets out, then a last chunk with the
        finish reason; the log-probabilities of held text go with the next chunk sent."""
        stream = self._streams.setdefault(delta.index, self.calling.stream())
        held = self._held_logprobs.setdefault(delta.index, [])
        held += delta.logprobs
        finished = delta.finish_reason is not None
        chunks = [
            self._chunk(body, None, None, delta.index) for body in stream.feed(delta.text, finished)
        ]
        if finished:
            reason = finish_reason(stream.called, delta.finish_reason)
            chunks.append(self._chunk({}, None, reason, delta.index))
        if chunks and held:
            chunks[0]["choices"][0]["logprobs"] = self._logprobs(held, True, delta.index)
            held.clear()
        return chunks

    def usage_chunk(self, usage: Usage) -> dict:
        """The last chunk of a stream with `include_usage`: no choices, the usage."""
        body = self._envelope(1, [])
        body["usage"] = usage_json(usage)
        return body

    def _chunk(
        self, body, logprobs: dict | None, finish_reason: str | None, index: int = 0
    ) -> dict:
        choice = {"index": index, "logprobs": logprobs, "finish_reason": finish_reason}
        choice["delta" if self.kind == CHAT else "text"] = body
        chunk = self._envelope(1, [choice])
        if self.continuous_usage:
            chunk["usage"] = usage_json(self._sofar, cached=False)
        elif self.include_usage:
            chunk["usage"] = None
        return chunk

    def _envelope(self, streamed: int, choices: list[dict]) -> dict:
        object_name, prefix = OBJECTS[self.kind][streamed], OBJECTS[self.kind][2]
        return {
            "id": prefix + self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, logprobs: list[TokenLogprobs], wanted: bool, index: int = 0) -> dict | None:
        if not wanted:
            return None
        if self.kind == CHAT:
            return {"content": [self._chat_logprob(lp) for lp in logprobs]}
        tokens = [self._token(lp.token_id) for lp in logprobs]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offsets.get(index, 0))
            self.text_offsets[index] = offsets[-1] + len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [{self._token(t): v for t, v in lp.top} for lp in logprobs],
            "text_offset": offsets,
        }

    def _chat_logprob(self, logprobs: TokenLogprobs) -> dict:
        entry = self._chat_token(logprobs.token_id, logprobs.logprob)
        entry["top_logprobs"] = [self._chat_token(t, v) for t, v in logprobs.top]
        return entry

    def _chat_token(self, token_id: int, logprob: float) -> dict:
        token = self._token(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
