"""A small draft cut from its target and distilled on the target's own generations.

The draft keeps the target's width, so its layers start as copies of chosen target layers, its
final norm is the target's, and its output head is the target's (tied) embedding restricted to
the most frequent tokens (a reduced vocabulary, as in FR-Spec / EAGLE-3: the draft's q is zero
elsewhere, which keeps rejection sampling lossless). The input embedding is the target's, whole
and frozen, so every token the target can emit can be fed back. Training matches the target's
top-K distribution at every generated position, restricted to the head's tokens.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from demo_models.train import TrainSchedule, run_schedule

from .generate import Generated
from .hf_draft import ReducedVocabLlamaForCausalLM

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def most_frequent_tokens(sources: Sequence[Sequence[Sequence[int]]], n: int, always: Sequence[int] = ()) -> list[int]:
    """The ``n`` ids ranked by their count in the first source, ties broken by the next source's
    count, then by id (a BPE vocabulary's ids follow its merge order, roughly frequency); the
    ``always`` ids first. Returned sorted."""
    counts = [Counter(t for s in src for t in s) for src in sources]
    seen = set().union(*counts)
    ranked = sorted(seen, key=lambda t: (*(-c[t] for c in counts), t))
    chosen = list(dict.fromkeys([*always, *ranked]))[:n]
    return sorted(chosen)


def cut_draft(target_dir: str | Path, layers: Sequence[int], head_ids: Sequence[int]) -> tuple[dict, dict]:
    """(config, weights) of a draft whose layers are copies of the target's ``layers`` and whose
    head scores ``head_ids`` with the target's output rows."""
    target_dir = Path(target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    w = load_file(str(target_dir / "model.safetensors"))
    embed = w["model.embed_tokens.weight"]
    head = w.get("lm_head.weight", embed)
    ids = torch.tensor(list(head_ids), dtype=torch.long)
    out = {"model.embed_tokens.weight": embed, "model.norm.weight": w["model.norm.weight"]}
    for new, old in enumerate(layers):
        prefix = f"model.layers.{old}."
        out.update({f"model.layers.{new}.{k[len(prefix):]}": v for k, v in w.items() if k.startswith(prefix)})
    out["lm_head.weight"] = head[ids].clone()
    out["lm_head.token_ids"] = ids
    config.update(num_hidden_layers=len(layers), tie_word_embeddings=False, draft_vocab_size=len(ids))
    return config, out


def save_draft(config: dict, weights: dict, target_dir: str | Path, out_dir: str | Path) -> None:
    """Write the draft as a Hugging Face directory with the target's tokenizer files, byte for byte; its
    matrices in fp16 where the target's are (model_zoo/gguf.py: the engine's faster fp16 way)."""
    out = Path(out_dir)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    half = _stores_half(target_dir)
    tensors = {k: (v.half() if half and v.dim() == 2 and v.is_floating_point() else v).contiguous()
               for k, v in weights.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        if (Path(target_dir) / f).is_file():
            shutil.copyfile(Path(target_dir) / f, out / f)
    for f in out.iterdir():
        os.chmod(f, 0o644)


def _stores_half(model_dir: str | Path) -> bool:
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return f.get_slice("model.embed_tokens.weight").get_dtype() == "F16"


def num_params(model_dir: str | Path) -> int:
    """Parameters in the directory's weights (a reduced head's token_ids are not parameters)."""
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt") as f:
        return sum(_numel(f.get_slice(k).get_shape()) for k in f.keys() if not k.endswith("token_ids"))


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def build_model(config: dict, weights: dict) -> ReducedVocabLlamaForCausalLM:
    from transformers import LlamaConfig

    cfg = LlamaConfig(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    cfg._attn_implementation = "sdpa"
    model = ReducedVocabLlamaForCausalLM(cfg).float()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise ValueError(f"draft weights do not fit: missing {missing}, unexpected {unexpected}")
    return model


@dataclass(frozen=True)
class LossWeights:
    hard: float = 0.5  # cross-entropy to the target's greedy token
    soft: float = 1.0  # cross-entropy to the target's top-K distribution (rest of its mass as one outcome)


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, L] input ids (right-padded)
    rows: torch.Tensor  # [M] batch row of each labelled position
    cols: torch.Tensor  # [M] its column: the logits there predict the label
    top_ids: torch.Tensor  # [M, K] the target's top-K ids (full vocabulary)
    top_logprobs: torch.Tensor  # [M, K]


def make_batches(data: Sequence[Generated], batch_tokens: int, gen: torch.Generator) -> list[Batch]:
    """Sequences grouped by length (little padding), each group at most ``batch_tokens`` long in
    all, in a random order of groups."""
    order = sorted(range(len(data)), key=lambda i: (len(data[i].prompt) + len(data[i].output), i))
    groups: list[list[int]] = [[]]
    for i in order:
        length = len(data[i].prompt) + len(data[i].output) - 1
        if groups[-1] and (len(groups[-1]) + 1) * length > batch_tokens:
            groups.append([])
        groups[-1].append(i)
    batches = []
    for g in groups:
        width = max(len(data[i].prompt) + len(data[i].output) - 1 for i in g)
        tokens = torch.zeros(len(g), width, dtype=torch.long)
        rows, cols, ids, lps = [], [], [], []
        for r, i in enumerate(g):
            seq = data[i].prompt + data[i].output[:-1]
            tokens[r, : len(seq)] = torch.tensor(seq)
            n, p = len(data[i].output), len(data[i].prompt)
            rows.append(torch.full((n,), r))
            cols.append(torch.arange(p - 1, p - 1 + n))
            ids.append(data[i].top_ids)
            lps.append(data[i].top_logprobs)
        batches.append(Batch(tokens, torch.cat(rows), torch.cat(cols), torch.cat(ids), torch.cat(lps).float()))
    perm = torch.randperm(len(batches), generator=gen).tolist()
    return [batches[i] for i in perm]


def distill_loss(head_logits: torch.Tensor, b: Batch, head_index: torch.Tensor, w: LossWeights) -> torch.Tensor:
    """head_logits [M, N] at the labelled positions; head_index maps a full-vocabulary id to its
    head row (-1: not in the head). Teacher tokens outside the head join the 'rest' outcome."""
    logq = head_logits.float().log_softmax(-1)
    rows = head_index[b.top_ids]  # [M, K]
    inside = rows >= 0
    logq_top = logq.gather(-1, rows.clamp_min(0))
    p_top = b.top_logprobs.exp() * inside
    p_rest = (1.0 - p_top.sum(-1)).clamp_min(0.0)
    q_rest = (1.0 - (logq_top.exp() * inside).sum(-1)).clamp_min(1e-6)
    soft = -(p_top * logq_top).sum(-1) - p_rest * q_rest.log()
    greedy_inside = inside[:, 0]
    hard = -(logq_top[:, 0] * greedy_inside).sum() / greedy_inside.sum().clamp_min(1)
    return w.hard * hard + w.soft * soft.mean()


def distill(
    model: ReducedVocabLlamaForCausalLM,
    data: Sequence[Generated],
    sched: TrainSchedule,
    weights: LossWeights,
    seed: int,
    bf16: bool,
) -> dict:
    """Train the draft's layers, final norm and head (the embedding stays the target's)."""
    model.model.embed_tokens.weight.requires_grad_(False)
    vocab = model.config.vocab_size
    head_index = torch.full((vocab,), -1, dtype=torch.long)
    head_index[model.lm_head.token_ids] = torch.arange(model.lm_head.token_ids.numel())
    gen = torch.Generator().manual_seed(seed)
    batches: list[Batch] = []

    def loss_fn(step: int) -> torch.Tensor:
        nonlocal batches
        if not batches:
            batches = make_batches(data, sched.batch * sched.seq_len, gen)
        b = batches.pop()
        hidden = model.model(input_ids=b.tokens).last_hidden_state
        h = hidden[b.rows, b.cols]
        return distill_loss(torch.nn.functional.linear(h, model.lm_head.weight), b, head_index, weights)

    return run_schedule("distill draft", sched, model, loss_fn, bf16=bf16)


def trained_weights(model: ReducedVocabLlamaForCausalLM) -> dict:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "rotary" not in k}
