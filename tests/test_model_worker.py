"""engine.service.ModelWorker: model work runs one call at a time; a small CPU step runs on the event
loop itself when the model thread has nothing queued (two thread hand-offs fewer per step), anything
larger, or anything while other work is queued, on the model thread."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import torch

from engine.service import INLINE_TOKENS, ModelWorker


def worker(device: str = "cpu") -> ModelWorker:
    return ModelWorker(SimpleNamespace(model_dir=None, device=torch.device(device)), "m", 4)  # type: ignore[arg-type]


def test_a_small_step_runs_on_the_event_loop_a_large_one_on_the_model_thread():
    w = worker()

    async def run() -> tuple[str, str, str]:
        small = await w.run(lambda: threading.current_thread().name, tokens=INLINE_TOKENS)
        large = await w.run(lambda: threading.current_thread().name, tokens=INLINE_TOKENS + 1)
        unsized = await w.run(lambda: threading.current_thread().name)
        return small, large, unsized

    small, large, unsized = asyncio.run(run())
    assert small == threading.current_thread().name
    assert large.startswith("model") and unsized.startswith("model")


def test_a_small_step_queues_behind_work_on_the_model_thread_so_calls_never_overlap():
    w = worker()
    running = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def long_call() -> str:
        running.set()
        release.wait(5)
        order.append("long")
        return threading.current_thread().name

    def small_step() -> str:
        order.append("small")
        return threading.current_thread().name

    async def run() -> tuple[str, str]:
        first = asyncio.create_task(w.run(long_call))
        await asyncio.to_thread(running.wait, 5)
        second = asyncio.create_task(w.run(small_step, tokens=1))
        await asyncio.sleep(0.05)
        assert order == [], "the small step must not run beside the long call"
        release.set()
        return await first, await second

    first, second = asyncio.run(run())
    assert order == ["long", "small"]
    assert first.startswith("model") and second.startswith("model")


def test_off_the_cpu_every_step_goes_to_the_model_thread():
    assert worker("meta").inline_tokens == 0
