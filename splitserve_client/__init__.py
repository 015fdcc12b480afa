"""The splitserve client SDK: a gRPC client of the router that needs only grpcio and protobuf.

    from splitserve_client import Client

    with Client("127.0.0.1:50051") as client:
        print(client.generate("Hello", max_tokens=16).text)

docs/api.md describes the API, its fields and its errors.
"""

from splitserve_client.client import AsyncClient, Client
from splitserve_client.sdk_types import (
    AlreadyExists,
    ClusterStatus,
    Completion,
    DeadlineExceeded,
    GenerateChunk,
    InvalidArgument,
    ModelInfo,
    ResourceExhausted,
    SplitserveError,
    Unauthenticated,
    Unavailable,
)

__all__ = [
    "AlreadyExists",
    "AsyncClient",
    "Client",
    "ClusterStatus",
    "Completion",
    "DeadlineExceeded",
    "GenerateChunk",
    "InvalidArgument",
    "ModelInfo",
    "ResourceExhausted",
    "SplitserveError",
    "Unauthenticated",
    "Unavailable",
]
