"""Code: prompts cut at a line start from held-out stdlib files (demo_models/corpus.py's split by
file: neither pair trained on them), at the length the slot's class asks for."""

from __future__ import annotations

import random
from functools import cache

from tokenizers import Tokenizer

from bench.pairs import Pair
from bench.workloads import Prompt, Slot, Workload
from demo_models.corpus import Corpus, load_corpus


@cache
def _corpus(max_file_bytes: int, max_total_bytes: int, heldout_percent: int) -> Corpus:
    return load_corpus(max_file_bytes, max_total_bytes, heldout_percent)


def make(pair: Pair, slots: list[Slot], budget: int, rng: random.Random) -> list[Prompt]:
    corpus = _corpus(**pair.corpus_settings)
    tok = Tokenizer.from_file(str(pair.target / "tokenizer.json"))
    files = sorted(corpus.heldout, key=lambda f: f.relpath)
    out = []
    for slot in slots:
        length = rng.randint(*slot.length_range(pair, budget))
        for _ in range(100):  # a file (and a line in it) with at least `length` tokens after it
            f = rng.choice(files)
            lines = f.text.splitlines(keepends=True)
            start = rng.randrange(len(lines))
            ids = tok.encode("".join(lines[start:])).ids  # the tokenizer's own specials (the demo's <s>)
            if len(ids) >= length:
                break
        else:
            raise RuntimeError(f"no held-out file has {length} tokens after a line; lower the budget")
        out.append(Prompt(slot.pid, ids[:length], slot.max_tokens, slot.kind, f"{f.relpath}:{start + 1}", "code"))
    return out


WORKLOAD = Workload("code", make)
