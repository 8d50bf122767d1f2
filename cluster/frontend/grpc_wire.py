"""The servicer's registration: requests are decoded leniently, so bytes that are not a valid
message answer INVALID_ARGUMENT (not UNKNOWN with internal names), and `Generate` goes
through the server's `Drain`."""

from __future__ import annotations

from contextlib import aclosing, nullcontext
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError
from google.protobuf.message_factory import GetMessageClass

from halfmoon.cluster.api import halfmoon_pb2 as pb
from halfmoon.cluster.frontend.drain import Drain, ShuttingDownError
from halfmoon.cluster.frontend.grpc_errors import abort_with

SERVICE = pb.DESCRIPTOR.services_by_name["Halfmoon"]
# Only new generations (streams) are refused while draining; Abort and the info calls answer.
DRAINED_METHODS = frozenset({"Generate"})


@dataclass(frozen=True, slots=True)
class Malformed:
    """What the deserializer hands over when the bytes are not a valid message."""

    message: str


def add_servicer(servicer, server: grpc.aio.Server, drain: Drain) -> None:
    """Register every method of `SERVICE` on `server`, served by `servicer`."""
    handlers = {}
    for method in SERVICE.methods:
        request_type = GetMessageClass(method.input_type)
        response_type = GetMessageClass(method.output_type)
        behavior = getattr(servicer, method.name)
        gate = drain if method.name in DRAINED_METHODS else None
        if method.server_streaming:
            make, wrapped = grpc.unary_stream_rpc_method_handler, _stream(behavior, gate)
        else:
            make, wrapped = grpc.unary_unary_rpc_method_handler, _unary(behavior)
        handlers[method.name] = make(
            wrapped,
            request_deserializer=_lenient(request_type),
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )


def _lenient(message_type):
    name = message_type.DESCRIPTOR.name

    def deserialize(data: bytes):
        try:
            return message_type.FromString(data)
        except (DecodeError, ValueError):
            return Malformed(f"the request is not a valid {name} message")

    return deserialize


def _unary(behavior):
    async def handle(request, context):
        await _admit(request, context, None)
        return await behavior(request, context)

    return handle


def _stream(behavior, drain: Drain | None):
    async def handle(request, context):
        await _admit(request, context, drain)
        with drain.track() if drain is not None else nullcontext():
            async with aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response

    return handle


async def _admit(request, context, drain: Drain | None) -> None:
    """Abort the call when its bytes were malformed or the server is draining."""
    if isinstance(request, Malformed):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
    if drain is not None:
        try:
            drain.check_open()
        except ShuttingDownError as error:
            await abort_with(context, error)
