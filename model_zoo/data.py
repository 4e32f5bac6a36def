"""The draft's training data and the held-out measurement prompts, all made on this machine by
the target itself: chat questions it writes (Magpie) and stdlib code windows, continued greedily
by the target, with its top-K log-probabilities at every generated position as labels; and the
target reading stdlib code (teacher forcing), labelled the same way at every position it read."""

from __future__ import annotations

import time

import torch
from tqdm import tqdm

from demo_models.corpus import Corpus
from engine import SeqInput

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


def read_code(s: DraftSettings, target_dir: str, tok, corpus: Corpus, progress: bool = True) -> tuple[list, dict]:
    """The target's top-K at every position of ``read_windows`` windows of training stdlib files
    (the first ``read_context`` tokens of each only as context). One forward labels a whole batch
    of windows, so this yields about 2.5x the labelled tokens per second of generating them (here:
    ~350 against ~140), and held-out code acceptance rose with it (docs/models.md)."""
    windows = code_windows(tok, corpus, False, s.read_windows, s.read_len, s.read_len, s.seed + 3)
    per_forward = max(1, 3072 // s.read_len)  # ~3k tokens a forward: larger batches gain nothing on a CPU
    runner = make_runner(target_dir, per_forward * s.read_len + 64, per_forward * s.read_len)
    t0 = time.perf_counter()
    out = read_labels(runner, windows, s.read_context, s.label_top_k, per_forward, s.reading_max_seconds, progress)
    info = {"windows": len(out), "windows_planned": len(windows), "stopped_by_time_cap": len(out) < len(windows),
            "labelled_tokens": sum(len(g.output) for g in out), "seconds": round(time.perf_counter() - t0, 1)}
    return out, info


@torch.inference_mode()
def read_labels(runner, windows: list[list[int]], context: int, top_k: int, per_forward: int,
                max_seconds: float = 0.0, progress: bool = True) -> list[Generated]:
    """Teacher forcing: for each window, the model's top-K log-probabilities at the positions that
    predict its tokens after the first ``context``, as a ``Generated`` whose output is the rest of
    the window. After ``max_seconds`` (0: never) no further batch is started."""
    out: list[Generated] = []
    t0 = time.perf_counter()
    bar = tqdm(total=len(windows), desc="target reads code", unit="win", disable=not progress, mininterval=1.0,
               dynamic_ncols=True)
    for lo in range(0, len(windows), per_forward):
        if max_seconds and time.perf_counter() - t0 > max_seconds:
            bar.write(f"target reads code: time cap of {max_seconds:.0f}s reached after {len(out)} windows")
            break
        batch = windows[lo : lo + per_forward]
        # window w, n = len(w): logits at positions context-1 .. n-2 predict tokens context .. n-1
        entries = [SeqInput(i, 0, w[:-1], num_logits=len(w) - context) for i, w in enumerate(batch)]
        for w, logits in zip(batch, runner.forward(entries), strict=True):
            logits = logits.float()
            top_v, top_i = logits.topk(top_k, dim=-1)
            out.append(Generated(list(w[:context]), list(w[context:]), top_i,
                                 top_v - logits.logsumexp(-1, keepdim=True)))
        runner.release(list(range(len(batch))))
        bar.update(len(batch))
    bar.close()
    return out


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


__all__ = ["Generated", "label_data", "make_prompts", "read_code", "read_labels"]
