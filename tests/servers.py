"""Run a real gRPC server (engine.service.serve) on a loopback port in a background thread."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from engine.service import serve
from engine.transport import Transport


@dataclass
class RunningServer:
    port: int
    thread: threading.Thread
    loop: asyncio.AbstractEventLoop
    stop_event: asyncio.Event

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self, timeout: float = 15.0) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "server did not stop"


def start_server(register: Callable[[grpc.aio.Server], None], service_name: str, port: int = 0,
                 grace_seconds: float = 5.0, transport: Transport | None = None,
                 on_shutdown: Callable[[], None] = lambda: None) -> RunningServer:
    started = threading.Event()
    box: dict = {}

    def main() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        stop = asyncio.Event()
        box.update(loop=loop, stop=stop)

        def on_started(bound: int) -> None:
            box["port"] = bound
            started.set()

        try:
            loop.run_until_complete(serve(register, service_name, "127.0.0.1", port, grace_seconds, stop, on_started,
                                          transport or Transport(), on_shutdown))
        finally:
            started.set()
            loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert started.wait(30), "server did not start"
    assert "port" in box, "server failed to start"
    return RunningServer(box["port"], thread, box["loop"], box["stop"])
