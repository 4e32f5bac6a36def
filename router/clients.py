"""Thin clients of the model services: deadlines on every call, gRPC errors turned into the
four things the step loop acts on (cache miss, service down, service error, request rejected).

Over TLS, a client whose certificate files change (rotation) opens a new channel for the calls
that follow and closes the old one once the calls on it are done (grace: the call deadline)."""

from __future__ import annotations

import asyncio
import time

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


STREAM_LIFETIME_S = 300.0  # a step stream is replaced this often (its deadline: this plus two step timeouts)
STREAM_IDLE_S = 1.0  # and closed after this long without a step
_DOWN = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
_BROKEN = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED, grpc.StatusCode.DATA_LOSS,
           grpc.StatusCode.UNIMPLEMENTED}
# gRPC's own library says this (our services say "internal error (log id ...)") when a write on an
# open stream meets a transport the server just tore down: the service went away, it did not break.
_CORE_INTERNAL = "Internal error from Core"


def _translate(err: grpc.aio.AioRpcError) -> Exception:
    code = err.code()
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        for key, value in err.trailing_metadata() or ():
            if key == CACHE_MISS_METADATA:
                return CacheMissError([int(s) for s in value.split(",") if s])
            if key == NOT_OWNER_METADATA:
                return NotOwner(value)
    if code in _DOWN or (code == grpc.StatusCode.INTERNAL and (err.details() or "").startswith(_CORE_INTERNAL)):
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
            # A channel of its own subchannels: by default gRPC shares them process-wide per address, so a
            # new channel to a replica that came back on the same address could inherit another channel's
            # connection backoff and fail its first call with "connection refused".
            options = [("grpc.max_receive_message_length", 64 * 2**20), ("grpc.initial_reconnect_backoff_ms", 200),
                       ("grpc.max_reconnect_backoff_ms", 2000), ("grpc.use_local_subchannel_pool", 1)]
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

    async def _call(self, method, request, timeout_s: float | None = None,  # noqa: ANN001, ANN202
                    metadata: tuple[tuple[str, str], ...] | None = None):
        try:
            if metadata and self._metadata:
                metadata = self._metadata + metadata
            return await method(request, timeout=timeout_s or self.timeout_s, metadata=metadata or self._metadata)
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
    """Steps go over one StepStream kept open while the router has work (a write and a read per step,
    no call setup: about half a unary call's round trip); a traced step is a unary Step, since its
    trace context travels as call metadata. The stream is closed when the router idles, when it fails,
    and every STREAM_LIFETIME_S, so its deadline can be finite; each step has its own (timeout_s)."""

    _stub_class = target_pb2_grpc.TargetServiceStub

    def __init__(self, address: str, timeout_s: float, tls: ClientTLS | None = None, router_id: str = "") -> None:
        super().__init__(address, timeout_s, tls, router_id)
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._stream_stub = None  # the stub (so the channel) the stream belongs to
        self._stream_until = 0.0
        self._last_step = 0.0
        self._stepping = asyncio.Lock()  # one step at a time on a stream: responses come back in order

    async def step(self, entries: list[target_pb2.StepEntry],
                   metadata: tuple[tuple[str, str], ...] | None = None) -> target_pb2.StepResponse:
        """metadata: the trace context, when tracing."""
        request = target_pb2.StepRequest(entries=entries)
        if metadata:
            return await self._call(self.stub.Step, request, metadata=metadata)
        async with self._stepping:
            return await self._streamed(request)

    async def _streamed(self, request: target_pb2.StepRequest) -> target_pb2.StepResponse:
        stub = self.stub
        if self._stream is None or self._stream_stub is not stub or time.monotonic() > self._stream_until:
            self.close_stream()
            self._stream = stub.StepStream(timeout=STREAM_LIFETIME_S + 2 * self.timeout_s, metadata=self._metadata)
            self._stream_stub, self._stream_until = stub, time.monotonic() + STREAM_LIFETIME_S
        request.timeout_ms = int(self.timeout_s * 1000)
        call = self._stream
        try:
            async with asyncio.timeout(self.timeout_s):
                await call.write(request)
                response = await call.read()
        except TimeoutError:
            self.close_stream()
            raise ServiceDown(f"DEADLINE_EXCEEDED: no step result within {self.timeout_s:.0f}s") from None
        except grpc.aio.AioRpcError as err:
            self.close_stream()
            raise _translate(err) from None
        except asyncio.InvalidStateError:  # the service ended the stream (shutting down) before this write
            self.close_stream()
            raise ServiceDown("UNAVAILABLE: the target ended its step stream") from None
        except BaseException:  # cancelled mid-step: the stream's next read would be this step's answer
            self.close_stream()
            raise
        if response is grpc.aio.EOF:
            self.close_stream()
            raise ServiceDown("UNAVAILABLE: the target ended its step stream (shutting down)")
        self._last_step = time.monotonic()
        return response

    def idle(self) -> None:
        """The router had nothing to step: after STREAM_IDLE_S of that its stream is closed, so that a
        service shutting down does not wait its grace period for an idle stream."""
        if self._stream is not None and time.monotonic() - self._last_step > STREAM_IDLE_S:
            self.close_stream()

    def close_stream(self) -> None:
        """Idle, failed or too old: the service's handler ends (or, cancelled, forgets) it."""
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None

    async def close(self) -> None:
        self.close_stream()
        await super().close()


class DraftClient(_Client):
    _stub_class = draft_pb2_grpc.DraftServiceStub

    async def sync(self, chunks: list[draft_pb2.Chunk]) -> draft_pb2.SyncResponse:
        return await self._call(self.stub.Sync, draft_pb2.SyncRequest(chunks=chunks))

    async def propose(self, entries: list[draft_pb2.ProposeEntry],
                      metadata: tuple[tuple[str, str], ...] | None = None) -> draft_pb2.ProposeResponse:
        return await self._call(self.stub.Propose, draft_pb2.ProposeRequest(entries=entries), metadata=metadata)
