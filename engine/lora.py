"""LoRA adapters (PEFT's checkpoint format), many in one batch: each sequence names its adapter, or
none (the base model), and every projection adds its rows' low-rank updates (S-LoRA / Punica's
idea, as plain PyTorch: one small product pair per adapter present in the batch).

An adapter for q/k/v (or gate/up) is fused as the base weights are (engine/weights.py): the parts'
A matrices stacked, their B matrices on a block diagonal, so one product pair serves the fused
projection:

    fused qkv output   [ q | k | v ]  +=  scale * (x @ A^T) @ B^T
    A = [A_q; A_k; A_v]   (3r x hidden)         B = | B_q  0    0   |   (q + 2kv) x 3r
                                                    | 0    B_k  0   |
                                                    | 0    0    B_v |

A part the adapter does not train contributes nothing (its rows of B stay zero, its A is left out).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from common.block_hash import adapter_root
from engine.config import ModelConfig
from tandem.v1 import common_pb2

# PEFT's module names -> (the engine's fused projection, which part of it)
_PARTS = {"q_proj": ("qkv", 0), "k_proj": ("qkv", 1), "v_proj": ("qkv", 2), "o_proj": ("o", 0),
          "gate_proj": ("gate_up", 0), "up_proj": ("gate_up", 1), "down_proj": ("down", 0)}


def _shapes(cfg: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Each fused projection's input size and its parts' output sizes."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (cfg.hidden_size, [q, kv, kv]), "o": (q, [cfg.hidden_size]),
            "gate_up": (cfg.hidden_size, [cfg.intermediate_size] * 2),
            "down": (cfg.intermediate_size, [cfg.hidden_size])}


class AdapterError(ValueError):
    """An adapter directory Tandem cannot serve, saying why."""


@dataclass
class LoraAdapter:
    name: str
    rank: int
    scale: float  # lora_alpha / r (rsLoRA: / sqrt(r))
    layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]]  # per layer: projection -> (A, B), fused
    root: int  # its sequences' first block hashes from here (common/block_hash.adapter_root of name and files)
    path: str  # the directory it was loaded from

    def info(self) -> common_pb2.LoraAdapterInfo:
        return common_pb2.LoraAdapterInfo(name=self.name, block_root=self.root, path=self.path)

    @classmethod
    def load(cls, name: str, path: str | Path, cfg: ModelConfig, device: torch.device,
             dtype: torch.dtype) -> LoraAdapter:
        path = Path(path)
        try:
            config_bytes = (path / "adapter_config.json").read_bytes()
            weights_bytes = (path / "adapter_model.safetensors").read_bytes()
            config, tensors = json.loads(config_bytes), load(weights_bytes)
        except (OSError, ValueError, SafetensorError) as err:
            raise AdapterError(f"adapter {name!r}: {path} is no PEFT LoRA adapter ({err})") from None
        if not isinstance(config, dict):
            raise AdapterError(f"adapter {name!r}: {path}/adapter_config.json is no JSON object")
        fingerprint = hashlib.blake2b(config_bytes + b"\0" + weights_bytes, digest_size=16).hexdigest()
        if config.get("peft_type", "LORA") != "LORA" or config.get("fan_in_fan_out") or \
                config.get("bias", "none") != "none" or config.get("use_dora") or not isinstance(config.get("r"), int) \
                or config.get("rank_pattern") or config.get("alpha_pattern"):
            raise AdapterError(f"adapter {name!r}: only plain LoRA of one rank r (no bias, DoRA, fan_in_fan_out or "
                               "per-module ranks) is served")
        rank, alpha = config["r"], float(config.get("lora_alpha", config["r"]))
        scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        parts: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
        for key, tensor in tensors.items():
            layer, module, which = _parse_key(name, key)
            if layer >= cfg.num_layers:
                raise AdapterError(f"adapter {name!r}: {key} is for layer {layer}; the model has {cfg.num_layers}")
            parts.setdefault((layer, *_PARTS[module]), {})[which] = tensor
        layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = [{} for _ in range(cfg.num_layers)]
        for projection, (in_size, part_sizes) in _shapes(cfg).items():
            for layer in range(cfg.num_layers):
                found = [parts.get((layer, projection, i)) for i in range(len(part_sizes))]
                if any(found):
                    layers[layer][projection] = _fuse(name, f"layer {layer} {projection}", found, in_size, part_sizes,
                                                      rank, device, dtype)
        if not any(layers):
            raise AdapterError(f"adapter {name!r}: no LoRA weights for this model's projections")
        return cls(name, rank, scale, layers, adapter_root(name, fingerprint), str(path))


def _parse_key(name: str, key: str) -> tuple[int, str, str]:
    """'base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight' -> (3, 'q_proj', 'A')."""
    bits = key.split(".")
    try:
        layer = int(bits[bits.index("layers") + 1])
        which = {"lora_A": "A", "lora_B": "B"}[bits[-2]]
        module = bits[-3]
    except (ValueError, KeyError, IndexError):
        raise AdapterError(f"adapter {name!r}: tensor {key!r} is no LoRA weight of a decoder layer") from None
    if module not in _PARTS:
        raise AdapterError(f"adapter {name!r}: {module} is not adapted by Tandem (attention and MLP projections are)")
    return layer, module, which


def _fuse(name: str, where: str, found: list[dict | None], in_size: int, sizes: list[int], rank: int,
          device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    a_parts = []
    b = torch.zeros(sum(sizes), rank * sum(1 for f in found if f), dtype=torch.float32)
    row = col = 0
    for part, size in zip(found, sizes, strict=True):
        if part is not None:
            if set(part) != {"A", "B"} or part["A"].shape != (rank, in_size) or part["B"].shape != (size, rank):
                raise AdapterError(f"adapter {name!r}: {where}: A and B must be [{rank}, {in_size}] and "
                                   f"[{size}, {rank}] (an adapter made for this model, of rank r)")
            a_parts.append(part["A"].float())
            b[row:row + size, col:col + rank] = part["B"].float()
            col += rank
        row += size
    return torch.cat(a_parts).to(device, dtype), b.to(device, dtype)


class LoraBatch:
    """Which flat tokens of a forward use which adapter; adds their updates to a projection's output."""

    def __init__(self, groups: list[tuple[torch.Tensor | None, LoraAdapter]]) -> None:
        self.groups = groups  # (token indices, or None for every token; adapter)

    @classmethod
    def of(cls, names: list[str], query_lens: list[int], adapters: dict[str, LoraAdapter],
           device: torch.device) -> LoraBatch:
        """names[i]: the adapter of sequence i, whose query_lens[i] tokens follow sequence i - 1's."""
        rows: dict[str, list[int]] = {}
        offset = 0
        for name, n in zip(names, query_lens, strict=True):
            rows.setdefault(name, []).extend(range(offset, offset + n))
            offset += n
        if len(rows) == 1 and "" not in rows:  # one adapter for the whole batch: no gathers
            return cls([(None, adapters[names[0]])])
        return cls([(torch.tensor(r, device=device), adapters[name]) for name, r in rows.items() if name])

    def add(self, layer: int, projection: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        for rows, adapter in self.groups:
            pair = adapter.layers[layer].get(projection)
            if pair is None:
                continue
            a, b = pair
            xs = x if rows is None else x.index_select(0, rows)
            update = (xs @ a.T) @ b.T * adapter.scale
            out = out + update if rows is None else out.index_add(0, rows, update)
        return out
