"""Which attention backend runs where: flash-attn only for float16/bfloat16 on CUDA; auto falls back
to PyTorch SDPA (and says why) for float32; an explicit flash request it cannot honour is refused
with the reason, before any weight is loaded. Runs without a GPU: only the choice is under test."""

from __future__ import annotations

import argparse
import logging

import pytest
import torch

from engine import flash_attention
from engine.flash_attention import uses_flash
from engine.service import add_model_args, engine_config_from_args, load_runner
from tests.conftest import SMALL, write_checkpoint

CUDA = torch.device("cuda")


@pytest.fixture
def flash_importable(monkeypatch):
    monkeypatch.setattr(flash_attention, "flash_attn_available", lambda: True)


def test_auto_picks_flash_only_for_half_precision(flash_importable, caplog):
    assert uses_flash("auto", CUDA, torch.bfloat16) and uses_flash("auto", CUDA, torch.float16)
    with caplog.at_level(logging.INFO, logger="engine.flash_attention"):
        assert not uses_flash("auto", CUDA, torch.float32)
    assert "no torch.float32 kernels" in caplog.text
    assert not uses_flash("auto", torch.device("cpu"), torch.bfloat16)
    assert not uses_flash("torch", CUDA, torch.bfloat16)


def test_auto_without_flash_attn_installed_is_sdpa(monkeypatch):
    monkeypatch.setattr(flash_attention, "flash_attn_available", lambda: False)
    assert not uses_flash("auto", CUDA, torch.bfloat16)


def test_explicit_flash_with_float32_or_off_cuda_is_refused_clearly(flash_importable):
    with pytest.raises(ValueError, match="float16 or bfloat16 only.*float32"):
        uses_flash("flash", CUDA, torch.float32)
    with pytest.raises(ValueError, match="needs a CUDA device"):
        uses_flash("flash", torch.device("cpu"), torch.bfloat16)


def _args(model_dir, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_model_args(parser, 1)
    return parser.parse_args(["--model", str(model_dir), *extra])


def test_block_size_follows_the_backend_actually_chosen(flash_importable, tmp_path):
    from transformers import LlamaConfig

    model_dir = write_checkpoint(LlamaConfig(**SMALL), tmp_path / "m")
    assert engine_config_from_args(_args(model_dir, "--device", "cuda", "--dtype", "bfloat16")).block_size == 256
    assert engine_config_from_args(_args(model_dir, "--device", "cuda", "--dtype", "float32")).block_size == 16
    with pytest.raises(SystemExit, match="float16 or bfloat16 only"):
        load_runner(_args(model_dir, "--device", "cuda", "--dtype", "float32", "--attention-backend", "flash"))
