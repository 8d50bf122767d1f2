"""Python clients of the gRPC API: `Client` (blocking) and `AsyncClient` (asyncio), streaming."""

from __future__ import annotations

import asyncio
import json
import types
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import grpc

from halfmoon.cluster.api import halfmoon_pb2 as pb
from halfmoon.cluster.api import halfmoon_pb2_grpc as pb_grpc
from halfmoon.cluster.frontend.auth import bearer_metadata
from halfmoon.cluster.frontend.grpc_convert import (
    delta_from_proto,
    model_info_from_proto,
    request_to_proto,
)
from halfmoon.cluster.frontend.grpc_errors import ServerError
from halfmoon.cluster.serving.backend import ModelInfo, TokenDelta, Usage
from halfmoon.engine.sequence import TokenLogprobs
from halfmoon.engine.tokenizer import Prompt

__all__ = ["AsyncClient", "AsyncStream", "Client", "Completion", "ServerError", "Stream"]
DEFAULT_ADDRESS = "127.0.0.1:50051"


@dataclass(slots=True)
class Completion:
    """A whole request's result, joined from its deltas: its first sequence's tokens, text and
    finish reason, and with `n` > 1 every sequence's own in `choices` (by index)."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    choices: list[Completion] = field(default_factory=list)

    def add(self, delta: TokenDelta) -> None:
        while len(self.choices) <= delta.index:
            self.choices.append(Completion(self.request_id))
        self.choices[delta.index].join(delta)
        if delta.index == 0:
            self.join(delta)
        self.usage = delta.usage or self.usage

    def join(self, delta: TokenDelta) -> None:
        """Add one sequence's delta to this sequence's fields."""
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.logprobs += delta.logprobs
        self.finish_reason = delta.finish_reason or self.finish_reason
        self.usage = delta.usage or self.usage


@dataclass(slots=True)
class ServerInfo:
    version: str
    mode: str
    model: str
    details: dict


class _Stream:
    """A started Generate call and its request id."""

    def __init__(self, call, request_id: str) -> None:
        self._call = call
        self.request_id = request_id

    def cancel(self) -> None:
        self._call.cancel()


class Stream(_Stream):
    """A request's deltas as they arrive; `cancel()` aborts the request on the server."""

    def __iter__(self) -> Iterator[TokenDelta]:
        return self

    def __next__(self) -> TokenDelta:
        try:
            return delta_from_proto(next(self._call))
        except grpc.RpcError as error:
            raise ServerError.from_rpc(error) from None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.cancel()


class AsyncStream(_Stream):
    """A request's deltas as they arrive (asyncio); `cancel()` aborts it on the server."""

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        return self

    async def __anext__(self) -> TokenDelta:
        try:
            response = await self._call.read()
        except grpc.RpcError as error:
            raise ServerError.from_rpc(error) from None
        except asyncio.CancelledError:
            if self._call.cancelled():
                raise ServerError("CANCELLED", "the request was cancelled by the client") from None
            raise
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return delta_from_proto(response)

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(self, *exc) -> None:
        self.cancel()


def channel_credentials(tls_ca: str | None) -> grpc.ChannelCredentials | None:
    """TLS credentials trusting the PEM CA file `tls_ca`; None: a plaintext channel."""
    if tls_ca is None:
        return None
    with open(tls_ca, "rb") as file:
        return grpc.ssl_channel_credentials(root_certificates=file.read())


def _server_info(info: pb.ServerInfo) -> ServerInfo:
    return ServerInfo(info.version, info.mode, info.model, json.loads(info.json or "{}"))


StreamT = TypeVar("StreamT", Stream, AsyncStream)


class _ClientBase(Generic[StreamT]):
    """The channel, stub and credentials both clients share, and how a request is started."""

    _stream: type[StreamT]
    _channels: types.ModuleType  # grpc or grpc.aio

    def __init__(
        self, address: str = DEFAULT_ADDRESS, tls_ca: str | None = None, api_key: str | None = None
    ) -> None:
        self.address = address
        credentials = channel_credentials(tls_ca)
        self._channel = (
            self._channels.insecure_channel(address)
            if credentials is None
            else self._channels.secure_channel(address, credentials)
        )
        self._stub = pb_grpc.HalfmoonStub(self._channel)
        self._metadata = bearer_metadata(api_key)

    def generate(
        self,
        prompt: Prompt,
        *,
        request_id: str | None = None,
        timeout: float | None = None,
        ttft_slo_s: float | None = None,
        tbt_slo_s: float | None = None,
        **sampling,
    ) -> StreamT:
        """Start a request (text, token ids or chat messages); `sampling` as in SamplingParams."""
        request_id = request_id or uuid.uuid4().hex
        request = request_to_proto(request_id, prompt, sampling, ttft_slo_s, tbt_slo_s)
        call = self._stub.Generate(request, timeout=timeout, metadata=self._metadata)
        return self._stream(call, request_id)


class Client(_ClientBase[Stream]):
    """Blocking client: `generate` streams deltas, `complete` returns the whole result.
    `tls_ca`: connect over TLS, trusting the server certificate's CA (a PEM file); `api_key` is
    sent with every call when the server requires one."""

    _stream, _channels = Stream, grpc

    def complete(self, prompt: Prompt, **kwargs) -> Completion:
        """Run a request to the end; takes `generate`'s arguments."""
        with self.generate(prompt, **kwargs) as stream:
            result = Completion(stream.request_id)
            for delta in stream:
                result.add(delta)
            return result

    def abort(self, request_id: str, timeout: float | None = None) -> bool:
        """Abort a request in flight; False if the server knows no such request."""
        reply = self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout)
        return reply.aborted

    def model_info(self, timeout: float | None = None) -> ModelInfo:
        info = self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        return model_info_from_proto(info)

    def server_info(self, timeout: float | None = None) -> ServerInfo:
        info = self._unary(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)
        return _server_info(info)

    def explain(self, request_id: str, timeout: float | None = None) -> str:
        """The router's account of where a recent request went and why."""
        request = pb.ExplainRequest(request_id=request_id)
        return self._unary(self._stub.ExplainDecision, request, timeout).text

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _unary(self, method, request, timeout: float | None):
        try:
            return method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise ServerError.from_rpc(error) from None


class AsyncClient(_ClientBase[AsyncStream]):
    """asyncio client with the same methods as `Client`, as coroutines and async streams."""

    _stream, _channels = AsyncStream, grpc.aio

    async def complete(self, prompt: Prompt, **kwargs) -> Completion:
        """Run a request to the end; takes `generate`'s arguments."""
        async with self.generate(prompt, **kwargs) as stream:
            result = Completion(stream.request_id)
            async for delta in stream:
                result.add(delta)
            return result

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        """Abort a request in flight; False if the server knows no such request."""
        reply = await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout)
        return reply.aborted

    async def model_info(self, timeout: float | None = None) -> ModelInfo:
        info = await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)
        return model_info_from_proto(info)

    async def server_info(self, timeout: float | None = None) -> ServerInfo:
        info = await self._unary(self._stub.GetServerInfo, pb.GetServerInfoRequest(), timeout)
        return _server_info(info)

    async def explain(self, request_id: str, timeout: float | None = None) -> str:
        """The router's account of where a recent request went and why."""
        request = pb.ExplainRequest(request_id=request_id)
        return (await self._unary(self._stub.ExplainDecision, request, timeout)).text

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _unary(self, method, request, timeout: float | None):
        try:
            return await method(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as error:
            raise ServerError.from_rpc(error) from None
