"""Shared fixtures: tiny random-init checkpoints written with transformers' save_pretrained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=97, max_position_embeddings=256)


def _llama3() -> LlamaConfig:
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    return LlamaConfig(**SMALL, rope_parameters=scaling)


ARCHS = {
    "llama3": _llama3,
    "llama-tied": lambda: LlamaConfig(**SMALL, tie_word_embeddings=True),
    "mistral-window": lambda: MistralConfig(**SMALL, sliding_window=8),
    "qwen2": lambda: Qwen2Config(**SMALL),
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=24),  # QK-norm; head_dim != hidden / heads
}


def write_checkpoint(config, directory: Path, seed: int = 0, shard: str | None = None) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # random-init norms are all ones; perturb them so a norm bug shows
        for name, p in model.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(directory, **kwargs)
    return directory


def reduce_head(src: Path, dst: Path, keep: list[int]) -> Path:
    """dst: src's checkpoint with an lm_head over `keep` only (a draft's reduced vocabulary).
    Ids outside the vocabulary get a zero row (for the refusal test)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    head = weights["lm_head.weight"]
    weights["lm_head.weight"] = torch.stack([head[t] if t < head.shape[0] else head[0] * 0 for t in keep])
    weights["lm_head.token_ids"] = torch.tensor(keep)
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "draft_vocab_size": len(keep)}))
    return dst


@pytest.fixture
def seen_rows(monkeypatch) -> list[int]:
    """The row counts F.linear (engine/linear.py's row-major fp32 way) is called with."""
    seen: list[int] = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: seen.append(x.shape[0]) or real(x, w, b))
    return seen


@pytest.fixture(scope="session", params=sorted(ARCHS))
def hf_checkpoint(request, tmp_path_factory) -> tuple[str, Path]:
    """(name, dir) for each architecture; the qwen2 one is saved sharded."""
    name = request.param
    directory = tmp_path_factory.mktemp(name)
    write_checkpoint(ARCHS[name](), directory, shard="100KB" if name == "qwen2" else None)
    return name, directory


def hf_logits(model_dir: Path, tokens: list[int]) -> torch.Tensor:
    """Reference: transformers' own implementation, full sequence, fp32. [len, vocab]."""
    model = _hf_model(str(model_dir))
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


_HF_CACHE: dict[str, torch.nn.Module] = {}


def _hf_model(model_dir: str) -> torch.nn.Module:
    if model_dir not in _HF_CACHE:
        _HF_CACHE[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return _HF_CACHE[model_dir]


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Reference greedy continuation: transformers generate, no sampling."""
    model = _hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def write_tokenizer(directory: Path, vocab_size: int = 320) -> None:
    """A small byte-level BPE trained on stdlib text, saved as transformers expects."""
    import json
    import sysconfig

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = [(stdlib / name).read_text() for name in ("textwrap.py", "shlex.py", "fnmatch.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(text, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 512}))


@pytest.fixture(scope="session")
def model_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target_dir, draft_dir): a tiny random-init Llama target and a draft that agrees with it
    about two times in three (the target's weights plus noise; its second choice is right another
    ~17%), sharing one trained tokenizer: speculation accepts, rejects and guesses like a real pair.
    EOS is set to an id greedy decoding of these weights never reaches, so lengths are predictable."""
    import shutil

    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("pair")
    write_tokenizer(root / "tok")
    vocab = len(json.loads((root / "tok" / "tokenizer.json").read_text())["model"]["vocab"])
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=512, bos_token_id=0,
                      eos_token_id=1)
    target = write_checkpoint(cfg, root / "target", seed=0)
    draft = shutil.copytree(target, root / "draft")
    weights = load_file(str(draft / "model.safetensors"))
    gen = torch.Generator().manual_seed(1)
    save_file({n: w + 0.003 * torch.randn(w.shape, generator=gen) for n, w in weights.items()},
              str(draft / "model.safetensors"), metadata={"format": "pt"})
    for d in (target, draft):
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(root / "tok" / f, d / f)
    return target, draft
