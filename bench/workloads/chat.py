"""Chat: one user turn from chat_questions.txt (written for the bench, so no draft trained on them),
rendered by transformers' apply_chat_template with the pair's own template (its default system
prompt included) and tokenized with the pair's tokenizer.json, as a client of a chat model sends it."""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer

from bench.pairs import Pair
from bench.workloads import Prompt, Slot, Workload

QUESTIONS = Path(__file__).with_name("chat_questions.txt")


def questions() -> list[str]:
    return [q for q in (line.strip() for line in QUESTIONS.read_text().splitlines()) if q and not q.startswith("#")]


def make(pair: Pair, slots: list[Slot], budget: int, rng: random.Random) -> list[Prompt]:
    from transformers import AutoTokenizer

    template = AutoTokenizer.from_pretrained(pair.target)
    tok = Tokenizer.from_file(str(pair.target / "tokenizer.json"))
    qs = questions()
    order = rng.sample(range(len(qs)), len(qs))
    out = []
    for i, slot in enumerate(slots):
        q = order[i % len(order)]
        text = template.apply_chat_template([{"role": "user", "content": qs[q]}], tokenize=False,
                                            add_generation_prompt=True)
        ids = tok.encode(text, add_special_tokens=False).ids  # the template wrote the special tokens
        out.append(Prompt(slot.pid, ids[:slot.room(pair)], slot.max_tokens, "chat", f"question {q + 1}", "chat"))
    return out


WORKLOAD = Workload("chat", make, applies=lambda pair: pair.has_chat_template)
