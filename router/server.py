"""Run the router: engine + HTTP (uvicorn) + public gRPC (Generate, health, reflection) in one
event loop, and stop them in order: stop taking requests, finish or abort what runs, release KV.

On SIGTERM (Kubernetes' way to end a pod: a rolling update, a scale-down) the router drains:

    SIGTERM ─┬─ new requests refused: HTTP's listener closes, gRPC answers UNAVAILABLE, health NOT_SERVING
             ├─ requests in flight run on, up to --shutdown-timeout (they keep their replicas' leases)
             ├─ what still runs then is aborted: each client gets a clean 503 / UNAVAILABLE
             └─ streams written (FLUSH_S), KV released in both services, exit 0

SIGINT (Ctrl-C), or a second signal during a drain, skips the wait."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import uvicorn
from fastapi.middleware.cors import CORSMiddleware
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import aio
from common.reload import POLL_S, reload_on_sighup
from common.tls import reload_ssl_context, server_credentials, uvicorn_ssl
from router import grpc_api
from router.auth import GrpcGuard, HTTPGuard
from router.config import FLUSH_S, RouterConfig
from router.engine import RouterEngine
from router.gateway.http_api import create_app
from router.gateway.request_ids import RequestIds
from router.security import RouterSecurity

log = logging.getLogger(__name__)


class _Uvicorn(uvicorn.Server):
    """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, so the process would die by the
    signal before the router released its sequences; here a signal goes to on_signal (on the event
    loop: RouterServer.shut_down), and the process exits normally once everything is stopped."""

    def __init__(self, config: uvicorn.Config, on_signal: Callable[[int], None]) -> None:
        super().__init__(config)
        self.on_signal = on_signal

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is threading.main_thread():
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.on_signal, sig)
        yield


@dataclass(frozen=True)
class Endpoints:
    target: str
    draft: str | None
    tokenizer_dir: str
    model_name: str
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 50051
    model_aliases: tuple[str, ...] = ()  # more names the model answers to (vLLM's --served-model-name A B)


class RouterServer:
    def __init__(self, config: RouterConfig, endpoints: Endpoints, security: RouterSecurity | None = None) -> None:
        self.security = security or RouterSecurity()
        self.config = self.security.apply(config)
        self.endpoints = endpoints
        self.engine = RouterEngine(self.config, endpoints.target, endpoints.draft, endpoints.tokenizer_dir)
        self.grpc_server: grpc.aio.Server | None = None
        self.http: uvicorn.Server | None = None
        self.grpc_port = 0
        self._https_reload: asyncio.Task | None = None
        self._health: health.aio.HealthServicer | None = None
        self._winding_down: asyncio.Task | None = None

    async def start(self, wait_s: float = 300.0) -> None:
        await self.engine.start(wait_s)
        e, sec = self.endpoints, self.security
        guard = sec.guard()
        self.grpc_server = grpc.aio.server(interceptors=[GrpcGuard(guard, [grpc_api.SERVICE_NAME])] if guard else [])
        grpc_api.register(self.grpc_server, self.engine, e.model_name, e.model_aliases)
        self._health = health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self.grpc_server)
        reflection.enable_server_reflection((grpc_api.SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME),
                                            self.grpc_server)
        address = f"{e.host}:{e.grpc_port}"
        if sec.public is not None:
            self.grpc_port = self.grpc_server.add_secure_port(address, server_credentials(sec.public))
        else:
            self.grpc_port = self.grpc_server.add_insecure_port(address)
        await self.grpc_server.start()
        for name in ("", grpc_api.SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        app = create_app(self.engine, e.model_name, e.model_aliases)
        if guard is not None:
            app.add_middleware(HTTPGuard, guard=guard, metrics=sec.metrics_require_key)
        app.add_middleware(RequestIds)  # outside the guard: its refusals carry the id too
        if sec.cors is not None:  # added last, so outermost: preflights and refusals get its headers too
            app.add_middleware(CORSMiddleware, allow_origins=list(sec.cors.origins),
                               allow_methods=list(sec.cors.methods), allow_headers=list(sec.cors.headers),
                               allow_credentials=sec.cors.credentials, expose_headers=["x-request-id"])
        https = uvicorn_ssl(sec.public.files) if sec.public is not None else {}
        # keep-alive longer than clients' and load balancers' idle timeouts (60 s is common): a
        # server that closes an idle connection first races with the client's next request on it
        # log_config=None: uvicorn's lines go through the root logger, in the process's --log-format
        self.http = _Uvicorn(uvicorn.Config(app, host=e.host, port=e.http_port, log_level="warning", log_config=None,
                                            timeout_graceful_shutdown=FLUSH_S, timeout_keep_alive=75, **https),
                             self.shut_down)
        if sec.public is not None:
            self._https_reload = asyncio.create_task(self._reload_https())
        log.info("HTTP on %s://%s:%d  gRPC on %s:%d  model %r", "https" if https else "http", e.host, e.http_port,
                 e.host, self.grpc_port, e.model_name)
        log.info("security: %s", sec.describe())

    async def _reload_https(self) -> None:
        """uvicorn keeps one SSLContext for every connection: give it rotated files as they come."""
        certs = self.security.public
        assert certs is not None and self.http is not None
        generation = certs.generation
        while True:
            await asyncio.sleep(min(POLL_S, certs.poll_s) or 0.05)
            if certs.refresh() != generation and self.http.config.loaded:
                generation = certs.generation
                reload_ssl_context(self.http.config.ssl, certs)

    async def serve_http(self) -> None:
        """Until uvicorn stops (SIGINT/SIGTERM, or should_exit set)."""
        assert self.http is not None
        await self.http.serve()

    @property
    def http_port(self) -> int:
        assert self.http is not None and self.http.servers, "HTTP not started"
        return self.http.servers[0].sockets[0].getsockname()[1]

    def shut_down(self, sig: int) -> None:
        """A signal: the first SIGTERM drains for config.shutdown_timeout_s, SIGINT does not wait; a
        second signal aborts what a drain is waiting for."""
        if self._winding_down is None:
            wait_s = self.config.shutdown_timeout_s if sig == signal.SIGTERM else 0.0
            self._winding_down = asyncio.create_task(self._wind_down(wait_s))
        elif n := self.engine.abort_all():
            log.warning("%s: aborted the %d requests still running", signal.Signals(sig).name, n)

    async def _wind_down(self, wait_s: float) -> None:
        assert self.http is not None and self.grpc_server is not None and self._health is not None
        self.engine.drain()
        for name in ("", grpc_api.SERVICE_NAME):
            await self._health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        grpc_stopped = asyncio.create_task(self.grpc_server.stop(wait_s + FLUSH_S))  # new RPCs: UNAVAILABLE
        self.http.config.timeout_graceful_shutdown = wait_s + FLUSH_S
        self.http.should_exit = True  # uvicorn closes its listener and waits for the responses under way
        if wait_s:
            log.info("draining: requests in flight have %.0f s to finish", wait_s)
        if not await self.engine.drained(wait_s) and (n := self.engine.abort_all()):
            log.warning("aborted %d requests still running after %.0f s", n, wait_s)
        await grpc_stopped

    async def stop(self) -> None:
        if self._https_reload is not None:
            self._https_reload.cancel()
        if self._winding_down is not None:
            await self._winding_down
        elif self.grpc_server is not None:
            await self.grpc_server.stop(2.0)
        await self.engine.stop()
        log.info("router stopped")


async def run(config: RouterConfig, endpoints: Endpoints, wait_s: float,
              security: RouterSecurity | None = None) -> None:
    server = RouterServer(config, endpoints, security)
    reload_on_sighup(asyncio.get_running_loop())  # certificate and key files re-read now
    await server.start(wait_s)
    try:
        await server.serve_http()
    finally:
        await server.stop()


def main_sync(config: RouterConfig, endpoints: Endpoints, wait_s: float,
              security: RouterSecurity | None = None) -> None:
    aio.run(run(config, endpoints, wait_s, security))
