"""The multi-turn workload (bench/multiturn.py compares it with and without prefix caching): how
large the conversations are for a model's context, what they say (stdlib text cut to token counts,
deterministic by seed), and how a closed loop of clients sends them, each turn carrying the whole
conversation so far through /v1/chat/completions with SSE."""

from __future__ import annotations

import asyncio
import json
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from tokenizers import Tokenizer

SOURCES = ("textwrap.py", "string.py", "fractions.py", "heapq.py", "bisect.py", "shlex.py")

@dataclass(frozen=True)
class Shape:
    conversations: int
    turns: int
    system_tokens: int
    user_tokens: int
    reply_tokens: int
    concurrency: int
    budget: int


CONTEXT_CAP = 2048  # conversations use at most this much of a longer context: a full 8k one costs CPU hours


def shape_for(max_len: int, quick: bool) -> Shape:
    """The last turn's prompt plus its answer fills ~80% of the context (of CONTEXT_CAP where the model's
    is longer): a system prompt of at least 64 tokens and 5 turns (4 with quick; fewer where the context
    is short, at least 2)."""
    max_len = min(max_len, CONTEXT_CAP)
    reply = user = max(8, max_len // 20)
    overhead = 16  # the chat template's role markers per message, and answers that re-tokenize longer
    per_turn = user + reply + 2 * overhead
    turns = min(4 if quick else 5, (int(0.8 * max_len) - 64) // per_turn)
    if turns < 2:
        raise ValueError(f"a {max_len}-token context is too short for the multi-turn workload (it needs room for "
                         f"a 64-token system prompt and 2 turns of {user} + {reply} tokens)")
    system = int(0.8 * max_len) - turns * per_turn
    return Shape(4 if quick else 8, turns, system, user, reply, 4, max(16, max_len // 8))


def script(tok: Tokenizer, shape: Shape, seed: int) -> tuple[str, list[list[str]]]:
    """(system prompt, each conversation's user turns): stdlib text cut to token counts, deterministic."""
    root = Path(sysconfig.get_paths()["stdlib"])
    lines = [ln for name in SOURCES for ln in (root / name).read_text().splitlines() if len(ln.strip()) > 20]
    rng = random.Random(seed)

    def cut(text: str, n: int) -> str:
        return tok.decode(tok.encode(text).ids[:n])

    system = cut("You answer questions about this code.\n" + "\n".join(lines[:400]), shape.system_tokens)
    turns = [[cut(f"What does this do? {' '.join(rng.sample(lines, 3))}", shape.user_tokens)
              for _ in range(shape.turns)] for _ in range(shape.conversations)]
    return system, turns


@dataclass
class Turn:
    conversation: int
    turn: int
    ttft: float
    e2e: float
    answer: str


async def converse(client: httpx.AsyncClient, model: str, system: str, questions: list[str], conv: int,
                   reply_tokens: int) -> list[Turn]:
    messages = [{"role": "system", "content": system}]
    out = []
    for n, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        body = {"model": model, "messages": messages, "max_tokens": reply_tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        t0 = time.perf_counter()
        ttft, parts = float("nan"), []
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(data["error"])
                text = "".join(c.get("delta", {}).get("content") or "" for c in data.get("choices", []))
                if text and not parts:
                    ttft = time.perf_counter() - t0
                parts.append(text)
        answer = "".join(parts)
        out.append(Turn(conv, n + 1, ttft, time.perf_counter() - t0, answer))
        messages.append({"role": "assistant", "content": answer})
    return out


async def drive(url: str, model: str, system: str, conversations: list[list[str]], shape: Shape) -> list[Turn]:
    sem = asyncio.Semaphore(shape.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0)) as client:
        async def one(conv: int) -> list[Turn]:
            async with sem:
                return await converse(client, model, system, conversations[conv], conv, shape.reply_tokens)

        per_conv = await asyncio.gather(*(one(c) for c in range(len(conversations))))
    return [t for conv in per_conv for t in conv]
