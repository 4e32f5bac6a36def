"""Load a Hugging Face checkpoint directory (*.safetensors, sharded or not) into CausalLM.
With tensor parallelism each rank keeps only its slice of each tensor (engine/parallel.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model import CausalLM
from engine.parallel import shard_for_rank

# HF name fragment -> (our fused parameter, shard index within it)
_FUSED = {
    ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
    ".self_attn.k_proj.": (".self_attn.qkv_proj.", 1),
    ".self_attn.v_proj.": (".self_attn.qkv_proj.", 2),
    ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
    ".mlp.up_proj.": (".mlp.gate_up_proj.", 1),
}


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _shard_sizes(model: CausalLM, fused_name: str) -> list[int]:
    """Rows of each part of a fused parameter on this rank."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    if "qkv_proj" in fused_name:
        return [attn.q_size, attn.kv_size, attn.kv_size]
    return [mlp.intermediate, mlp.intermediate]


def load_weights(model: CausalLM, model_dir: Path) -> None:
    """Copy every checkpoint tensor into its (possibly fused) parameter; fail on gaps or extras."""
    params = dict(model.named_parameters())
    if model.config.head_vocab_size is not None:
        params["lm_head.token_ids"] = model.lm_head.token_ids  # a buffer, but stored like a weight
    loaded: dict[str, int] = {}
    for name, tensor in iter_tensors(model_dir):
        if "rotary_emb.inv_freq" in name:
            continue
        target, shard = name, None
        for fragment, (fused, index) in _FUSED.items():
            if fragment in name:
                target, shard = name.replace(fragment, fused), index
                break
        if target not in params:
            if target == "lm_head.weight" and model.config.tie_word_embeddings:
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in the {model.config.architecture} model")
        param = params[target]
        tensor = shard_for_rank(name, tensor, model.tp)
        dest = param.data
        if shard is not None:
            sizes = _shard_sizes(model, target)
            dest = dest.narrow(0, sum(sizes[:shard]), sizes[shard])
        if dest.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(dest.shape)}")
        dest.copy_(tensor.to(dest.dtype))
        if target == "lm_head.token_ids":
            _check_token_ids(tensor, model.config.vocab_size)
        loaded[target] = loaded.get(target, 0) + 1
    expected_parts = {n: len(_shard_sizes(model, n)) if ("qkv_proj" in n or "gate_up" in n) else 1 for n in params}
    if model.config.tie_word_embeddings:
        expected_parts.pop("lm_head.weight", None)
    missing = [n for n, parts in expected_parts.items() if loaded.get(n, 0) < parts]
    if missing == ["lm_head.weight"]:  # some checkpoints omit a tied head without saying so
        model.lm_head.weight = model.model.embed_tokens.weight
        missing = []
    if missing:
        raise ValueError(f"checkpoint in {model_dir} lacks weights for: {missing[:8]}")


def _check_token_ids(ids: torch.Tensor, vocab: int) -> None:
    """A reduced head's row -> token map: distinct ids inside the vocabulary."""
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"lm_head.token_ids: ids outside [0, {vocab})")
    if ids.unique().numel() != ids.numel():
        raise ValueError("lm_head.token_ids: ids must be distinct")
