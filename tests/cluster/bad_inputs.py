"""The bad-input matrix of both APIs as data: each case is one bad request and the precise
answer it must get (status, the field it names, a fragment of the message that says what is
wrong). `bug` marks a case the server answers wrongly today (test_bad_input_matrix xfails it).

`SAMPLING_AND_GRAMMARS` and `GRPC_SAMPLING_AND_GRAMMARS` cover logit_bias, n,
response_format, the guided_* constraints, tools and tool_choice, hostile grammars among them
(the whole set of 50 is tests/cluster/test_cluster_http_families.py's). Penalties, best_of, echo
and unknown fields are tests/cluster/test_openai_dialect.py's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from halfmoon.cluster.api import halfmoon_pb2 as pb
from halfmoon.cluster.frontend.request_limits import RequestLimits

MODEL = "tiny"
MAX_MODEL_LEN = 2048  # the tiny model's context; the fixture checks the served model has it
VOCAB_SIZE = 262
LIMITS = RequestLimits()
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
COMPLETION_BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT_BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DROP = object()  # a field value meaning: leave the field out of the body


@dataclass(frozen=True)
class HttpCase:
    """One bad HTTP request, a JSON body (a dict, or bytes sent as they are) to `path`, and
    the answer it must get."""

    name: str
    status: int
    param: str | None  # the error's `param`; its message then starts with "param="
    says: str  # a fragment of the error message
    path: str = COMPLETIONS
    body: dict | bytes = field(default_factory=dict)
    method: str = "POST"
    headers: tuple[tuple[bytes, bytes], ...] = ()
    content_type: bytes | None = b"application/json"  # None: no Content-Type header
    bug: str | None = None

    @property
    def code(self) -> str:
        """The OpenAI error object's `code` that comes with this status."""
        return {400: "invalid_argument", 404: "model_not_found"}[self.status]


def completion(name, param, says, bug=None, status=400, **fields) -> HttpCase:
    """A completion request with `fields` changed (DROP: left out)."""
    return HttpCase(name, status, param, says, COMPLETIONS, _body(COMPLETION_BODY, fields), bug=bug)


def chat(name, param, says, bug=None, status=400, **fields) -> HttpCase:
    """A chat request with `fields` changed (DROP: left out)."""
    return HttpCase(name, status, param, says, CHAT, _body(CHAT_BODY, fields), bug=bug)


def raw_body(name, param, says, body: bytes, path=COMPLETIONS) -> HttpCase:
    return HttpCase(name, 400, param, says, path, body)


def raw_field(name, param, says, literal: bytes) -> HttpCase:
    """A completion body whose field `param` is the raw JSON `literal` (NaN, Infinity: not JSON)."""
    return raw_body(name, param, says, b'{"prompt": "hi", "%s": %s}' % (param.encode(), literal))


def request_id(name, value: bytes, says) -> HttpCase:
    """A good completion request with a bad X-Request-Id header."""
    header = ((b"X-Request-Id", value),)
    return HttpCase(name, 400, "X-Request-Id", says, body=COMPLETION_BODY, headers=header)


def _body(base: dict, fields: dict) -> dict:
    return {key: value for key, value in {**base, **fields}.items() if value is not DROP}


def _message(role, content) -> list[dict]:
    return [{"role": role, "content": content}]


