"""The servers `bench serve` sends load to: halfmoon's gRPC API, or an OpenAI-compatible HTTP
API (`/v1/completions` or `/v1/chat/completions`, streamed as server-sent events)."""

from __future__ import annotations

import json
import time

import httpx2

from halfmoon.bench.metrics import RequestResult
from halfmoon.bench.workload import BenchRequest
from halfmoon.cluster.client.grpc_client import AsyncClient, ServerError

BACKENDS = ("grpc", "openai", "openai-chat")
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
CONNECT_TIMEOUT_S = 10.0


class TargetUnreachableError(ConnectionError):
    """The server cannot be reached or refuses the benchmark; the message says what to fix."""


class GrpcTarget:
    """halfmoon's `Generate` stream; prompts go as token ids."""

    def __init__(self, address: str, timeout_s: float, api_key: str | None = None) -> None:
        self.label = f"grpc://{address}"
        self.address = address
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.server: dict = {}
        self._client: AsyncClient | None = None

    async def open(self, vocabulary_max_id: int) -> None:
        """Connect and check that the model takes the workload's token ids."""
        self._client = AsyncClient(self.address, api_key=self.api_key)
        try:
            info = await self._client.model_info(timeout=CONNECT_TIMEOUT_S)
        except ServerError as error:
            raise TargetUnreachableError(
                f"cannot reach the halfmoon gRPC server at {self.address} ({error}); start one "
                "with `halfmoon serve`, or point --server / --compare at a running one"
            ) from None
        if vocabulary_max_id >= info.vocab_size:
            raise TargetUnreachableError(
                f"the prompts use token id {vocabulary_max_id} but {info.model} has "
                f"{info.vocab_size} ids; pass --tokenizer for the server's model"
            )
        server = await self._client.server_info(timeout=CONNECT_TIMEOUT_S)
        self.server = {"model": server.model, "mode": server.mode, "version": server.version}

    async def send(self, request: BenchRequest, started: float) -> RequestResult:
        sent = time.perf_counter()
        result = RequestResult(sent - started, len(request.prompt_token_ids))
        stream = self._client.generate(
            request.prompt_token_ids,
            max_tokens=request.max_tokens,
            ignore_eos=True,
            temperature=0.0,
            timeout=self.timeout_s,
        )
        stamps = TokenStamps(sent, result)
        try:
            async with stream:
                async for delta in stream:
                    stamps.add(len(delta.token_ids))
                    if delta.usage is not None:
                        result.num_prompt_tokens = delta.usage.prompt_tokens
        except ServerError as error:
            result.error, result.error_message = error.code, str(error)
        stamps.finish()
        return result

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()


