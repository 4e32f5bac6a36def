"""Training: the target on the corpus, the draft distilled from the target.

Both models are ``transformers.LlamaForCausalLM``. Training runs under bf16 autocast (fp32
master weights) where the CPU has native bf16 and in plain fp32 elsewhere (precision.py decides
at run time); everything the models are measured or served with is fp32.
Every random choice comes from a seeded ``torch.Generator``, so a build is reproducible.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import LlamaConfig, LlamaForCausalLM

from .tokenizer import BOS_ID, EOS_ID, PAD_ID


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int


@dataclass(frozen=True)
class TrainSchedule:
    steps: int
    batch: int
    seq_len: int
    lr: float
    warmup: int = 20
    weight_decay: float = 0.1
    max_seconds: float = 0.0  # safety cap (0 = none); if hit, training stops early and says so


def make_model(shape: ModelShape, vocab_size: int, max_positions: int, seed: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        attention_bias=False,
        mlp_bias=False,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model.float()


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def lr_at(step: int, sched: TrainSchedule) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < sched.warmup:
        return sched.lr * (step + 1) / sched.warmup
    progress = (step - sched.warmup) / max(1, sched.steps - sched.warmup)
    return sched.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def make_optimizer(model: torch.nn.Module, sched: TrainSchedule) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    groups = [{"params": decay, "weight_decay": sched.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=sched.lr, betas=(0.9, 0.95), eps=1e-8)


def sample_windows(stream: torch.Tensor, gen: torch.Generator, batch: int, length: int) -> torch.Tensor:
    """``batch`` random windows of ``length`` tokens from a 1-D token stream."""
    starts = torch.randint(0, stream.numel() - length, (batch,), generator=gen)
    return torch.stack([stream[s : s + length] for s in starts.tolist()])


def run_schedule(desc: str, sched: TrainSchedule, model, loss_fn, bf16: bool) -> dict:
    """The shared loop: schedule, clipping, progress bar with ETA, safety time cap; the loss
    is computed under bf16 autocast only when ``bf16`` (see precision.py)."""
    opt = make_optimizer(model, sched)
    model.train()
    start = time.perf_counter()
    losses: list[float] = []
    done = 0
    bar = tqdm(range(sched.steps), desc=desc, unit="step", dynamic_ncols=True, mininterval=1.0)
    for step in bar:
        if sched.max_seconds and time.perf_counter() - start > sched.max_seconds:
            bar.write(f"{desc}: time cap of {sched.max_seconds:.0f}s reached after {step} steps")
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, sched)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        done = step + 1
        if step % 10 == 0:
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}")
    bar.close()
    model.eval()
    tail = losses[-max(1, len(losses) // 10) :]
    return {
        "steps": done,
        "steps_planned": sched.steps,
        "stopped_by_time_cap": done < sched.steps,
        "precision": "bf16 autocast" if bf16 else "fp32",
        "seconds": round(time.perf_counter() - start, 1),
        "final_train_loss": round(sum(tail) / len(tail), 4),
        "tokens_seen": done * sched.batch * sched.seq_len,
    }


def train_target(model, stream: torch.Tensor, sched: TrainSchedule, seed: int, bf16: bool) -> dict:
    """Next-token cross-entropy on random corpus windows."""
    gen = torch.Generator().manual_seed(seed)

    def loss_fn(step: int) -> torch.Tensor:
        x = sample_windows(stream, gen, sched.batch, sched.seq_len + 1)
        logits = model(input_ids=x[:, :-1]).logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))

    return run_schedule("train target", sched, model, loss_fn, bf16)


@dataclass
class DistillSet:
    """Sequences (corpus prompt + the target's greedy continuation) with the target's top-k
    log-probabilities at every position but the last (position t predicts token t + 1)."""

    tokens: torch.Tensor  # [N, L] int64
    top_ids: torch.Tensor  # [N, L - 1, K] int64
    top_logprobs: torch.Tensor  # [N, L - 1, K] float32
    prompt_lens: torch.Tensor  # [N] int64


@torch.inference_mode()
def greedy_with_teacher(model, prompts: torch.Tensor, new_tokens: int, top_k: int):
    """Greedy-decode ``new_tokens`` after equal-length ``prompts`` [B, P] with the KV cache, in
    fp32. Returns the sequences [B, P + new_tokens] and the model's top-k log-probs at every
    position but the last ([B, P + new_tokens - 1, top_k] ids and values)."""
    out = model(input_ids=prompts, use_cache=new_tokens > 0)
    logp = out.logits.float().log_softmax(-1)
    if new_tokens == 0:  # teacher labels on the prompt alone
        v, ix = logp[:, :-1].topk(top_k, dim=-1)
        return prompts, ix, v
    v, ix = logp.topk(top_k, dim=-1)
    seq, top_v, top_i = [prompts], [v], [ix]
    nxt = logp[:, -1].argmax(-1, keepdim=True)
    for i in range(new_tokens):
        seq.append(nxt)
        if i == new_tokens - 1:
            break
        out = model(input_ids=nxt, cache=out.cache, use_cache=True)
        lp = out.logits.float().log_softmax(-1)
        v, ix = lp.topk(top_k, dim=-1)
        top_v.append(v)
        top_i.append(ix)
        nxt = lp[:, -1].argmax(-1, keepdim=True)
    return torch.cat(seq, 1), torch.cat(top_i, 1), torch.cat(top_v, 1)


def build_distill_set(
    target,
    stream: torch.Tensor,
    num_generated: int,
    num_corpus: int,
    seq_len: int,
    prompt_lens: tuple[int, ...],
    batch: int,
    top_k: int,
    seed: int,
    max_seconds: float = 0.0,
) -> tuple[DistillSet, dict]:
    """The draft's training data, labelled by the target: ``num_generated`` corpus prompts of
    varied lengths, each continued greedily by the target to ``seq_len`` tokens, and
    ``num_corpus`` plain corpus windows of ``seq_len`` tokens (the target's view of real text)."""
    gen = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    n_gen, n_corpus = math.ceil(num_generated / batch), math.ceil(num_corpus / batch)
    plan, corpus_done = [], 0  # corpus batches spread evenly among the generated ones
    for i in range(n_gen + n_corpus):
        if corpus_done * (n_gen + n_corpus) < (i + 1) * n_corpus:
            plan.append(seq_len)
            corpus_done += 1
        else:
            plan.append(prompt_lens[(i - corpus_done) % len(prompt_lens)])
    toks, ids, lps, plens = [], [], [], []
    for p in tqdm(plan, desc="target labels", unit="batch", dynamic_ncols=True):
        if max_seconds and time.perf_counter() - start > max_seconds:
            tqdm.write(f"target labels: time cap of {max_seconds:.0f}s reached after {len(toks)} batches")
            break
        prompts = sample_windows(stream, gen, batch, p)
        seq, ti, tv = greedy_with_teacher(target, prompts, seq_len - p, top_k)
        toks.append(seq)
        ids.append(ti)
        lps.append(tv)
        plens.append(torch.full((batch,), p))
    data = DistillSet(torch.cat(toks), torch.cat(ids), torch.cat(lps), torch.cat(plens))
    info = {
        "batches": len(toks),
        "batches_planned": len(plan),
        "stopped_by_time_cap": len(toks) < len(plan),
        "sequences": data.tokens.size(0),
        "corpus_sequences": int((data.prompt_lens == seq_len).sum()),
        "tokens": data.tokens.numel(),
        "generated_tokens": int((seq_len - data.prompt_lens).sum()),
        "seconds": round(time.perf_counter() - start, 1),
    }
    return data, info


def distill_draft(
    draft, data: DistillSet, sched: TrainSchedule, seed: int, hard_weight: float, soft_weight: float, bf16: bool
) -> dict:
    """Train the draft to match the target at every position: cross-entropy to the target's
    greedy (top-1) choice plus cross-entropy to the target's top-k distribution."""
    gen = torch.Generator().manual_seed(seed)
    n = data.tokens.size(0)
    order = torch.randperm(n, generator=gen)
    cursor = 0

    def loss_fn(step: int) -> torch.Tensor:
        nonlocal order, cursor
        if cursor + sched.batch > n:
            order, cursor = torch.randperm(n, generator=gen), 0
        idx = order[cursor : cursor + sched.batch]
        cursor += sched.batch
        x = data.tokens[idx, :-1]
        logq = model_logprobs(draft, x)
        top_ids, top_lp = data.top_ids[idx], data.top_logprobs[idx]
        hard = -logq.gather(-1, top_ids[..., :1]).mean()
        soft = topk_cross_entropy(logq, top_ids, top_lp).mean()
        return hard_weight * hard + soft_weight * soft

    return run_schedule("distill draft", sched, draft, loss_fn, bf16)


def topk_cross_entropy(logq: torch.Tensor, top_ids: torch.Tensor, top_logp: torch.Tensor) -> torch.Tensor:
    """Cross-entropy from the teacher's top-k distribution to the student's, with the teacher's
    remaining mass as one extra "any other token" outcome. Without that bucket the student
    learns to give every token outside the teacher's top-k no probability at all."""
    p_top = top_logp.exp()
    logq_top = logq.gather(-1, top_ids)
    p_rest = (1.0 - p_top.sum(-1)).clamp_min(0.0)
    q_rest = (1.0 - logq_top.exp().sum(-1)).clamp_min(1e-6)
    return -(p_top * logq_top).sum(-1) - p_rest * q_rest.log()


def model_logprobs(model, x: torch.Tensor) -> torch.Tensor:
    return model(input_ids=x).logits.float().log_softmax(-1)