CONTEXT = "context length of 2048 tokens"
PROMPT_TYPES = "must be a string, a list of token ids, or a list of one of those"
STOP_TYPES = "must be a string or a list of strings"
CONTENT_TYPES = "must be a string or a list of text parts"
NOT_JSON = "body='<not JSON>' is invalid: Invalid JSON"
SURROGATE = "lone surrogate (\\ud800-\\udfff)"
SLO = "finite number of seconds > 0"
MANY_STOPS = ["a"] * (LIMITS.max_stop_strings + 1)
MANY_IDS = [1] * (LIMITS.max_prompt_token_ids + 1)
MANY_STOP_IDS = [1] * (LIMITS.max_stop_token_ids + 1)
MANY_MESSAGES = [{"role": "user", "content": "x"}] * (LIMITS.max_chat_messages + 1)
LONG_TEXT = "x" * (LIMITS.max_prompt_chars + 1)
HUGE_BODY_TEXT = "x" * (LIMITS.max_prompt_bytes + (1 << 20))
LONG_STOP = "a" * (LIMITS.max_stop_bytes + 1)
HALF_STOP = "é" * (LIMITS.max_stop_bytes // 4)  # 2 bytes a character: two of these fill it

# fmt: off
COMPLETION_FIELDS = [
    # model
    completion("model-int", "model", "valid string", model=5),
    completion("model-list", "model", "valid string", model=["tiny"]),
    completion("model-unknown", None, "model 'other' is not served", status=404, model="other"),
    completion("model-empty", None, "model '' is not served", status=404, model=""),
    # prompt
    completion("prompt-missing", "prompt", "Field required", prompt=DROP),
    completion("prompt-empty", "prompt", "must not be empty", prompt=""),
    completion("prompt-empty-ids", "prompt", "must not be empty", prompt=[]),
    completion("prompt-empty-nested-ids", "prompt", "must not be empty", prompt=[[]]),
    completion("prompt-empty-in-list", "prompt", "must not be empty", prompt=[""]),
    completion("prompt-two-texts", "prompt", "send one prompt per request", prompt=["a", "b"]),
    completion("prompt-two-id-lists", "prompt", "send one prompt per request", prompt=[[1], [2]]),
    completion("prompt-int", "prompt", PROMPT_TYPES, prompt=5),
    completion("prompt-object", "prompt", PROMPT_TYPES, prompt={"text": "hi"}),
    completion("prompt-float-id", "prompt", PROMPT_TYPES, prompt=[1.5]),
    completion("prompt-mixed-list", "prompt", PROMPT_TYPES, prompt=[1, "a"]),
    completion("prompt-bool-id", "prompt", PROMPT_TYPES, prompt=[True]),
    completion("prompt-negative-id", "prompt", "[0, 262)", prompt=[5, -1]),
    completion("prompt-id-at-vocab", "prompt", "[0, 262)", prompt=[VOCAB_SIZE]),
    completion("prompt-id-2**63", "prompt", "[0, 262)", prompt=[2**63]),
    completion("prompt-nested-bad-id", "prompt", "[0, 262)", prompt=[[1, 10**6]]),
    completion("prompt-at-context", "prompt", CONTEXT, prompt="x" * MAX_MODEL_LEN),
    completion("prompt-ids-at-context", "prompt", CONTEXT, prompt=[5] * MAX_MODEL_LEN),
    completion("prompt-past-chars", "prompt", "limits.max_prompt_chars", prompt=LONG_TEXT),
    completion("prompt-past-ids", "prompt", "limits.max_prompt_token_ids", prompt=MANY_IDS),
    completion("body-past-bytes", "body", "limits.max_prompt_bytes", prompt=HUGE_BODY_TEXT),
    # max_tokens
    completion("max-tokens-0", "max_tokens", "integer >= 1", max_tokens=0),
    completion("max-tokens-negative", "max_tokens", "integer >= 1", max_tokens=-1),
    completion("max-tokens-past-context", "max_tokens", "ask for at most 2046", max_tokens=2047),
    completion("max-tokens-past-context-by-prompt", "max_tokens", "ask for at most 1 tokens",
               prompt="x" * (MAX_MODEL_LEN - 1)),
    completion("max-tokens-2**63", "max_tokens", CONTEXT, max_tokens=2**63),
    completion("max-tokens-10**30", "max_tokens", CONTEXT, max_tokens=10**30),
    completion("max-tokens-fraction", "max_tokens", "fractional part", max_tokens=1.5),
    completion("max-tokens-word", "max_tokens", "valid integer", max_tokens="two"),
    completion("max-tokens-list", "max_tokens", "valid integer", max_tokens=[2]),
    completion("max-tokens-digit-string", "max_tokens", "valid integer", max_tokens="2"),
    completion("max-tokens-true", "max_tokens", "valid integer", max_tokens=True),
    # temperature, top_p, top_k, min_p, seed
    completion("temperature-negative", "temperature", "finite and >= 0", temperature=-0.01),
    completion("temperature-word", "temperature", "valid number", temperature="hot"),
    completion("temperature-object", "temperature", "valid number", temperature={"t": 1}),
    completion("temperature-true", "temperature", "valid number", temperature=True),
    completion("temperature-digit-string", "temperature", "valid number", temperature="0.5"),
    completion("top-p-0", "top_p", "(0, 1]", top_p=0),
    completion("top-p-negative", "top_p", "(0, 1]", top_p=-0.5),
    completion("top-p-past-1", "top_p", "(0, 1]", top_p=1.0000001),
    completion("top-p-2", "top_p", "(0, 1]", top_p=2),
    completion("top-p-word", "top_p", "valid number", top_p="high"),
    completion("top-k-minus-2", "top_k", "-1 or 0 (off) or an integer >= 1", top_k=-2),
    completion("top-k-minus-2**63", "top_k", "-1 or 0 (off)", top_k=-(2**63)),
    completion("top-k-fraction", "top_k", "fractional part", top_k=1.5),
    completion("top-k-word", "top_k", "valid integer", top_k="all"),
    completion("min-p-negative", "min_p", "[0, 1]", min_p=-0.01),
    completion("min-p-past-1", "min_p", "[0, 1]", min_p=1.01),
    completion("min-p-list", "min_p", "valid number", min_p=[0.1]),
    completion("seed-negative", "seed", "[0, 2**63)", seed=-1),
    completion("seed-2**63", "seed", "[0, 2**63)", seed=2**63),
    completion("seed-2**64", "seed", "[0, 2**63)", seed=2**64),
    completion("seed-fraction", "seed", "fractional part", seed=1.5),
    completion("seed-word", "seed", "valid integer", seed="lucky"),
    # stop, stop_token_ids
    completion("stop-empty-string", "stop", "non-empty strings", stop=""),
    completion("stop-empty-in-list", "stop", "non-empty strings", stop=["a", ""]),
    completion("stop-too-many", "stop", "limits.max_stop_strings", stop=MANY_STOPS),
    completion("stop-too-long", "stop", "limits.max_stop_bytes", stop=[LONG_STOP]),
    completion("stop-too-long-together", "stop", "limits.max_stop_bytes",
               stop=[HALF_STOP, HALF_STOP + "é"]),
    completion("stop-int", "stop", STOP_TYPES, stop=5),
    completion("stop-int-in-list", "stop", STOP_TYPES, stop=[5]),
    completion("stop-token-ids-negative", "stop_token_ids", ">= 0", stop_token_ids=[-1]),
    completion("stop-token-ids-int", "stop_token_ids", "valid array", stop_token_ids=5),
    completion("stop-token-ids-word", "stop_token_ids.0", "valid integer", stop_token_ids=["a"]),
    completion("stop-token-ids-fraction", "stop_token_ids.0", "fractional", stop_token_ids=[1.5]),
    completion("stop-token-ids-too-many", "stop_token_ids", "limits.max_stop_token_ids",
               stop_token_ids=MANY_STOP_IDS),
    completion("stop-token-id-at-vocab", "stop_token_ids", "[0, 262)",
               stop_token_ids=[VOCAB_SIZE]),
    # logprobs: a count of top tokens on /v1/completions
    completion("logprobs-21", "logprobs", "[0, 20]", logprobs=21),
    completion("logprobs-negative", "logprobs", "[0, 20]", logprobs=-1),
    completion("logprobs-2**31", "logprobs", "[0, 20]", logprobs=2**31),
    completion("logprobs-word", "logprobs", "valid integer", logprobs="some"),
    # stream, stream_options
    completion("stream-word", "stream", "valid boolean", stream="sure"),
    completion("stream-5", "stream", "valid boolean", stream=5),
    completion("stream-yes", "stream", "valid boolean", stream="yes"),
    completion("stream-1", "stream", "valid boolean", stream=1),
    completion("stream-options-without-stream", "stream_options", "only allowed with stream",
               stream_options={"include_usage": True}),
    completion("stream-options-int", "stream_options", "an object", stream=True, stream_options=5),
    completion("stream-options-include-usage-word", "stream_options.include_usage",
               "valid boolean", stream=True, stream_options={"include_usage": "x"}),
    completion("stream-bad-temperature", "temperature", "finite and >= 0", stream=True,
               temperature=-1),
    completion("stream-bad-max-tokens", "max_tokens", "integer >= 1", stream=True, max_tokens=0),
    # halfmoon's own fields
    completion("ignore-eos-word", "ignore_eos", "valid boolean", ignore_eos="never"),
    completion("ignore-eos-2", "ignore_eos", "valid boolean", ignore_eos=2),
    completion("ttft-slo-0", "ttft_slo_s", SLO, ttft_slo_s=0),
    completion("ttft-slo-negative", "ttft_slo_s", SLO, ttft_slo_s=-1),
    completion("ttft-slo-word", "ttft_slo_s", "valid number", ttft_slo_s="soon"),
    completion("tbt-slo-0", "tbt_slo_s", SLO, tbt_slo_s=0.0),
    completion("tbt-slo-negative", "tbt_slo_s", SLO, tbt_slo_s=-0.5),
]

CHAT_FIELDS = [
    chat("messages-missing", "messages", "Field required", messages=DROP),
    chat("messages-empty", "messages", "at least 1 item", messages=[]),
    chat("messages-string", "messages", "valid array", messages="hi"),
    chat("messages-string-item", "messages.0", "an object", messages=["hi"]),
    chat("role-missing", "messages.0.role", "Field required", messages=[{"content": "x"}]),
    chat("role-empty", "messages.0.role", "at least 1 character", messages=_message("", "x")),
    chat("role-int", "messages.0.role", "valid string", messages=_message(5, "x")),
    chat("role-null", "messages.0.role", "valid string", messages=_message(None, "x")),
    chat("role-list", "messages.0.role", "valid string", messages=_message(["user"], "x")),
    chat("content-int", "messages.0.content", CONTENT_TYPES, messages=_message("user", 5)),
    chat("content-image-part", "messages.0.content", CONTENT_TYPES,
         messages=_message("user", [{"type": "image_url", "image_url": {"url": "x"}}])),
    chat("content-part-without-text", "messages.0.content", CONTENT_TYPES,
         messages=_message("user", [{"type": "text"}])),
    chat("content-part-int-text", "messages.0.content", CONTENT_TYPES,
         messages=_message("user", [{"type": "text", "text": 5}])),
    chat("messages-too-many", "messages", "limits.max_chat_messages", messages=MANY_MESSAGES),
    chat("messages-past-chars", "messages", "limits.max_prompt_chars",
         messages=_message("user", LONG_TEXT[:-1]) + _message("user", "x")),
    chat("chat-max-tokens-0", "max_tokens", "integer >= 1", max_tokens=0),
    chat("max-completion-tokens-word", "max_completion_tokens", "valid integer",
         max_completion_tokens="x"),
    chat("max-completion-tokens-0", "max_completion_tokens", "integer >= 1",
         max_completion_tokens=0),
    chat("max-completion-tokens-past-context", "max_completion_tokens",
         "plus max_completion_tokens must fit the context length of 2048 tokens",
         max_completion_tokens=5000),
    chat("max-completion-tokens-wins-over-max-tokens", "max_completion_tokens", CONTEXT,
         max_tokens=2, max_completion_tokens=5000),
    chat("max-completion-tokens-digit-string", "max_completion_tokens", "valid integer",
         max_completion_tokens="2"),
    chat("logprobs-int", "logprobs", "valid boolean", logprobs=3),
    chat("logprobs-1", "logprobs", "valid boolean", logprobs=1),
    chat("top-logprobs-without-logprobs", "top_logprobs", "needs logprobs: true", top_logprobs=2),
    chat("top-logprobs-21", "top_logprobs", "[0, 20]", logprobs=True, top_logprobs=21),
    chat("top-logprobs-negative", "top_logprobs", "[0, 20]", logprobs=True, top_logprobs=-1),
    chat("top-logprobs-word", "top_logprobs", "valid integer", logprobs=True, top_logprobs="x"),
    chat("chat-temperature-negative", "temperature", "finite and >= 0", temperature=-1),
    chat("chat-top-p-0", "top_p", "(0, 1]", top_p=0.0),
    chat("chat-seed-2**63", "seed", "[0, 2**63)", seed=2**63),
    chat("chat-stop-empty", "stop", "non-empty strings", stop=[""]),
    chat("chat-stop-token-ids-negative", "stop_token_ids", ">= 0", stop_token_ids=[-5]),
    chat("chat-model-int", "model", "valid string", model=5),
    chat("chat-model-unknown", None, "model 'other' is not served", status=404, model="other"),
    chat("chat-stream-options-without-stream", "stream_options", "only allowed with stream",
         stream_options={"include_usage": False}),
    chat("chat-stream-bad-top-logprobs", "top_logprobs", "[0, 20]", stream=True, logprobs=True,
         top_logprobs=99),
]

RAW_BODIES = [
    raw_body("body-empty", "body", "EOF while parsing", b""),
    raw_body("body-open-brace", "body", "EOF while parsing an object", b"{"),
    raw_body("body-trailing-garbage", "body", "trailing characters", b'{"prompt": "hi"} x'),
    raw_body("body-trailing-comma", "body", "trailing comma", b'{"prompt": "hi",}'),
    raw_body("body-single-quotes", "body", "key must be a string", b"{'prompt': 'hi'}"),
    raw_body("body-leading-zero", "body", "invalid number", b'{"prompt": "hi", "seed": 01}'),
    raw_body("body-array", "body", "an object", b"[]"),
    raw_body("body-null", "body", "an object", b"null"),
    raw_body("body-string", "body", "an object", b'"hi"'),
    raw_body("body-number", "body", "an object", b"5"),
    raw_body("chat-body-array", "body", "an object", b"[{}]", path=CHAT),
    raw_body("chat-body-empty", "body", "EOF while parsing", b"", path=CHAT),
    raw_body("body-not-utf8", "body", NOT_JSON, b'{"prompt": "\xff\xfe"}'),
    raw_body("body-utf16", "body", NOT_JSON, '{"prompt": "hi"}'.encode("utf-16")),
    raw_body("body-utf8-bom", "body", NOT_JSON, b'\xef\xbb\xbf{"prompt": "hi"}'),
    raw_body("lone-high-surrogate", "body", SURROGATE, rb'{"prompt": "a\ud800b"}'),
    raw_body("lone-low-surrogate", "body", SURROGATE, rb'{"prompt": "\udc00"}'),
    raw_body("stop-lone-surrogate", "body", SURROGATE, rb'{"prompt": "hi", "stop": "\udfff"}'),
    raw_body("chat-lone-surrogate", "body", SURROGATE, path=CHAT,
             body=rb'{"messages": [{"role": "user", "content": "\ud800"}]}'),
    raw_body("short-unicode-escape", "body", "invalid escape", rb'{"prompt": "\u12"}'),
    raw_body("bad-escape", "body", "invalid escape", rb'{"prompt": "\x41"}'),
    raw_field("temperature-nan", "temperature", "finite and >= 0", b"NaN"),
    raw_field("temperature-infinity", "temperature", "finite and >= 0", b"Infinity"),
    raw_field("temperature-minus-infinity", "temperature", "finite and >= 0", b"-Infinity"),
    raw_field("temperature-1e400", "temperature", "finite and >= 0", b"1e400"),
    raw_field("top-p-nan", "top_p", "(0, 1]", b"NaN"),
    raw_field("min-p-infinity", "min_p", "[0, 1]", b"Infinity"),
    raw_field("max-tokens-nan", "max_tokens", "finite number", b"NaN"),
    raw_field("max-tokens-1e400", "max_tokens", "finite number", b"1e400"),
    raw_body("max-tokens-5000-digits", "body", "number out of range",
             b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}"),
    raw_field("seed-nan", "seed", "finite number", b"NaN"),
    raw_field("ttft-slo-infinity", "ttft_slo_s", SLO, b"Infinity"),
    raw_field("tbt-slo-nan", "tbt_slo_s", SLO, b"NaN"),
    raw_body("chat-top-logprobs-nan", "top_logprobs", "finite number", path=CHAT,
             body=b'{"messages": [{"role": "user", "content": "hi"}], "logprobs": true, '
             b'"top_logprobs": NaN}'),
    raw_body("duplicate-key-last-bad", "max_tokens", "integer >= 1",
             b'{"prompt": "hi", "max_tokens": 2, "max_tokens": 0}'),
    raw_body("duplicate-key-last-empty", "prompt", "must not be empty",
             b'{"prompt": "hi", "prompt": ""}'),
    raw_body("deeply-nested", "body", "recursion limit exceeded",
             b'{"prompt": "hi", "metadata": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"),
]

HEADERS = [
    request_id("request-id-too-long", b"a" * (LIMITS.max_request_id_chars + 1), "at most 256"),
    request_id("request-id-empty", b"", "printable characters, at least one"),
    request_id("request-id-blank", b"   ", "printable characters, at least one"),
    request_id("request-id-tab", b"a\tb", "printable characters"),
    request_id("request-id-delete", b"a\x7fb", "printable characters"),
    request_id("request-id-c1-control", b"\x85", "printable characters"),
    HttpCase("content-type-form", 400, "Content-Type", "must be application/json",
             body=b"prompt=hi&max_tokens=2", content_type=b"application/x-www-form-urlencoded"),
    HttpCase("content-encoding-gzip", 400, "body", "Invalid JSON", body=b"\x1f\x8b\x08\x00",
             headers=((b"Content-Encoding", b"gzip"),)),
    HttpCase("content-type-text", 400, "Content-Type", "must be application/json",
             body=COMPLETION_BODY, content_type=b"text/plain"),
    HttpCase("content-type-missing", 400, "Content-Type", "must be application/json",
             body=COMPLETION_BODY, content_type=None),
    HttpCase("content-type-json-prefix", 400, "Content-Type", "must be application/json",
             body=COMPLETION_BODY, content_type=b"application/jsonp"),
]

MODELS = [
    HttpCase("model-card-unknown", 404, None, "model 'other' is not served", "/v1/models/other",
             b"", "GET"),
]
# fmt: on


@dataclass(frozen=True)
class RouteCase:
    """A method or path the API does not serve: 404, or 405 with the Allow header (its methods
    in any order)."""

    name: str
    method: str
    path: str
    status: int
    allow: str | None = None


ROUTES = [
    RouteCase("get-completions", "GET", COMPLETIONS, 405, "POST"),
    RouteCase("put-chat", "PUT", CHAT, 405, "POST"),
    RouteCase("patch-completions", "PATCH", COMPLETIONS, 405, "POST"),
    RouteCase("options-completions", "OPTIONS", COMPLETIONS, 405, "POST"),
    RouteCase("unknown-method", "BREW", COMPLETIONS, 405, "POST"),
    RouteCase("delete-models", "DELETE", "/v1/models", 405, "GET, HEAD"),
    RouteCase("post-models", "POST", "/v1/models", 405, "GET, HEAD"),
    RouteCase("post-health", "POST", "/health", 405, "GET, HEAD"),
    RouteCase("post-metrics", "POST", "/metrics", 405, "GET, HEAD"),
    RouteCase("unknown-path", "POST", "/v1/nope", 404),
    RouteCase("other-api-version", "GET", "/v2/models", 404),
    RouteCase("embeddings", "POST", "/v1/embeddings", 404),
    RouteCase("path-not-utf8", "GET", "/%ff", 404),
    RouteCase("dot-dot-path", "GET", "/v1/../v1/models", 404),
]

# Requests HTTP itself refuses (uvicorn's parser): a plain-text 400, then the connection closes.
POST = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
MALFORMED_HTTP = {
    "content-length-word": POST + b"Content-Length: ab\r\n\r\n",
    "content-length-negative": POST + b"Content-Length: -1\r\n\r\n",
    "content-length-huge": POST + b"Content-Length: 99999999999999999999999\r\n\r\n",
    "transfer-encoding-gzip": POST + b"Transfer-Encoding: gzip\r\n\r\n{}",
    "bad-chunk-size": POST + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    "garbage-request-line": b"GARBAGE\r\n\r\n",
    "header-without-colon": b"GET /health HTTP/1.1\r\nHost: x\r\nNoColonHere\r\n\r\n",
}


def _string_pattern(pattern: str) -> dict:
    return {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern}}}


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _tool(parameters: dict | None = None, name: str = "f") -> dict:
    function = {"name": name} if parameters is None else {"name": name, "parameters": parameters}
    return {"type": "function", "function": function}


