"""Prompts made on this machine, for distilling a chat model's draft and measuring it.

Chat: no data set is reachable, so the instruct model writes its own users' questions (Magpie,
Xu et al. 2024): given only the chat template's prefix up to ``<|im_start|>user\\n`` it samples
what a user would plausibly ask, ending with ``<|im_end|>``. Code: windows of the Python
standard library's sources (demo_models/corpus.py, split into train and held-out BY FILE).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from demo_models.corpus import Corpus

from .generate import Sampling, generate


def chat_prefix(tokenizer, user_text: str | None = None) -> list[int]:
    """The chat template up to the user's text (Magpie), or a full prompt asking for the
    assistant's answer to ``user_text``."""
    if user_text is None:
        marker = "\x00MAGPIE\x00"
        text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
        return tokenizer(text[: text.index(marker)], add_special_tokens=False).input_ids
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_text}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def magpie_questions(
    runner, tokenizer, count: int, seed: int, max_tokens: int, sampling: Sampling, batch: int, progress: bool = True
) -> list[str]:
    """``count`` distinct user questions the model wrote itself. Samples that run past
    ``max_tokens`` without closing the turn, or come out empty or repeated, are dropped and
    drawn again (a few rounds at most, so the result may be shorter on a pathological model)."""
    prefix = chat_prefix(tokenizer)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    found: dict[str, None] = {}
    for round_ in range(4):
        need = count - len(found)
        if need <= 0:
            break
        draws = generate(runner, [prefix] * int(need * 1.3 + 4), max_tokens, [end], sampling, batch=batch,
                         seed=seed + round_, desc=f"chat questions (round {round_ + 1})", progress=progress)
        for g in draws:
            if g.output[-1] != end:
                continue
            text = tokenizer.decode(g.output[:-1]).strip()
            if len(text) >= 8 and "<|" not in text:
                found.setdefault(text)
    return list(found)[:count]


def code_windows(
    tokenizer, corpus: Corpus, heldout: bool, count: int, min_len: int, max_len: int, seed: int
) -> list[list[int]]:
    """``count`` windows of ``min_len``..``max_len`` tokens from train or held-out stdlib files,
    each starting at the beginning of a line."""
    files = corpus.heldout if heldout else corpus.train
    rng = random.Random(seed)
    out: list[list[int]] = []
    while len(out) < count:
        text = rng.choice(files).text
        lines = text.splitlines(keepends=True)
        if len(lines) < 8:
            continue
        start = rng.randrange(len(lines) - 4)
        ids = tokenizer("".join(lines[start : start + 80]), add_special_tokens=False).input_ids
        length = rng.randint(min_len, max_len)
        if len(ids) >= length:
            out.append(ids[:length])
    return out


def split_distinct(items: Sequence[str], heldout_count: int) -> tuple[list[str], list[str]]:
    """Held-out questions first (never trained on), the rest for training: the lists are disjoint
    because ``magpie_questions`` returns distinct strings."""
    return list(items[heldout_count:]), list(items[:heldout_count])
