"""Tensor parallelism on CPU (gloo): a target split over 2 ranks gives the logits of 1 rank within
1e-5, for prompts, chunks, verification queries and decodes mixed in one batch and after rollback;
shapes that do not divide are refused by name; the follower processes never outlive rank 0."""

from __future__ import annotations

import dataclasses
import os
import time

import pytest
import torch
from transformers import LlamaConfig, Qwen2Config, Qwen3Config

from engine import EngineConfig, ModelRunner, SeqInput
from engine.config import ModelConfig
from engine.parallel import check_shardable
from target_service.tp_workers import Followers
from tests.conftest import SMALL, hf_logits, write_checkpoint

CONFIG = EngineConfig(num_blocks=64, block_size=4, device="cpu")


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, SMALL["vocab_size"], (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def model_dir(request, tmp_path_factory):
    config = {"llama": lambda: LlamaConfig(**SMALL), "qwen2": lambda: Qwen2Config(**SMALL),  # qwen2: q/k/v biases
              "qwen3": lambda: Qwen3Config(**SMALL, head_dim=24)}[request.param]()  # qwen3: per-head q/k norms
    return write_checkpoint(config, tmp_path_factory.mktemp(f"tp-{request.param}"), seed=5)


def _steps(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefill in chunks, then one batch mixing a chunk, a 5-token verification and a decode, then a
    rollback that rewrites cached positions: every logit returned along the way."""
    a, b, c = tokens(1, 30), tokens(2, 17), tokens(3, 9)
    out = []
    out += runner.forward([SeqInput(1, 0, a[:12], 12), SeqInput(2, 0, b[:12], 0), SeqInput(3, 0, c[:8], 8)])
    out += runner.forward([SeqInput(1, 12, a[12:], 18), SeqInput(2, 12, b[12:], 5), SeqInput(3, 8, c[8:], 1)])
    out += runner.forward([SeqInput(2, 10, tokens(4, 6), 6), SeqInput(3, 9, [5], 1)])
    return out


def test_two_ranks_give_the_logits_of_one(model_dir):
    single = _steps(ModelRunner.load(model_dir, CONFIG))
    followers = Followers.start(2, model_dir, CONFIG, threads=1)
    runner = None
    try:
        runner = ModelRunner.load(model_dir, CONFIG, followers.tp)
        assert runner.kv_cache.k.shape[3] == SMALL["num_key_value_heads"] // 2  # KV heads sharded
        split = _steps(runner)
    finally:
        followers.stop(runner)
    assert all(not p.is_alive() and p.exitcode == 0 for p in followers.procs)
    assert len(split) == len(single)
    for got, want in zip(split, single, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    ref = hf_logits(model_dir, tokens(1, 30))[12:]  # and both are transformers' logits
    torch.testing.assert_close(split[3], ref, atol=1e-4, rtol=0)


def test_shapes_that_do_not_divide_are_refused_by_name():
    cfg = ModelConfig.from_dict(LlamaConfig(**SMALL).to_dict())
    check_shardable(cfg, 2)
    with pytest.raises(ValueError, match="num_key_value_heads 2 is not divisible by --tensor-parallel-size 4"):
        check_shardable(cfg, 4)
    with pytest.raises(ValueError, match="num_attention_heads 4 is not divisible.*3.*intermediate_size 128"):
        check_shardable(cfg, 3)


def test_followers_exit_when_rank_0_is_gone(tmp_path):
    """Rank 0 vanishing without a word (its pipe closes): followers return and exit, no orphans."""
    model_dir = write_checkpoint(LlamaConfig(**SMALL), tmp_path / "m")
    followers = Followers.start(2, model_dir, CONFIG, threads=1)
    try:
        runner = ModelRunner.load(model_dir, CONFIG, followers.tp)
        runner.forward([SeqInput(1, 0, tokens(1, 5), 1)])
        for pipe in followers.tp.pipes:
            pipe.close()
        deadline = time.monotonic() + 20
        while any(p.is_alive() for p in followers.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(p.is_alive() for p in followers.procs)
    finally:
        followers.stop(None, timeout=1)
    assert os.getpid()  # this process, rank 0, is unaffected


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (NCCL)")
def test_two_gpus_give_the_logits_of_one(tmp_path):
    model_dir = write_checkpoint(Qwen2Config(**SMALL), tmp_path / "m", seed=5)
    config = EngineConfig(num_blocks=64, block_size=16, device="cuda", dtype="float32", attention_backend="torch")
    single = _steps(ModelRunner.load(model_dir, config))
    followers = Followers.start(2, model_dir, config)
    runner = None
    try:
        runner = ModelRunner.load(model_dir, dataclasses.replace(config, device="cuda:0"), followers.tp)
        split = _steps(runner)
    finally:
        followers.stop(runner)
    for got, want in zip(split, single, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