BIAS_301 = {str(i): 1 for i in range(301)}
NESTED = "(b{1,50000}){1,50000}"  # the issue's own
TOO_LARGE = "too large a grammar"
SCHEMA = "response_format.json_schema.schema"
SAMPLING_AND_GRAMMARS = [
    completion("logit-bias-301", "logit_bias", "at most 300 entries", logit_bias=BIAS_301),
    completion("logit-bias-101", "logit_bias", "[-100, 100]", logit_bias={"5": 101}),
    completion("logit-bias-word-key", "logit_bias", "decimal strings", logit_bias={"x": 1}),
    completion("logit-bias-id-at-vocab", "logit_bias", "[0, 262)", logit_bias={"262": 1}),
    completion("n-0", "n", "[1, 16]", n=0),
    completion("n-17", "n", "[1, 16]", n=17),
    completion("n-digit-string", "n", "valid integer", n="2"),
    chat(
        "response-format-xml",
        "response_format.type",
        "'json_schema'",
        response_format={"type": "xml"},
    ),
    chat("response-format-string", "response_format", "an object", response_format="json"),
    chat(
        "response-format-no-schema",
        SCHEMA,
        "needs json_schema.schema",
        response_format={"type": "json_schema"},
    ),
    chat(
        "response-format-bad-type",
        SCHEMA,
        'Unsupported type "nope"',
        response_format=_schema_format({"type": "nope"}),
    ),
    chat(
        "response-format-nested-repetition",
        SCHEMA,
        TOO_LARGE,
        response_format=_schema_format(_string_pattern(NESTED)),
    ),
    chat(
        "response-format-max-length-10**8",
        SCHEMA,
        "maxLength 100000000 is over",
        response_format=_schema_format({"type": "string", "maxLength": 10**8}),
    ),
    chat(
        "response-format-past-deadline",
        SCHEMA,
        "did not build within",
        response_format=_schema_format(_string_pattern("(.*){1,4096}")),
    ),
    chat(
        "guided-json-deep",
        "guided_json",
        "nests deeper than 32",
        guided_json={"a": json.loads("[" * 40 + "1" + "]" * 40)},
    ),
    chat("guided-regex-nested", "guided_regex", TOO_LARGE, guided_regex=NESTED),
    chat(
        "guided-choice-5000",
        "guided_choice",
        "5,000 choices are over",
        guided_choice=[str(i) for i in range(5000)],
    ),
    chat("tools-string", "tools", "valid array", tools="f"),
    chat(
        "tools-without-function", "tools.0.function", "Field required", tools=[{"type": "function"}]
    ),
    chat(
        "tool-choice-required-without-tools", "tool_choice", "needs tools", tool_choice="required"
    ),
    chat(
        "tool-choice-unknown-function",
        "tool_choice",
        "names no function",
        tools=[_tool()],
        tool_choice={"type": "function", "function": {"name": "g"}},
    ),
    chat(
        "tools-hostile-parameters",
        "tools.0.function.parameters",
        "{1,100000} is over",
        tools=[_tool(_string_pattern("a{1,100000}"))],
        tool_choice="required",
    ),
]

