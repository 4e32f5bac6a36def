"""Streaming client: one request = one SSE stream of /v1/completions (greedy, ignore_eos, token ids
returned), timed on arrival of each chunk. Closed-loop and open-loop (Poisson) drivers on asyncio."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from bench.plans import Load
from bench.workloads import Prompt


@dataclass
class RequestResult:
    pid: int
    sent: float  # seconds since the load started
    ttft: float = float("nan")  # until the first chunk carrying a token
    e2e: float = float("nan")
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (seconds since sent, tokens in it)
    tokens: list[int] = field(default_factory=list)
    error: str | None = None

    def itl(self) -> list[float]:
        """Inter-token latencies: a chunk carrying n tokens, dt after the previous one, counts n
        intervals of dt / n. The first chunk's tokens belong to TTFT, not to ITL."""
        out: list[float] = []
        for (t0, _), (t1, n) in zip(self.chunks, self.chunks[1:], strict=False):
            out.extend([(t1 - t0) / n] * n)
        return out

    def row(self) -> list:
        """[pid, sent, ttft, e2e, tokens, chunks] (seconds), or with the error appended."""
        row = [self.pid, round(self.sent, 4), round(self.ttft, 4), round(self.e2e, 4), len(self.tokens),
               len(self.chunks)]
        return row if self.error is None else [*row, self.error]


async def stream_one(client: httpx.AsyncClient, model: str, prompt: Prompt, t_load: float) -> RequestResult:
    body = {"model": model, "prompt": prompt.ids, "max_tokens": prompt.max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "return_token_ids": True}
    t0 = time.perf_counter()
    res = RequestResult(prompt.pid, t0 - t_load)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter() - t0
                data = json.loads(line[6:])
                if "error" in data:
                    res.error = str(data["error"].get("message"))
                    break
                ids = [t for c in data.get("choices", []) for t in c.get("token_ids") or []]
                if ids:
                    if not res.chunks:
                        res.ttft = now
                    res.chunks.append((now, len(ids)))
                    res.tokens.extend(ids)
    except httpx.HTTPError as err:
        res.error = f"{type(err).__name__}: {err}"
    res.e2e = time.perf_counter() - t0
    if res.error is None and len(res.tokens) != prompt.max_tokens:
        res.error = f"got {len(res.tokens)} tokens, asked for {prompt.max_tokens} (ignore_eos)"
    return res


async def run_load(url: str, model: str, load: Load, requests: list[Prompt], rate: float, arrivals: list[float],
                   on_done: Callable[[RequestResult], None]) -> tuple[list[RequestResult], float]:
    """Drive one load; returns the results (in request order) and the wall time from the first send
    to the last answer. Open loop: request i is sent at arrivals[i] / rate whatever is in flight."""
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0), limits=limits) as client:
        t_load = time.perf_counter()
        results: list[RequestResult | None] = [None] * len(requests)

        async def one(i: int) -> None:
            results[i] = r = await stream_one(client, model, requests[i], t_load)
            on_done(r)

        if load.kind == "closed":
            queue = iter(range(len(requests)))

            async def worker() -> None:
                for i in queue:
                    await one(i)

            await asyncio.gather(*(worker() for _ in range(load.concurrency)))
        else:
            tasks = []
            for i, t in enumerate(arrivals):
                delay = t / rate - (time.perf_counter() - t_load)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t_load
    return [r for r in results if r is not None], wall


async def warm_up(url: str, model: str, prompts: list[Prompt]) -> None:
    """Unmeasured requests (the first forwards of a fresh process are slow): concurrently, so the
    batched shapes are warm too."""
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0)) as client:
        results = await asyncio.gather(*(stream_one(client, model, p, time.perf_counter()) for p in prompts))
    bad = [r.error for r in results if r.error]
    if bad:
        raise RuntimeError(f"warm-up failed: {bad[0]}")
