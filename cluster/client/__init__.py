"""The Python clients of halfmoon's gRPC API."""

from halfmoon.cluster.client.grpc_client import AsyncClient, Client, ServerError

__all__ = ["AsyncClient", "Client", "ServerError"]