HTTP_CASES: list[HttpCase] = (
    COMPLETION_FIELDS + CHAT_FIELDS + RAW_BODIES + HEADERS + MODELS + SAMPLING_AND_GRAMMARS
)


@dataclass(frozen=True)
class GrpcCase:
    """One bad call of `rpc`: a request message, or bytes sent as they are (or a function that
    builds a large one when the case runs); and the status it must end with."""

    name: str
    rpc: str
    request: object
    code: str
    field: str | None  # the message then starts with "field="
    says: str  # a fragment of the status message
    timeout_s: float = 10.0
    bug: str | None = None

    def message(self):
        return self.request() if callable(self.request) else self.request


def generate(name, field, says, sampling=None, bug=None, **fields) -> GrpcCase:
    """A Generate call that must fail with INVALID_ARGUMENT."""
    if sampling is not None:
        fields["sampling"] = pb.SamplingParams(**sampling)
    request = pb.GenerateRequest(**fields)
    return GrpcCase(name, "Generate", request, "INVALID_ARGUMENT", field, says, bug=bug)


def sampling(name, field, says, bug=None, **params) -> GrpcCase:
    """`generate` of "hi" with sampling `params`."""
    return generate(name, field, says, {"max_tokens": 2, **params}, bug, text="hi")


def _ids(*ids: int) -> pb.TokenIds:
    return pb.TokenIds(ids=ids)


