"""Thin clients of the model services: deadlines on every call, gRPC errors turned into the
four things the step loop acts on (cache miss, service down, service error, request rejected).

Over TLS, a client whose certificate files change (rotation) opens a new channel for the calls
that follow and closes the old one once the calls on it are done (grace: the call deadline)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from common.protocol import CACHE_MISS_METADATA, MISSING_ADAPTER_METADATA, NOT_OWNER_METADATA, ROUTER_METADATA
from common.tls import ClientTLS
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc


class CacheMissError(Exception):
    """The service holds less than start_pos for these sequences: recompute them."""

    def __init__(self, seq_ids: list[int]) -> None:
        super().__init__(f"cache miss for {seq_ids}")
        self.seq_ids = seq_ids


class ServiceDown(Exception):
    """Unreachable, timed out or shutting down: the call may be retried once the service is back."""


class AdapterMissing(ServiceDown):
    """The target does not hold a LoRA adapter this router serves (it restarted, or lost it): recover
    it as a service that came back, which loads the adapter again (router.adapters.admit)."""

    def __init__(self, adapter: str) -> None:
        super().__init__(f"the target holds no LoRA adapter {adapter!r}")


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
            if key == MISSING_ADAPTER_METADATA:
                return AdapterMissing(value)
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


class _CallStream:
    """Calls over one stream the client keeps open while it has work (engine/streams.py): a write and
    a read per call, no call setup, about half a unary call's round trip. The stream is closed when
    the caller idles, when a call fails, and every STREAM_LIFETIME_S, so its deadline can be finite;
    each call has its own (timeout_ms, and the client's timer)."""

    def __init__(self, client: _Client, method: str, what: str) -> None:
        self._client = client
        self._method = method  # the stub's stream method
        self._what = what  # a call's result, in errors: "step", "proposal"
        self._stream: grpc.aio.StreamStreamCall | None = None
        self._stub = None  # the stub (so the channel) the stream belongs to
        self._until = 0.0
        self._last = 0.0
        self._lock = asyncio.Lock()  # one call() at a time on a stream: responses come back in order
        self._unread = 0  # calls sent on the stream whose answers were not read yet

    async def call(self, request):  # noqa: ANN001, ANN201
        async with self._lock:
            return await self.receive(await self.send(request))

    async def send(self, request) -> grpc.aio.StreamStreamCall:  # noqa: ANN001
        """Write a call's request without waiting for its answer: receive(ticket) reads it, after the
        answers of the calls sent before it (the step loop chains a step behind the one running)."""
        client = self._client
        stub = client.stub
        renew = self._stub is not stub or time.monotonic() > self._until  # new certificates, or its lifetime is up
        if self._stream is None or (renew and not self._unread):  # (a call awaiting its answer keeps it open)
            self.close()
            self._stream = getattr(stub, self._method)(timeout=STREAM_LIFETIME_S + 2 * client.timeout_s,
                                                       metadata=client._metadata)
            self._stub, self._until = stub, time.monotonic() + STREAM_LIFETIME_S
        request.timeout_ms = int(client.timeout_s * 1000)
        call = self._stream
        with self._failures(close=not self._unread):  # else the answer of a call ahead says why it failed
            async with asyncio.timeout(client.timeout_s):
                await call.write(request)
        self._unread += 1
        return call

    async def receive(self, ticket: grpc.aio.StreamStreamCall):  # noqa: ANN201
        """The answer to the call `send` returned `ticket` for (calls are answered in the order sent)."""
        if ticket is not self._stream:  # a call sent before it failed, and ended the stream
            raise ServiceDown(f"UNAVAILABLE: the {self._method} ended before this {self._what}")
        with self._failures():
            async with asyncio.timeout(self._client.timeout_s):
                response = await ticket.read()
        self._unread -= 1
        if response is grpc.aio.EOF:
            self.close()
            raise ServiceDown(f"UNAVAILABLE: the service ended its {self._method} (shutting down)")
        self._last = time.monotonic()
        return response

    @contextmanager
    def _failures(self, close: bool = True) -> Iterator[None]:
        """A failed or abandoned call closes the stream (its next read would be this call's answer)."""
        try:
            yield
        except TimeoutError:
            self._end(close)
            raise ServiceDown(f"DEADLINE_EXCEEDED: no {self._what} within {self._client.timeout_s:.0f}s") from None
        except grpc.aio.AioRpcError as err:
            self._end(close)
            raise _translate(err) from None
        except asyncio.InvalidStateError:  # the service ended the stream (shutting down) before this write
            self._end(close)
            raise ServiceDown(f"UNAVAILABLE: the service ended its {self._method}") from None
        except BaseException:  # cancelled mid-call
            self._end(close)
            raise

    def _end(self, close: bool) -> None:
        if close:
            self.close()

    def idle(self) -> None:
        """The caller had nothing to send: after STREAM_IDLE_S of that its stream is closed, so that a
        service shutting down does not wait its grace period for an idle stream."""
        if self._stream is not None and not self._unread and time.monotonic() - self._last > STREAM_IDLE_S:
            self.close()

    def close(self) -> None:
        """Idle, failed or too old: the service's handler ends (or, cancelled, forgets) it."""
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None
            self._unread = 0


class TargetClient(_Client):
    """Steps go over one StepStream (_CallStream); a traced step is a unary Step, since its trace
    context travels as call metadata."""

    _stub_class = target_pb2_grpc.TargetServiceStub

    def __init__(self, address: str, timeout_s: float, tls: ClientTLS | None = None, router_id: str = "") -> None:
        super().__init__(address, timeout_s, tls, router_id)
        self.steps = _CallStream(self, "StepStream", "step result")

    async def step(self, entries: list[target_pb2.StepEntry],
                   metadata: tuple[tuple[str, str], ...] | None = None) -> target_pb2.StepResponse:
        """metadata: the trace context, when tracing."""
        request = target_pb2.StepRequest(entries=entries)
        if metadata:
            return await self._call(self.stub.Step, request, metadata=metadata)
        return await self.steps.call(request)

    async def send_step(self, entries: list[target_pb2.StepEntry]) -> grpc.aio.StreamStreamCall:
        """A step on the StepStream whose answer is read later (receive_step), so that the next step can
        be sent, chained, while this one runs."""
        return await self.steps.send(target_pb2.StepRequest(entries=entries))

    async def receive_step(self, ticket: grpc.aio.StreamStreamCall) -> target_pb2.StepResponse:
        return await self.steps.receive(ticket)

    async def load_lora(self, name: str, path: str, timeout_s: float) -> common_pb2.LoraAdapterInfo:
        return await self._call(self.stub.LoadLoraAdapter, target_pb2.LoadLoraAdapterRequest(name=name, path=path),
                                timeout_s)

    async def unload_lora(self, name: str) -> None:
        await self._call(self.stub.UnloadLoraAdapter, target_pb2.UnloadLoraAdapterRequest(name=name), 10.0)

    def idle(self) -> None:
        self.steps.idle()

    async def close(self) -> None:
        self.steps.close()
        await super().close()


class DraftClient(_Client):
    """Proposals go over one ProposeStream (_CallStream); a traced call is a unary Propose."""

    _stub_class = draft_pb2_grpc.DraftServiceStub

    def __init__(self, address: str, timeout_s: float, tls: ClientTLS | None = None, router_id: str = "") -> None:
        super().__init__(address, timeout_s, tls, router_id)
        self.proposals = _CallStream(self, "ProposeStream", "proposals")

    async def sync(self, chunks: list[draft_pb2.Chunk]) -> draft_pb2.SyncResponse:
        return await self._call(self.stub.Sync, draft_pb2.SyncRequest(chunks=chunks))

    async def propose(self, entries: list[draft_pb2.ProposeEntry], metadata: tuple[tuple[str, str], ...] | None = None,
                      stop_after_ms: float = 0.0) -> draft_pb2.ProposeResponse:
        """stop_after_ms: a time to stop drafting by (ProposeRequest.stop_after_ms; 0: none)."""
        request = draft_pb2.ProposeRequest(entries=entries, stop_after_ms=stop_after_ms)
        if metadata:
            return await self._call(self.stub.Propose, request, metadata=metadata)
        return await self.proposals.call(request)

    def idle(self) -> None:
        self.proposals.idle()

    async def close(self) -> None:
        self.proposals.close()
        await super().close()
