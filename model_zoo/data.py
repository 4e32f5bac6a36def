"""The draft's training data and the held-out measurement prompts, all made on this machine by
the target itself: chat questions it writes (Magpie) and stdlib code windows, continued greedily
by the target, with its top-K log-probabilities at every generated position as labels."""

from __future__ import annotations

import time

from demo_models.corpus import Corpus

from .generate import Generated, generate, make_runner
from .prompts import chat_prefix, code_windows, magpie_questions, split_distinct
from .settings import DraftSettings


def make_prompts(s: DraftSettings, target_dir: str, tok, corpus: Corpus, progress: bool = True) -> dict:
    """Token ids of the chat and code prompts, train and held-out. Held-out chat questions are
    distinct from every training question; held-out code comes from held-out files."""
    prefix = len(chat_prefix(tok))
    runner = make_runner(target_dir, s.gen_batch * (prefix + s.question_max_tokens + 8), 8192)
    questions = magpie_questions(runner, tok, s.chat_train + s.chat_eval, s.seed, s.question_max_tokens,
                                 s.question_sampling, s.gen_batch, progress)
    del runner
    train_q, eval_q = split_distinct(questions, s.chat_eval)
    lo, hi = s.code_prompt_lens
    return {
        "questions_eval": eval_q,
        "chat_train": [chat_prefix(tok, q) for q in train_q],
        "chat_eval": [chat_prefix(tok, q) for q in eval_q],
        "code_train": code_windows(tok, corpus, False, s.code_train, lo, hi, s.seed + 1),
        "code_eval": code_windows(tok, corpus, True, s.code_eval, lo, hi, s.seed + 2),
    }


def label_data(s: DraftSettings, target_dir: str, prompts: dict, progress: bool = True) -> dict:
    """The target's greedy continuations: held-out ones first (never capped: they are the
    measurement), then the labelled training set (under the labelling time cap)."""
    stop = [_eos(target_dir)]
    longest = max(len(p) for part in prompts.values() if part and isinstance(part[0], list) for p in part)
    runner = make_runner(target_dir, s.gen_batch * (longest + max(s.answer_max_tokens, s.eval_max_tokens) + 8), 8192)
    common = {"stop_ids": stop, "batch": s.gen_batch, "progress": progress}
    eval_chat = generate(runner, prompts["chat_eval"], s.eval_max_tokens, desc="held-out chat", **common)
    eval_code = generate(runner, prompts["code_eval"], s.eval_max_tokens, desc="held-out code", **common)
    t0 = time.perf_counter()
    mixed = _interleave(prompts["chat_train"], prompts["code_train"])
    train = generate(runner, mixed, s.answer_max_tokens, label_top_k=s.label_top_k, desc="target labels",
                     max_seconds=s.labelling_max_seconds, **common)
    info = {
        "sequences": len(train),
        "sequences_planned": len(mixed),
        "stopped_by_time_cap": len(train) < len(mixed),
        "chat_questions": len(prompts["chat_train"]),
        "code_windows": len(prompts["code_train"]),
        "labelled_tokens": sum(len(g.output) for g in train),
        "label_top_k": s.label_top_k,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return {"train": train, "eval_chat": eval_chat, "eval_code": eval_code, "info": info,
            "questions_eval": prompts["questions_eval"]}


def _interleave(a: list, b: list) -> list:
    """a and b mixed evenly, so a time cap cuts both kinds alike."""
    out, j = [], 0
    for i, x in enumerate(a):
        out.append(x)
        while j < len(b) and j * len(a) <= i * len(b):
            out.append(b[j])
            j += 1
    return out + b[j:]


def _eos(model_dir: str) -> int:
    import json
    from pathlib import Path

    eos = json.loads((Path(model_dir) / "generation_config.json").read_text())["eos_token_id"]
    return eos[0] if isinstance(eos, list) else eos


__all__ = ["Generated", "label_data", "make_prompts"]