def _chat(*messages: tuple[str, str]) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=r, content=c) for r, c in messages])


def _oversize() -> pb.GenerateRequest:
    return pb.GenerateRequest(text="x" * (17 << 20))  # past the server's 16 MiB


INF, NAN = float("inf"), float("nan")
MALFORMED = "the request is not a valid"
# gRPC Python takes a timeout of 0 as none at all; and a deadline that has passed may still
# see a quick call answered (the timer races it), so the case is a generation that cannot end.
DEADLINE_0 = 1e-9
LONG_GENERATION = pb.GenerateRequest(
    text="hi", sampling=pb.SamplingParams(max_tokens=1900, ignore_eos=True)
)

# fmt: off
GRPC_GENERATE = [
    generate("no-input", "input", "set one of text, token_ids or chat"),
    generate("text-empty", "text", "non-empty string", text=""),
    generate("token-ids-empty", "token_ids", "at least one token id", token_ids=_ids()),
    generate("token-id-negative", "token_ids", ">= 0", token_ids=_ids(5, -1)),
    generate("token-id-min-int64", "token_ids", ">= 0", token_ids=_ids(-(2**63))),
    generate("token-id-at-vocab", "prompt_token_ids", "[0, 262)", token_ids=_ids(VOCAB_SIZE)),
    generate("token-id-max-int64", "prompt_token_ids", "[0, 262)", token_ids=_ids(2**63 - 1)),
    generate("token-ids-past-limit", "token_ids", "limits.max_prompt_token_ids",
             token_ids=_ids(*MANY_IDS)),
    generate("token-ids-at-context", "prompt", CONTEXT, token_ids=_ids(*[5] * MAX_MODEL_LEN)),
    generate("chat-empty", "chat.messages", "at least one message", chat=_chat()),
    generate("chat-role-empty", "chat.messages[0].role", "non-empty string", chat=_chat(("", "x"))),
    generate("chat-second-role-empty", "chat.messages[1].role", "non-empty string",
             chat=_chat(("user", "x"), ("", "y"))),
    generate("chat-too-many", "chat.messages", "limits.max_chat_messages",
             chat=_chat(*[("user", "x")] * (LIMITS.max_chat_messages + 1))),
    generate("chat-past-chars", "chat.messages", "limits.max_prompt_chars",
             chat=_chat(("user", LONG_TEXT))),
    generate("text-past-chars", "text", "limits.max_prompt_chars", text=LONG_TEXT),
    generate("text-at-context", "prompt", CONTEXT, text="x" * MAX_MODEL_LEN),
    generate("request-id-too-long", "request_id", "at most 256 allowed", text="hi",
             request_id="r" * (LIMITS.max_request_id_chars + 1)),
    generate("request-id-newline", "request_id", "printable", text="hi", request_id="a\nb",
             sampling={"max_tokens": 1}),
    generate("request-id-nul", "request_id", "printable", text="hi", request_id="\x00",
             sampling={"max_tokens": 1}),
    sampling("max-tokens-0", "max_tokens", "integer >= 1", max_tokens=0),
    sampling("max-tokens-negative", "max_tokens", "integer >= 1", max_tokens=-1),
    sampling("max-tokens-min-int64", "max_tokens", "integer >= 1", max_tokens=-(2**63)),
    sampling("max-tokens-past-context", "max_tokens", "ask for at most 2046", max_tokens=2047),
    sampling("max-tokens-max-int64", "max_tokens", CONTEXT, max_tokens=2**63 - 1),
    generate("max-tokens-past-context-by-prompt", "max_tokens", "ask for at most 2 tokens",
             text="x" * (MAX_MODEL_LEN - 2), sampling={"max_tokens": 3}),
    sampling("temperature-negative", "temperature", "finite and >= 0", temperature=-0.01),
    sampling("temperature-tiny-negative", "temperature", "finite and >= 0", temperature=-1e-300),
    sampling("temperature-nan", "temperature", "finite and >= 0", temperature=NAN),
    sampling("temperature-inf", "temperature", "finite and >= 0", temperature=INF),
    sampling("temperature-minus-inf", "temperature", "finite and >= 0", temperature=-INF),
    sampling("top-p-0", "top_p", "(0, 1]", top_p=0.0),
    sampling("top-p-past-1", "top_p", "(0, 1]", top_p=1.0000001),
    sampling("top-p-negative", "top_p", "(0, 1]", top_p=-1.0),
    sampling("top-p-nan", "top_p", "(0, 1]", top_p=NAN),
    sampling("top-p-inf", "top_p", "(0, 1]", top_p=INF),
    sampling("top-k-minus-2", "top_k", "-1 or 0 (off)", top_k=-2),
    sampling("top-k-min-int64", "top_k", "-1 or 0 (off)", top_k=-(2**63)),
    sampling("min-p-negative", "min_p", "[0, 1]", min_p=-0.01),
    sampling("min-p-past-1", "min_p", "[0, 1]", min_p=1.0000001),
    sampling("min-p-nan", "min_p", "[0, 1]", min_p=NAN),
    sampling("min-p-minus-inf", "min_p", "[0, 1]", min_p=-INF),
    sampling("seed-negative", "seed", "[0, 2**63)", seed=-1),
    sampling("seed-min-int64", "seed", "[0, 2**63)", seed=-(2**63)),
    sampling("stop-empty", "stop", "non-empty strings", stop=[""]),
    sampling("stop-empty-second", "stop", "non-empty strings", stop=["a", ""]),
    sampling("stop-too-many", "stop", "limits.max_stop_strings", stop=MANY_STOPS),
    sampling("stop-too-long", "stop", "limits.max_stop_bytes", stop=[HALF_STOP * 2 + "é"]),
    sampling("stop-token-ids-negative", "stop_token_ids", ">= 0", stop_token_ids=[3, -1]),
    sampling("stop-token-ids-too-many", "stop_token_ids", "limits.max_stop_token_ids",
             stop_token_ids=MANY_STOP_IDS),
    sampling("stop-token-id-at-vocab", "stop_token_ids", "[0, 262)",
             stop_token_ids=[VOCAB_SIZE]),
    sampling("logprobs-21", "logprobs", "at most 20", logprobs=21),
    sampling("logprobs-max-int32", "logprobs", "at most 20", logprobs=2**31 - 1),
    sampling("logprobs-negative", "logprobs", "integer >= 0", logprobs=-1),
    generate("ttft-slo-0", "ttft_slo_s", SLO, text="hi", ttft_slo_s=0),
    generate("ttft-slo-negative", "ttft_slo_s", SLO, text="hi", ttft_slo_s=-1),
    generate("ttft-slo-nan", "ttft_slo_s", SLO, text="hi", ttft_slo_s=NAN),
    generate("ttft-slo-inf", "ttft_slo_s", SLO, text="hi", ttft_slo_s=INF),
    generate("tbt-slo-0", "tbt_slo_s", SLO, text="hi", tbt_slo_s=0.0),
    generate("tbt-slo-minus-inf", "tbt_slo_s", SLO, text="hi", tbt_slo_s=-INF),
    GrpcCase("generate-malformed", "Generate", b"\xff\xff", "INVALID_ARGUMENT", None,
             f"{MALFORMED} GenerateRequest message"),
    GrpcCase("generate-text-not-utf8", "Generate", b"\x12\x02\xff\xfe", "INVALID_ARGUMENT", None,
             f"{MALFORMED} GenerateRequest message"),
    GrpcCase("generate-truncated", "Generate", b"\x12\x80", "INVALID_ARGUMENT", None,
             f"{MALFORMED} GenerateRequest message"),
    GrpcCase("generate-oversize", "Generate", _oversize, "RESOURCE_EXHAUSTED", None,
             "larger than max"),
    GrpcCase("generate-deadline-0", "Generate", LONG_GENERATION, "DEADLINE_EXCEEDED", None,
             "Deadline Exceeded", DEADLINE_0),
]

