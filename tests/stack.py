"""The whole stack in one test process: target and draft gRPC servers and the router (HTTP +
gRPC), each on its own loopback port and event-loop thread. Real sockets, real protocols."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from common.tracing import Tracing
from draft_service import server as draft_server
from engine import EngineConfig, ModelRunner
from engine.transport import Transport
from router.config import RouterConfig
from router.security import RouterSecurity
from router.server import Endpoints, RouterServer
from target_service import server as target_server
from tests.servers import RunningServer, start_server

# The tiny test target costs about what its draft does, while a real one costs 8-10x more; a
# pipelined draft (1 + k batched rounds per call) can only keep up with a target that slow, so the
# test stacks give every Step this much extra time (spent awaiting, not computing).
REALISTIC_STEP_S = 0.015



def start_target(model_dir: Path, num_blocks: int = 256, port: int = 0, block_size: int = 16,
                 step_delay_s: float = 0.0, transport: Transport | None = None, fail_on_token: int = -1,
                 max_batch_tokens: int = 2048, tracing: Tracing | None = None, grace_seconds: float = 5.0,
                 adapters: dict[str, Path] | None = None, runtime_lora: bool = False,
                 max_loras: int = 16, lora_root: Path | None = None) -> tuple[RunningServer, ModelRunner]:
    runner = ModelRunner.load(model_dir, EngineConfig(num_blocks=num_blocks, block_size=block_size, device="cpu",
                                                      max_batch_tokens=max_batch_tokens))
    runner.load_adapters(adapters or {})
    servicer = target_server.create_servicer(runner, tracing=tracing, fail_on_token=fail_on_token,
                                             runtime_lora=runtime_lora, max_loras=max_loras, lora_root=lora_root)
    if step_delay_s:  # both ways a router steps: a unary Step and each step of a StepStream
        def slowed(step):  # noqa: ANN001, ANN202
            async def slow_step(request, context):  # noqa: ANN001, ANN202
                await asyncio.sleep(step_delay_s)
                return await step(request, context)
            return slow_step

        servicer.Step = slowed(servicer.Step)
        servicer._streamed_step = slowed(servicer._streamed_step)
    return start_server(lambda s: target_server.register(s, servicer), target_server.SERVICE_NAME, port,
                        grace_seconds=grace_seconds, transport=transport, on_shutdown=servicer.close_streams), runner


def start_draft(model_dir: Path, num_blocks: int = 256, port: int = 0, transport: Transport | None = None,
                alter: Callable[[draft_server.DraftServicer], None] | None = None,
                tracing: Tracing | None = None, grace_seconds: float = 5.0) -> tuple[RunningServer, ModelRunner]:
    """alter: changes the servicer before it serves (a test's misbehaving draft)."""
    runner = ModelRunner.load(model_dir, EngineConfig(num_blocks=num_blocks, block_size=16, device="cpu"))
    servicer = draft_server.create_servicer(runner, tracing=tracing)
    if alter is not None:
        alter(servicer)
    return start_server(lambda s: draft_server.register(s, servicer), draft_server.SERVICE_NAME, port,
                        grace_seconds=grace_seconds, transport=transport, on_shutdown=servicer.close_streams), runner


def alter_proposals(servicer: draft_server.DraftServicer, wrap: Callable) -> None:  # type: ignore[type-arg]
    """Both ways a router proposes, a unary Propose and each call of a ProposeStream, go through wrap(handler)."""
    servicer.Propose = wrap(servicer.Propose)  # type: ignore[method-assign]
    servicer._streamed_propose = wrap(servicer._streamed_propose)  # type: ignore[method-assign]


@dataclass
class RouterThread:
    server: RouterServer
    loop: asyncio.AbstractEventLoop
    thread: threading.Thread
    http_port: int
    errors: list = field(default_factory=list)

    @property
    def url(self) -> str:
        scheme = "https" if self.server.security.public is not None else "http"
        return f"{scheme}://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.server.grpc_port}"

    def call(self, coro, timeout: float = 60.0):  # noqa: ANN001, ANN201
        """Run a coroutine on the router's loop (e.g. engine calls) and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        assert self.server.http is not None
        self.loop.call_soon_threadsafe(setattr, self.server.http, "should_exit", True)
        self.thread.join(30)
        assert not self.thread.is_alive(), "router did not stop"


def start_router(config: RouterConfig, target: str, draft: str | None, tokenizer_dir: Path,
                 model_name: str = "tiny", wait_s: float = 30.0,
                 security: RouterSecurity | None = None, aliases: tuple[str, ...] = ()) -> RouterThread:
    server = RouterServer(config, Endpoints(target=target, draft=draft, tokenizer_dir=str(tokenizer_dir),
                                            model_name=model_name, http_port=0, grpc_port=0, model_aliases=aliases),
                          security)
    ready = threading.Event()
    box: dict = {}

    def main() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        box["loop"] = loop

        async def run() -> None:
            try:
                await server.start(wait_s)
                serving = asyncio.create_task(server.serve_http())
                while not server.http.started and not serving.done():
                    await asyncio.sleep(0.01)
                ready.set()
                await serving
            except BaseException as err:  # surfaced by the waiting test
                box["error"] = err
                ready.set()
                raise
            finally:
                await server.stop()

        try:
            loop.run_until_complete(run())
        except BaseException:  # noqa: S110 - reported through box
            pass
        finally:
            loop.close()

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    assert ready.wait(wait_s + 30), "router did not start"
    if "error" in box:
        raise box["error"]
    return RouterThread(server, box["loop"], thread, server.http_port)


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def complete(url: str, prompt: list[int] | str, max_tokens: int, **extra) -> dict:  # noqa: ANN003
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}
    body.update(extra)
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@contextlib.contextmanager
def running_stack(model_pair: tuple[Path, Path], config: RouterConfig,
                  step_delay_s: float = REALISTIC_STEP_S) -> Iterator[dict]:
    """Target + draft + router on loopback for one test (or module); everything stopped after.
    Yields router, target/draft runners, the RunningServers as `parts` (tests may replace them
    after a restart), and the model dirs."""
    target_dir, draft_dir = model_pair
    target, trunner = start_target(target_dir, step_delay_s=step_delay_s)
    draft, drunner = start_draft(draft_dir)
    parts = {"target": target, "draft": draft}
    router = start_router(config, target.address, draft.address, target_dir)
    try:
        yield {"router": router, "target": trunner, "draft": drunner, "parts": parts, "dirs": model_pair}
    finally:
        router.stop()
        for part in parts.values():
            if part.thread.is_alive():
                part.stop()


def counts(usage: dict) -> dict:
    """A usage's token counts, its prompt_tokens_details checked apart (the prefix cache's share of the
    prompt, which depends on what ran before)."""
    rest = {k: v for k, v in usage.items() if k != "prompt_tokens_details"}
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] <= usage["prompt_tokens"], usage
    return rest