class OpenAITarget:
    """An OpenAI-compatible server: completions take token ids (or text), chat takes text."""

    def __init__(
        self,
        base_url: str,
        backend: str,
        *,
        model: str | None,
        api_key: str | None,
        as_text: bool,
        tokenizer,
        timeout_s: float,
        endpoint: str | None = None,
    ) -> None:
        self.label = base_url.rstrip("/")
        self.backend = backend
        self.url = self.label + (endpoint or ENDPOINTS[backend])
        self.model = model
        self.server: dict = {}
        self.as_text = as_text or backend == "openai-chat"
        self.tokenizer = tokenizer
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx2.AsyncClient(
            headers=headers,
            timeout=httpx2.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
            limits=httpx2.Limits(max_connections=None, max_keepalive_connections=None),
        )

    async def open(self, vocabulary_max_id: int) -> None:
        """Check the server answers `GET /v1/models`; take its first model unless one is set."""
        try:
            response = await self._http.get(self.label + "/v1/models")
        except httpx2.TransportError as error:
            raise TargetUnreachableError(
                f"cannot reach the OpenAI-compatible server at {self.label} ({error!r}); start "
                "it, or point --base-url / --compare at a running one"
            ) from None
        if response.status_code == 401:
            raise TargetUnreachableError(
                f"{self.label} refused the API key (HTTP 401); pass --api-key or set "
                "HALFMOON_API_KEY"
            )
        if response.status_code != 200:
            raise TargetUnreachableError(
                f"GET {self.label}/v1/models answered HTTP {response.status_code}: "
                f"{response.text[:200]}"
            )
        if self.model is None:
            models = response.json().get("data") or []
            if not models:
                raise TargetUnreachableError(f"{self.label} serves no model; pass --model")
            self.model = models[0]["id"]
        self.server = {"model": self.model}

    def body(self, request: BenchRequest) -> dict:
        """The request body; `ignore_eos` is the extra field vLLM and halfmoon accept."""
        prompt = request.prompt_token_ids
        if self.as_text:
            prompt = self.tokenizer.decode(prompt)
        body = {
            "model": self.model,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
            "ignore_eos": True,
        }
        if self.backend == "openai-chat":
            body["messages"] = [{"role": "user", "content": prompt}]
            body["max_completion_tokens"] = request.max_tokens
        else:
            body["prompt"] = prompt
            body["max_tokens"] = request.max_tokens
        return body

    async def send(self, request: BenchRequest, started: float) -> RequestResult:
        sent = time.perf_counter()
        result = RequestResult(sent - started, len(request.prompt_token_ids))
        stamps = TokenStamps(sent, result)
        try:
            async with self._http.stream("POST", self.url, json=self.body(request)) as response:
                if response.status_code != 200:
                    result.error = f"HTTP_{response.status_code}"
                    result.error_message = error_message(await response.aread())
                    return result
                await self._read_events(response, stamps)
        except httpx2.TimeoutException as error:
            result.error, result.error_message = "TIMEOUT", repr(error)
        except httpx2.TransportError as error:
            result.error, result.error_message = "CONNECTION_ERROR", repr(error)
        except ValueError as error:  # an event that is not JSON
            result.error, result.error_message = "BAD_STREAM", str(error)[:300]
        if result.ok:
            stamps.finish()
        return result

    async def _read_events(self, response, stamps: TokenStamps) -> None:
        """Parse `data: {...}` events up to `data: [DONE]`; text deltas are token arrivals."""
        result = stamps.result
        usage = None
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = "STREAM_ERROR"
                result.error_message = str(chunk["error"])[:300]
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if choice.get("text") or delta.get("content"):
                    stamps.add(1)
        if usage:
            result.num_prompt_tokens = usage.get("prompt_tokens", result.num_prompt_tokens)
            result.num_output_tokens = usage.get("completion_tokens", result.num_output_tokens)

    async def close(self) -> None:
        await self._http.aclose()


class TokenStamps:
    """Arrival times of a request's streamed chunks: TTFT, then one ITL per later chunk."""

    def __init__(self, sent: float, result: RequestResult) -> None:
        self.sent = sent
        self.last = sent
        self.result = result

    def add(self, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.perf_counter()
        if self.result.num_output_tokens == 0:
            self.result.ttft_s = now - self.sent
        else:
            self.result.itl_s.append(now - self.last)
        self.last = now
        self.result.num_output_tokens += num_tokens

    def finish(self) -> None:
        self.result.e2el_s = time.perf_counter() - self.sent
        if self.result.ok and self.result.num_output_tokens == 0:
            self.result.error, self.result.error_message = "NO_OUTPUT", "the stream had no token"


def error_message(body: bytes) -> str:
    """An OpenAI error object's message, or the start of the body."""
    try:
        return str(json.loads(body)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError):
        return body.decode(errors="replace")[:300]


def make_target(spec: str, args, tokenizer):
    """A target from `[grpc://]HOST:PORT` or `http(s)://...` (the flavour of --backend)."""
    if spec.startswith(("http://", "https://")):
        backend = args.backend if args.backend != "grpc" else "openai"
        return OpenAITarget(
            spec,
            backend,
            model=args.model,
            api_key=args.api_key,
            as_text=args.prompt_format == "text",
            tokenizer=tokenizer,
            timeout_s=args.request_timeout,
            endpoint=args.endpoint,
        )
    return GrpcTarget(spec.removeprefix("grpc://"), args.request_timeout, args.api_key)