GRPC_OTHERS = [
    GrpcCase("abort-no-id", "Abort", pb.AbortRequest(), "INVALID_ARGUMENT", "request_id",
             "name the request to abort"),
    GrpcCase("abort-id-too-long", "Abort", pb.AbortRequest(request_id="r" * 257),
             "INVALID_ARGUMENT", "request_id", "at most 256 allowed"),
    GrpcCase("abort-malformed", "Abort", b"\x0a\x05", "INVALID_ARGUMENT", None,
             f"{MALFORMED} AbortRequest message"),
    GrpcCase("abort-id-not-utf8", "Abort", b"\x0a\x02\xff\xfe", "INVALID_ARGUMENT", None,
             f"{MALFORMED} AbortRequest message"),
    GrpcCase("explain-unknown-id", "ExplainDecision", pb.ExplainRequest(request_id="nope"),
             "NOT_FOUND", None,
             "no request 'nope' is in flight or among the recently finished ones"),
    GrpcCase("explain-no-id", "ExplainDecision", pb.ExplainRequest(), "INVALID_ARGUMENT",
             "request_id", "name the request to explain"),
    GrpcCase("explain-id-newline", "ExplainDecision", pb.ExplainRequest(request_id="a\nb"),
             "INVALID_ARGUMENT", "request_id", "printable"),
    GrpcCase("abort-id-tab", "Abort", pb.AbortRequest(request_id="a\tb"), "INVALID_ARGUMENT",
             "request_id", "printable"),
    GrpcCase("explain-id-too-long", "ExplainDecision", pb.ExplainRequest(request_id="r" * 257),
             "INVALID_ARGUMENT", "request_id", "at most 256 allowed"),
    GrpcCase("explain-malformed", "ExplainDecision", b"\x0a\x02\xc3\x28", "INVALID_ARGUMENT",
             None, f"{MALFORMED} ExplainRequest message"),
    GrpcCase("model-info-malformed", "GetModelInfo", b"\xff", "INVALID_ARGUMENT", None,
             f"{MALFORMED} GetModelInfoRequest message"),
    GrpcCase("server-info-malformed", "GetServerInfo", b"\x0f", "INVALID_ARGUMENT", None,
             f"{MALFORMED} GetServerInfoRequest message"),
    GrpcCase("unknown-method", "Nope", b"", "UNIMPLEMENTED", None, "Method not found"),
]
# fmt: on

