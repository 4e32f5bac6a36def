"""A reduced-vocabulary draft (config ``draft_vocab_size``, ``lm_head.token_ids``) as a
transformers model, so that transformers' own ``generate(assistant_model=draft)`` can run the
same pair Tandem serves. ``AutoModelForCausalLM`` cannot load such a draft (its head has fewer
rows than the vocabulary); ``load_causal_lm`` loads it and any ordinary checkpoint alike."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM


class ReducedLMHead(nn.Module):
    """Row i scores token ``token_ids[i]``; every other token gets -inf, as in engine/."""

    def __init__(self, hidden: int, head_vocab: int, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab
        self.weight = nn.Parameter(torch.empty(head_vocab, hidden))
        self.register_buffer("token_ids", torch.zeros(head_vocab, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = nn.functional.linear(x, self.weight).float()
        full = scores.new_full((*scores.shape[:-1], self.vocab), float("-inf"))
        return full.index_copy_(-1, self.token_ids, scores)


class ReducedVocabLlamaForCausalLM(LlamaForCausalLM):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.lm_head = ReducedLMHead(config.hidden_size, config.draft_vocab_size, config.vocab_size)


def load_causal_lm(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers model for ``model_dir``, in eval mode; a reduced-vocabulary draft included."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    if raw.get("draft_vocab_size"):
        return ReducedVocabLlamaForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
