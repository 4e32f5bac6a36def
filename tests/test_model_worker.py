"""engine.service.ModelWorker: model work runs one call at a time. Under one torch thread a small CPU
step runs on the event loop itself when the model thread has nothing queued (two thread hand-offs fewer
per step), anything larger, or anything while other work is queued, on the model thread. Under more
than one, everything runs on the model thread, the one the model was loaded on (model_thread): a second
thread running torch's OpenMP parallel regions slows them all."""

from __future__ import annotations

import argparse
import asyncio
import threading
from types import SimpleNamespace

import pytest
import torch

from engine import service
from engine.service import INLINE_TOKENS, ModelWorker, load_runner, model_thread
from tests.conftest import SMALL, write_checkpoint


def worker(device: str = "cpu") -> ModelWorker:
    return ModelWorker(SimpleNamespace(model_dir=None, device=torch.device(device)), "m", 4)  # type: ignore[arg-type]


@pytest.fixture
def torch_threads():
    """Sets torch's CPU threads for the test, then puts back what was there."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def one_thread(request, torch_threads):
    if "two_threads" not in request.fixturenames:
        torch_threads(1)


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


@pytest.fixture
def two_threads(torch_threads):
    torch_threads(2)


def test_under_two_torch_threads_even_a_one_token_step_runs_on_the_model_thread(two_threads):
    w = worker()
    assert w.inline_tokens == 0

    async def run() -> str:
        return await w.run(lambda: threading.current_thread().name, tokens=1)

    assert asyncio.run(run()).startswith("model")


def test_the_model_loads_on_the_thread_that_then_runs_its_steps(two_threads, tmp_path, monkeypatch):
    from transformers import LlamaConfig

    model_dir = write_checkpoint(LlamaConfig(**SMALL), tmp_path / "m")
    loaded_on: list[str] = []
    load = service.ModelRunner.load

    def recording_load(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        loaded_on.append(threading.current_thread().name)
        return load(*args, **kwargs)

    monkeypatch.setattr(service.ModelRunner, "load", recording_load)
    parser = argparse.ArgumentParser()
    service.add_model_args(parser, 1)
    thread = model_thread(1)
    runner = load_runner(parser.parse_args(["--model", str(model_dir), "--threads", "1"]), thread=thread)
    w = ModelWorker(runner, "m", 4, thread)

    async def run() -> str:
        return await w.run(lambda: threading.current_thread().name)

    ran_on = asyncio.run(run())
    assert loaded_on == [ran_on] and ran_on.startswith("model")
    assert thread.submit(torch.get_num_threads).result() == 1, "the thread runs torch with the threads asked for"
