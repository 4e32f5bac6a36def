"""Thin clients of the model services: deadlines on every call, gRPC errors turned into the
four things the step loop acts on (cache miss, service down, service error, request rejected).

Over TLS, a client whose certificate files change (rotation) opens a new channel for the calls
that follow and closes the old one once the calls on it are done (grace: the call deadline)."""

from __future__ import annotations

import asyncio

import grpc

from common.protocol import CACHE_MISS_METADATA, NOT_OWNER_METADATA, ROUTER_METADATA
from common.tls import ClientTLS
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


class CacheMissError(Exception):
    """The service holds less than start_pos for these sequences: recompute them."""

    def __init__(self, seq_ids: list[int]) -> None:
        super().__init__(f"cache miss for {seq_ids}")
        self.seq_ids = seq_ids


class ServiceDown(Exception):
    """Unreachable, timed out or shutting down: the call may be retried once the service is back."""


class ServiceError(Exception):
    """The service answered, with an internal error: a bug or a fault in it, not a lost connection.
    Retrying the same call blindly may fail forever; the step loop isolates the cause instead."""


class NotOwner(Exception):
    """Another router holds the service's lease: this router must not use it (and lost what it had there)."""

    def __init__(self, owner: str) -> None:
        super().__init__(f"the service is leased to another router ({owner})")
        self.owner = owner


class Rejected(Exception):
    """The service refused the call (INVALID_ARGUMENT or RESOURCE_EXHAUSTED): a router-side bug or
    a bad request that slipped through; `code` says which."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
_BROKEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS,
           grpc.StatusCode.UNIMPLEMENTED}


def _translate(err: grpc.aio.AioRpcError) -> Exception:
    code = err.code()
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        for key, value in err.trailing_metadata() or ():
            if key == CACHE_MISS_METADATA:
                return CacheMissError([int(s) for s in value.split(",") if s])
            if key == NOT_OWNER_METADATA:
                return NotOwner(value)
    if code in _DOWN:
        return ServiceDown(f"{code.name}: {err.details()}")
    if code in _BROKEN:
        return ServiceError(f"{code.name}: {err.details()}")
    return Rejected(code, err.details() or "")


class _Client:
    def __init__(self, address: str, timeout_s: float, tls: ClientTLS | None = None, router_id: str = "") -> None:
        self.address = address
        self.timeout_s = timeout_s
        self.tls = tls
        self.router_id = router_id
        self._metadata = ((ROUTER_METADATA, router_id),) if router_id else None
        self._channel: grpc.aio.Channel | None = None
        self._stub = None
        self._generation = 0  # of the certificates the channel was built with
        self._retiring: dict[asyncio.Task, grpc.aio.Channel] = {}

    @property
    def stub(self):  # noqa: ANN201
        """Created on first use, inside the event loop that will drive it (grpc.aio binds to it)."""
        if self.tls is not None and self._stub is not None and self.tls.certs.refresh() != self._generation:
            self._retire()
        if self._stub is None:
            options = [("grpc.max_receive_message_length", 64 * 2**20), ("grpc.initial_reconnect_backoff_ms", 200),
                       ("grpc.max_reconnect_backoff_ms", 2000)]
            if self.tls is None:
                self._channel = grpc.aio.insecure_channel(self.address, options=options)
            else:
                self._generation = self.tls.certs.refresh()
                self._channel = grpc.aio.secure_channel(self.address, self.tls.credentials(),
                                                        options=options + self.tls.options())
            self._stub = self._stub_class(self._channel)
        return self._stub

    def _retire(self) -> None:
        old, self._channel, self._stub = self._channel, None, None
        task = asyncio.get_running_loop().create_task(old.close(grace=self.timeout_s))
        self._retiring[task] = old
        task.add_done_callback(self._retiring.pop)

    async def _call(self, method, request, timeout_s: float | None = None):  # noqa: ANN001, ANN202
        try:
            return await method(request, timeout=timeout_s or self.timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as err:
            raise _translate(err) from None

    async def info(self, timeout_s: float = 5.0) -> common_pb2.ModelInfo:
        return await self._call(self.stub.GetInfo, common_pb2.GetInfoRequest(), timeout_s)

    async def release(self, seq_ids: list[int]) -> None:
        await self._call(self.stub.Release, common_pb2.ReleaseRequest(seq_ids=seq_ids), 5.0)

    async def lease(self, ttl_s: float, release: bool = False) -> common_pb2.LeaseResponse:
        """Claim or renew this router's lease on the service (or give it up)."""
        request = common_pb2.LeaseRequest(router_id=self.router_id, ttl_ms=int(ttl_s * 1000), release=release)
        return await self._call(self.stub.Lease, request, 5.0)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        for task, channel in list(self._retiring.items()):
            task.cancel()
            await channel.close()


class TargetClient(_Client):
    _stub_class = target_pb2_grpc.TargetServiceStub

    async def step(self, entries: list[target_pb2.StepEntry]) -> target_pb2.StepResponse:
        return await self._call(self.stub.Step, target_pb2.StepRequest(entries=entries))


class DraftClient(_Client):
    _stub_class = draft_pb2_grpc.DraftServiceStub

    async def sync(self, chunks: list[draft_pb2.Chunk]) -> draft_pb2.SyncResponse:
        return await self._call(self.stub.Sync, draft_pb2.SyncRequest(chunks=chunks))

    async def propose(self, entries: list[draft_pb2.ProposeEntry]) -> draft_pb2.ProposeResponse:
        return await self._call(self.stub.Propose, draft_pb2.ProposeRequest(entries=entries))
