"""What stops a request in the decode server, shared by its core, its KV transfers and both front ends:
ServiceError (a request the service cannot take now, with the gRPC status the fronts answer with) and the
check that an engine stream's item is not the engine's failure."""

from __future__ import annotations

import grpc

from pdserve.services.engine_loop import EngineFailure, EngineStopped


class ServiceError(Exception):
    """A request the service cannot take now: a gRPC status (HTTP front: 429 / 503) and a message."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_ms = code, message, retry_after_ms


def checked(item):
    """A stream's item, unless it says the engine stopped (EngineStopped) or is a ServiceError (a relay
    from a peer that failed: services.decode.migration), raised."""
    if isinstance(item, EngineFailure):
        raise EngineStopped(item.message)
    if isinstance(item, ServiceError):
        raise item
    return item
