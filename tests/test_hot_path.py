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


def huge_requests(url: str) -> list[httpx.Response]:
    """A 4 MiB prompt (past the 2 MiB body limit) and a 1.5 MiB one (within it, far past the context)."""
    out = []
    for size in (4 * 2**20, 3 * 2**19):
        big = json.dumps({"model": "tiny", "prompt": "lorem ipsum " * (size // 12), "max_tokens": 4}).encode()
        out.append(httpx.post(f"{url}/v1/completions", content=big, timeout=60,
                              headers={"content-type": "application/json"}))
    return out


def run(url: str, with_huge: bool) -> tuple[list[float], list[httpx.Response]]:
    started = threading.Barrier(STREAMS + 1)
    with cf.ThreadPoolExecutor(STREAMS + 1) as pool:
        streams = [pool.submit(stream_gaps, url, [5 + i, 17, 29, 41 + i], started) for i in range(STREAMS)]
        started.wait()
        time.sleep(0.1)  # the streams are decoding
        refused = huge_requests(url) if with_huge else []
        gaps = [g for f in streams for g in f.result(timeout=120)]
    return gaps, refused


def test_huge_bodies_and_prompts_do_not_stall_other_streams(stack):
    url = stack["router"].url
    run(url, with_huge=False)  # warm-up
    p99 = {False: [], True: []}
    for _ in range(2):  # interleaved, best of two: the shared machine's own noise hits both alike
        for with_huge in (False, True):
            gaps, refused = run(url, with_huge)
            p99[with_huge].append(np.percentile(gaps, 99))
            if with_huge:
                assert [r.status_code for r in refused] == [413, 400]
                assert "max_model_len" in refused[1].json()["error"]["message"]
    quiet, busy = min(p99[False]), min(p99[True])
    assert busy <= 2 * quiet, f"ITL p99 {1000 * busy:.1f} ms with huge requests vs {1000 * quiet:.1f} ms without"
