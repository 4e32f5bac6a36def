"""Who may use the public doors, and how much: API keys and per-client limits.

Keys (--api-key, --api-key-file) are held only as SHA-256 digests and compared in constant time;
no key, right or wrong, is ever logged or echoed. The key file is re-read when it changes (or on
SIGHUP), so keys rotate without a restart. With keys on, every /v1/* route, /tokenize and
/detokenize (and /metrics with --metrics-require-key) need `Authorization: Bearer KEY` (or, as Anthropic's
clients send it, `x-api-key: KEY`), and the
gRPC Generate service the same `authorization` metadata: 401 / UNAUTHENTICATED otherwise.
/health, /ready, gRPC health and reflection stay open.

Limits, each off by default, hold per client: per key, or, with keys off, one anonymous client
for everybody. A token bucket of requests (rate, burst) and a cap on requests in flight (a stream
counts until it ends); past either, 429 with Retry-After / RESOURCE_EXHAUSTED with retry-after."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import logging
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from common.reload import POLL_S, FileSet
from router.core import CLIENT, TENANT

log = logging.getLogger(__name__)
ANONYMOUS = b"anonymous"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def read_key_file(path: Path) -> frozenset[bytes]:
    """One key per line; blank lines and lines starting with # are skipped."""
    lines = (line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    return frozenset(_digest(line) for line in lines if line and not line.startswith("#"))


class ApiKeys:
    def __init__(self, keys: Iterable[str] = (), file: Path | None = None, poll_s: float = POLL_S) -> None:
        self._inline = frozenset(_digest(k) for k in keys if k)
        self.file = file
        self._watch = FileSet([file], poll_s) if file is not None else None
        try:
            self._from_file = read_key_file(file) if file is not None else frozenset()
        except (OSError, UnicodeDecodeError) as err:
            raise ValueError(f"--api-key-file {file}: {err.__class__.__name__}") from None
        if file is not None and not self._from_file:
            raise ValueError(f"--api-key-file {file} holds no key: refusing to serve without one")

    def __len__(self) -> int:
        return len(self._inline | self._from_file)

    def identify(self, presented: str | None) -> bytes | None:
        """The client id (the key's digest) of a valid key, else None. Every stored digest is
        compared, so the time taken does not depend on which one matches or how much of it."""
        self._refresh()
        if presented is None:
            return None
        digest, found = _digest(presented), None
        for known in self._inline | self._from_file:
            if hmac.compare_digest(known, digest):
                found = known
        return found

    def _refresh(self) -> None:
        signature = self._watch.due() if self._watch is not None else None
        if signature is None:
            return
        try:
            keys = read_key_file(self.file)
        except (OSError, UnicodeDecodeError) as err:
            log.warning("cannot re-read --api-key-file %s (%s); keeping the current keys", self.file,
                        err.__class__.__name__)
            return
        if not keys:
            log.warning("--api-key-file %s is now empty; keeping the current keys", self.file)
            return
        self._watch.accept(signature)
        if keys != self._from_file:
            self._from_file = keys
            log.info("API keys reloaded from %s: %d keys", self.file, len(self))


@dataclass(frozen=True)
class Limits:
    rate_rps: float = 0.0  # requests per second per client (token bucket refill); 0: unlimited
    burst: int = 0  # bucket size; 0: max(1, rate_rps)
    max_concurrent: int = 0  # requests in flight per client (a stream counts until it ends); 0: unlimited

    def __post_init__(self) -> None:
        if self.rate_rps < 0 or self.burst < 0 or self.max_concurrent < 0:
            raise ValueError("rate limits must be >= 0 (0: off)")

    @property
    def any(self) -> bool:
        return bool(self.rate_rps or self.max_concurrent)


class TokenBucket:
    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate, self.burst, self.tokens, self.last = rate, burst, burst, now

    def take(self, now: float) -> float:
        """0 if a token was taken, else the seconds until one will be there."""
        self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
        self.last = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


@dataclass
class Admission:
    """A door's answer to one request: let in (release() when it ends), or refused."""

    status: int = 200  # 401 or 429 when refused
    message: str = ""
    retry_after: int = 0
    _release: Callable[[], None] | None = None
    client: bytes = b""  # the key's digest (b"": keys are off), who owns what the call stores
    tenant: bytes = b""  # with --cache-salt-per-key: the key's digest, whose own prefix cache it uses

    @property
    def ok(self) -> bool:
        return self.status == 200

    def release(self) -> None:
        if self._release is not None:
            self._release, release = None, self._release
            release()

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """While the call it let in runs: who calls (CLIENT) and whose prefix cache (TENANT); then released."""
        client, tenant = CLIENT.set(self.client), TENANT.set(self.tenant)
        try:
            yield
        finally:
            TENANT.reset(tenant)
            CLIENT.reset(client)
            self.release()


class Guard:
    """Keys and limits for both doors (one event loop: no locks needed)."""

    def __init__(self, keys: ApiKeys | None, limits: Limits, clock: Callable[[], float] = time.monotonic,
                 salt_per_key: bool = False) -> None:
        assert keys is not None or not salt_per_key, "a prefix cache per key needs keys"
        self.keys, self.limits, self.clock, self.salt_per_key = keys, limits, clock, salt_per_key
        self._buckets: dict[bytes, TokenBucket] = {}
        self._in_flight: dict[bytes, int] = {}

    def admit(self, authorization: str | None) -> Admission:
        """authorization: the header / metadata value, `Bearer KEY`."""
        client = ANONYMOUS
        if self.keys is not None:
            if not authorization:
                return Admission(401, "missing API key: send the header `Authorization: Bearer <key>`")
            scheme, _, token = authorization.partition(" ")
            client = self.keys.identify(token.strip()) if scheme.lower() == "bearer" else None
            if client is None:
                return Admission(401, "invalid API key")
        lim = self.limits
        if lim.max_concurrent and self._in_flight.get(client, 0) >= lim.max_concurrent:
            return Admission(429, f"too many concurrent requests for this key (limit {lim.max_concurrent})", 1)
        if lim.rate_rps:
            now = self.clock()
            bucket = self._buckets.get(client)
            if bucket is None:
                bucket = self._buckets[client] = TokenBucket(lim.rate_rps, lim.burst or max(1.0, lim.rate_rps), now)
            wait = bucket.take(now)
            if wait:
                return Admission(429, f"rate limit exceeded ({lim.rate_rps:g} requests/s per key)",
                                 max(1, math.ceil(wait)))
        self._in_flight[client] = self._in_flight.get(client, 0) + 1
        return Admission(_release=lambda: self._done(client), client=b"" if client == ANONYMOUS else client,
                         tenant=client if self.salt_per_key else b"")

    def _done(self, client: bytes) -> None:
        left = self._in_flight[client] - 1
        if left:
            self._in_flight[client] = left
        else:
            del self._in_flight[client]


# ---- HTTP: ASGI middleware -----------------------------------------------------------------------
class HTTPGuard:
    """Guards /v1/*, /tokenize and /detokenize (and /metrics when asked); everything else passes untouched."""

    def __init__(self, app: ASGIApp, guard: Guard, metrics: bool = False) -> None:
        self.app, self.guard = app, guard
        self.prefixes = ("/v1/", "/tokenize/", "/detokenize/") + (("/metrics/",) if metrics else ())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not (scope["path"] + "/").startswith(self.prefixes):
            await self.app(scope, receive, send)
            return
        header = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        if header is None:  # Anthropic's clients send the key alone
            header = next((f"Bearer {v.decode('latin-1')}" for k, v in scope["headers"] if k == b"x-api-key"), None)
        admission = self.guard.admit(header)
        if not admission.ok:
            await _refusal(admission, anthropic=scope["path"].startswith("/v1/messages"))(scope, receive, send)
            return
        with admission.serving():
            await self.app(scope, receive, send)


def _refusal(a: Admission, anthropic: bool = False) -> JSONResponse:
    """In OpenAI's error shape, or in Anthropic's on its routes."""
    if a.status == 401:
        body = {"type": "error", "error": {"type": "authentication_error", "message": a.message}} if anthropic else \
            {"error": {"message": a.message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
        return JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
    body = {"type": "error", "error": {"type": "rate_limit_error", "message": a.message}} if anthropic else \
        {"error": {"message": a.message, "type": "rate_limit_error", "param": None, "code": 429}}
    return JSONResponse(body, 429, headers={"Retry-After": str(a.retry_after)})


# ---- gRPC: server interceptor --------------------------------------------------------------------
_CODES = {401: grpc.StatusCode.UNAUTHENTICATED, 429: grpc.StatusCode.RESOURCE_EXHAUSTED}


class GrpcGuard(grpc.aio.ServerInterceptor):
    """Guards the methods of the named services (health and reflection are left open)."""

    def __init__(self, guard: Guard, services: Iterable[str]) -> None:
        self.guard = guard
        self.prefixes = tuple(f"/{s}/" for s in services)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):  # noqa: ANN001, ANN201
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefixes):
            return handler
        authorization = next((v for k, v in details.invocation_metadata or () if k == "authorization"), None)
        return _guarded(handler, self.guard, authorization)


def _guarded(handler: grpc.RpcMethodHandler, guard: Guard, authorization: str | None) -> grpc.RpcMethodHandler:
    async def admit(context: grpc.aio.ServicerContext) -> Admission:
        a = guard.admit(authorization)
        if not a.ok:
            if a.retry_after:
                context.set_trailing_metadata((("retry-after", str(a.retry_after)),))
            await context.abort(_CODES[a.status], a.message)
        return a

    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def unary_stream(request, context):  # noqa: ANN001, ANN202
            a = await admit(context)
            with a.serving():
                async for response in inner_stream(request, context):
                    yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, handler.request_deserializer,
                                                    handler.response_serializer)
    if handler.unary_unary is not None:
        inner_unary = handler.unary_unary

        async def unary_unary(request, context):  # noqa: ANN001, ANN202
            a = await admit(context)
            with a.serving():
                return await inner_unary(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, handler.request_deserializer,
                                                   handler.response_serializer)
    raise TypeError(f"no guard for streaming requests ({handler})")