HELD = "sampling.structured_output"


def _held(kind: str, spec: str) -> pb.StructuredOutput:
    return pb.StructuredOutput(kind=kind, spec=spec)


GRPC_SAMPLING_AND_GRAMMARS = [
    sampling(
        "logit-bias-301",
        "logit_bias",
        "at most 300 entries",
        logit_bias={i: 1.0 for i in range(301)},
    ),
    sampling("logit-bias-101", "logit_bias", "[-100, 100]", logit_bias={5: 101.0}),
    sampling("logit-bias-id-at-vocab", "logit_bias", "[0, 262)", logit_bias={262: 1.0}),
    sampling("n-0", "n", "[1, 16]", n=0),
    sampling("n-17", "n", "[1, 16]", n=17),
    sampling("structured-kind-xml", HELD, "xml", structured_output=_held("xml", "<a/>")),
    sampling(
        "structured-nested-repetition", HELD, TOO_LARGE, structured_output=_held("regex", NESTED)
    ),
    sampling(
        "structured-deep-json",
        HELD,
        "nests deeper than 32",
        structured_output=_held("json", "[" * 5000 + "]" * 5000),
    ),
    sampling(
        "structured-past-deadline",
        HELD,
        "did not build within",
        structured_output=_held("json", json.dumps(_string_pattern("(.*){1,4096}"))),
    ),
    sampling(
        "structured-choice-5000",
        HELD,
        "5,000 choices are over",
        structured_output=_held("choice", json.dumps([str(i) for i in range(5000)])),
    ),
]

GRPC_CASES: list[GrpcCase] = GRPC_GENERATE + GRPC_OTHERS + GRPC_SAMPLING_AND_GRAMMARS
