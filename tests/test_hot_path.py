"""Nothing a client sends may stall the other streams: huge bodies are refused while being read,
huge prompts are refused from their byte length before any tokenization, and both happen without
holding the event loop that paces every stream. Measured as a ratio within one run."""

from __future__ import annotations

import concurrent.futures as cf
import json
import threading
import time

import httpx
import numpy as np
import pytest

from router.config import RouterConfig
from tests.stack import running_stack

STREAMS = 8
TOKENS = 48


@pytest.fixture(scope="module")
def stack(model_pair):
    config = RouterConfig(max_num_batched_tokens=64, max_num_seqs=16)
    with running_stack(model_pair, config) as s:
        yield s


def stream_gaps(url: str, prompt: list[int], started: threading.Barrier) -> list[float]:
    """Seconds between consecutive SSE chunks of one streamed completion."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True}
    stamps = []
    started.wait()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return list(np.diff(stamps[1:]))  # from the second token on: decode, not prefill


def huge_request(url: str, size: int = 4 * 2**20) -> httpx.Response:
    big = json.dumps({"model": "tiny", "prompt": "lorem ipsum " * (size // 12), "max_tokens": 4}).encode()
    return httpx.post(f"{url}/v1/completions", content=big, timeout=60, headers={"content-type": "application/json"})


def run(url: str, with_huge: bool) -> tuple[list[float], list[httpx.Response]]:
    started = threading.Barrier(STREAMS + 1)
    with cf.ThreadPoolExecutor(STREAMS + 1) as pool:
        streams = [pool.submit(stream_gaps, url, [5 + i, 17, 29, 41 + i], started) for i in range(STREAMS)]
        started.wait()
        time.sleep(0.1)  # the streams are decoding
        refused = [huge_request(url)] if with_huge else []
        gaps = [g for f in streams for g in f.result(timeout=120)]
    return gaps, refused


def test_a_4_mib_prompt_does_not_stall_other_streams(stack):
    """8 streams decode while a 4 MiB prompt arrives: it gets its 413 as soon as the body limit is
    crossed (the rest is drained, not kept), and the streams' ITL p99 stays within 2x."""
    url = stack["router"].url
    run(url, with_huge=False)  # warm-up
    p99 = {False: [], True: []}
    for _ in range(2):  # interleaved, best of two: the shared machine's own noise hits both alike
        for with_huge in (False, True):
            gaps, refused = run(url, with_huge)
            p99[with_huge].append(np.percentile(gaps, 99))
            if with_huge:
                assert [r.status_code for r in refused] == [413]
    quiet, busy = min(p99[False]), min(p99[True])
    assert busy <= 2 * quiet, f"ITL p99 {1000 * busy:.1f} ms with huge requests vs {1000 * quiet:.1f} ms without"


def test_a_prompt_far_past_the_context_is_refused_before_tokenization(stack, monkeypatch):
    """1.5 MiB of text (inside the body limit) cannot fit 512 tokens whatever the tokenizer does with
    it: the byte length alone refuses it, with a 400 naming max_model_len, and nothing is encoded."""
    codec = stack["router"].server.engine.codec
    encoded = []
    monkeypatch.setattr(codec, "_encode", lambda text: encoded.append(len(text)) or [])
    r = huge_request(stack["router"].url, 3 * 2**19)
    assert r.status_code == 400 and "max_model_len" in r.json()["error"]["message"]
    assert encoded == []


def test_tokenizing_a_long_prompt_leaves_the_event_loop_free(stack):
    """Prompts are encoded on the codec's threads, which release the GIL: while one takes a good
    while, a 1 ms ticker on the event loop keeps ticking (with encode() on the loop it ticked once)."""
    import asyncio
    import random

    rng = random.Random(3)
    text = "".join(rng.choice("abcdefghij klmnop\n") for _ in range(600_000))  # unlike anything cached
    codec = stack["router"].server.engine.codec

    async def measure() -> tuple[int, float]:
        ticks = 0
        task = asyncio.ensure_future(codec.encode(text, 10**7))
        t0 = time.perf_counter()
        while not task.done():
            await asyncio.sleep(0.001)
            ticks += 1
        await task
        return ticks, time.perf_counter() - t0

    ticks, took = stack["router"].call(measure())
    assert took > 0.05, "the text must take a while to encode for this to mean anything"
    assert ticks >= 0.2 * took / 0.001, f"{ticks} ticks in {took:.2f}s: the loop was held"
