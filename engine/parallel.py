"""Tensor parallelism inside one target replica (Megatron-LM style) over torch.distributed.

Each rank holds 1/N of every attention and MLP layer:

    qkv_proj, gate_up_proj   column-parallel: rank r computes its own heads / its own slice of the
                             intermediate features; no communication
    o_proj, down_proj        row-parallel: rank r multiplies its slice of the inputs, then one
                             all-reduce (sum) gives every rank the full output
    KV cache                 rank r stores its num_kv_heads / N key/value heads
    embed_tokens, lm_head    replicated (a vocabulary matrix is small next to the layers); only
                             rank 0 computes logits, since only rank 0 samples

Two all-reduces per layer, NCCL on CUDA, gloo on CPU (tests). Rank 0 serves gRPC and owns the
block accounting; before each forward it sends the flattened batch (token ids, positions, slots,
block tables, logits indices: a few KB of ints) to every follower over a pipe, and all ranks run
the same forward in lockstep. A pipe rather than a collective: an idle follower waits for the next
step as long as the service is idle, and a blocking NCCL/gloo broadcast would hit its timeout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.linear import Linear


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in its tensor-parallel group (size 1: no group, no communication)."""

    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup when size > 1
    pipes: Sequence[Connection] = ()  # the leader's send ends to ranks 1..N-1; a follower's one receive end

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def send(self, batch: object | None) -> None:
        """Leader: the next forward's inputs to every follower (None: stop)."""
        for pipe in self.pipes:
            pipe.send(batch)

    def receive(self) -> object | None:
        """Follower: block until the leader sends; None when told to stop or when the leader is gone."""
        try:
            return self.pipes[0].recv()
        except (EOFError, OSError):
            return None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x


SINGLE = TensorParallel()


def init_group(rank: int, size: int, init_method: str, device: torch.device,
               pipes: Sequence[Connection]) -> TensorParallel:
    """Join the group (blocks until all `size` ranks have): NCCL on CUDA, gloo elsewhere."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init_method, rank=rank, world_size=size, device_id=device)
    else:
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=size)
    return TensorParallel(rank, size, dist.group.WORLD, tuple(pipes))


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """ValueError naming what does not divide: heads, KV heads and MLP features are split evenly."""
    problems = [f"{what} {n} is not divisible by --tensor-parallel-size {size}"
                for what, n in (("num_attention_heads", cfg.num_heads), ("num_key_value_heads", cfg.num_kv_heads),
                                ("intermediate_size", cfg.intermediate_size)) if n % size]
    if problems:
        raise ValueError("cannot shard this model: " + "; ".join(problems))


class ColumnParallelLinear(Linear):
    """This rank's rows of the weight: out_features / size outputs, no communication."""

    def __init__(self, in_features: int, local_out_features: int, bias: bool) -> None:
        super().__init__(in_features, local_out_features, bias=bias)


class RowParallelLinear(Linear):
    """This rank's columns of the weight, then the sum over ranks. No bias (Llama has none here)."""

    def __init__(self, local_in_features: int, out_features: int, tp: TensorParallel) -> None:
        super().__init__(local_in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


def shard_for_rank(name: str, tensor: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's slice of a checkpoint tensor (Hugging Face names). Heads are contiguous in
    q/k/v rows, so slicing rows evenly gives rank r heads r*H/N .. (r+1)*H/N - 1 and their KV heads."""
    if tp.size == 1:
        return tensor
    if any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
        return tensor.chunk(tp.size, dim=0)[tp.rank]
    if ".o_proj." in name or ".down_proj." in name:
        return tensor.chunk(tp.size, dim=1)[tp.rank]
    return tensor
