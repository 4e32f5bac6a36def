"""The anchor a user would pick on one machine: transformers `generate(assistant_model=draft)` on the
same pair, greedy, one request at a time, in this process (the Tandem stack is stopped by then).

Each distinct prompt is served once; a streamer timestamps every batch of tokens generate emits,
which gives TTFT and ITL the same way the HTTP client does. Loads with more than one request in
flight are then served one after another (FIFO): their latencies are the measured service times
plus the queueing wait that order implies, computed from the measured times (simulate())."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from bench.client import RequestResult
from bench.workload import Load, Prompt


class _Clock(BaseStreamer):
    def __init__(self, t0: float, result: RequestResult) -> None:
        self.t0, self.result, self.prompt_seen = t0, result, False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate() streams the prompt first
            self.prompt_seen = True
            return
        now = time.perf_counter() - self.t0
        ids = value.reshape(-1).tolist()
        if not self.result.chunks:
            self.result.ttft = now
        self.result.chunks.append((now, len(ids)))
        self.result.tokens.extend(ids)

    def end(self) -> None:
        pass


@torch.inference_mode()
def serve_all(models: Path, prompts: list[Prompt],
              on_done: Callable[[RequestResult], None]) -> dict[int, RequestResult]:
    """Each prompt served alone: greedy, exactly max_tokens new tokens (EOS does not stop it,
    like the router's ignore_eos), transformers' default assistant schedule."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    target = AutoModelForCausalLM.from_pretrained(models / "target", dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(models / "draft", dtype=torch.float32).eval()
    kwargs = {"assistant_model": draft, "do_sample": False, "eos_token_id": None, "pad_token_id": 2}

    def run(p: Prompt) -> RequestResult:
        res = RequestResult(p.pid, 0.0)
        ids = torch.tensor([p.ids])
        t0 = time.perf_counter()
        target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=p.max_tokens,
                        streamer=_Clock(t0, res), **kwargs)
        res.e2e = time.perf_counter() - t0
        if len(res.tokens) != p.max_tokens:
            res.error = f"anchor produced {len(res.tokens)} tokens, asked for {p.max_tokens}"
        return res

    for p in (min(prompts, key=lambda p: len(p.ids)), max(prompts, key=lambda p: len(p.ids))):
        run(p)  # warm-up, unmeasured
    out = {}
    for p in prompts:
        out[p.pid] = run(p)
        on_done(out[p.pid])
    return out


def simulate(load: Load, requests: list[Prompt], served: dict[int, RequestResult], rate: float,
             arrivals: list[float]) -> tuple[list[RequestResult], float]:
    """The load's requests served one after another in arrival order, each taking its measured
    time. Closed loop: a client sends its next request when its previous answer arrives."""
    free_at = 0.0
    client_free = [0.0] * load.concurrency
    out = []
    for i, p in enumerate(requests):
        m = served[p.pid]
        if load.kind == "closed":
            c = min(range(load.concurrency), key=client_free.__getitem__)
            sent = client_free[c]
        else:
            sent = arrivals[i] / rate
        start = max(sent, free_at)
        free_at = start + m.e2e
        wait = start - sent
        r = RequestResult(p.pid, sent, ttft=wait + m.ttft, e2e=wait + m.e2e,
                          chunks=[(wait + t, n) for t, n in m.chunks], tokens=m.tokens, error=m.error)
        if load.kind == "closed":
            client_free[c] = sent + r.e2e
        out.append(r)
    return out, free_at - min((r.sent for r in out), default=0.0)
