"""Small products padded to four rows where the CPU's BLAS runs 2-3 rows slower than 4 (engine/linear.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import EngineConfig, ModelRunner, SeqInput
from engine.linear import PAD_TO, Linear, calibrate, linears, padded_rows
from tests.conftest import hf_logits

ATOL = 1e-4


def test_padded_rows_run_as_four_and_come_back_row_for_row(monkeypatch):
    torch.manual_seed(0)
    layer = Linear(16, 8, bias=True)
    layer.pad_rows = frozenset({2, 3})
    seen: list[int] = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: seen.append(x.shape[0]) or real(x, w, b))
    for rows in (1, 2, 3, 4, 5):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(layer(x), real(x, layer.weight, layer.bias), atol=1e-6, rtol=0)
    assert seen == [1, PAD_TO, PAD_TO, 4, 5]


def test_without_pad_rows_nothing_is_padded(monkeypatch):
    layer = Linear(16, 8, bias=False)
    seen: list[int] = []
    real = F.linear
    monkeypatch.setattr(F, "linear", lambda x, w, b=None: seen.append(x.shape[0]) or real(x, w, b))
    layer(torch.randn(3, 16))
    layer(torch.randn(2, 5, 16))  # not a flat batch of rows: never padded
    assert seen == [3, 2]


@pytest.mark.parametrize("ms, layers, expected", [
    ({1: 36.0, 2: 66.0, 3: 81.0, 4: 50.0}, 121, {2, 3}),  # MKL, AVX2 EPYC: 3 rows read the weight 3 times
    ({1: 4.1, 2: 7.6, 3: 11.5, 4: 6.0}, 9, {2, 3}),
    ({1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0}, 121, set()),  # a BLAS that blocks small products: nothing to gain
    ({1: 36.0, 2: 40.0, 3: 81.0, 4: 50.0}, 121, {3}),
    ({1: 0.10, 2: 0.12, 3: 0.14, 4: 0.11}, 5, set()),  # 6 µs a layer: about what the padding costs
    ({1: 36.0, 2: 54.0, 3: 54.0, 4: 50.0}, 121, set()),  # within timing noise
])
def test_padding_only_where_four_rows_clearly_cost_less(ms, layers, expected):
    assert padded_rows(ms, layers) == frozenset(expected)


def test_calibrate_gives_every_layer_of_a_model_the_same_choice(hf_checkpoint):
    _, model_dir = hf_checkpoint
    runner = ModelRunner.load(model_dir, EngineConfig(num_blocks=16, block_size=4, device="cpu"))
    layers = linears(runner.model)
    assert len(layers) == 2 * 4 + 1  # per layer qkv, o, gate_up, down; the head
    chosen = calibrate(runner.model, repeats=1)
    assert chosen <= frozenset({2, 3})
    assert all(layer.pad_rows == chosen for layer in layers)


@pytest.mark.parametrize("q_len", [2, 3])
def test_padded_verification_matches_transformers(hf_checkpoint, q_len):
    """A one-sequence verification of k = 1 or 2 drafts, every product padded: the logits are
    transformers' own, whatever the calibration on this machine chose."""
    _, model_dir = hf_checkpoint
    runner = ModelRunner.load(model_dir, EngineConfig(num_blocks=16, block_size=4, device="cpu"))
    for layer in linears(runner.model):
        layer.pad_rows = frozenset({2, 3})
    seq = torch.randint(0, 97, (21 + q_len,), generator=torch.Generator().manual_seed(q_len)).tolist()
    runner.forward([SeqInput(1, 0, seq[:21], num_logits=0)])
    [logits] = runner.forward([SeqInput(1, 21, seq[21:], num_logits=q_len)])
    torch.testing.assert_close(logits, hf_logits(model_dir, seq)[-q_len:], atol=ATOL, rtol=0)
