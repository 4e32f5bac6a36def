"""The fp16 way of engine/linear.py: where every weight is exactly an fp16 value (a checkpoint stored in
fp16), products of few rows may run fbgemm's product over an fp16 copy, which reads half the bytes and
computes in fp32: the same products of the same weights, summed in another order. A weight that is not
an fp16 value never runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import EngineConfig, ModelRunner, SeqInput, calibration
from engine.calibration import calibrate, choose
from engine.linear import Linear, SmallProducts, can_halve, linears, use
from tests.conftest import SMALL, hf_logits, write_checkpoint

ATOL = 1e-4


def fp16_layer(bias: bool = True) -> Linear:
    torch.manual_seed(0)
    layer = Linear(16, 8, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(layer.weight.half().float())
    return layer


needs_fbgemm = pytest.mark.skipif(not can_halve([fp16_layer()]), reason="no fbgemm fp16 product in this torch build")


@pytest.fixture(scope="module")
def fp16_checkpoint(tmp_path_factory) -> Path:
    """A small Llama whose weights were saved in fp16: transformers and the engine both read them as
    fp32 values that are exactly fp16 ones."""
    fp32 = write_checkpoint(LlamaConfig(**SMALL), tmp_path_factory.mktemp("fp32"))
    directory = tmp_path_factory.mktemp("fp16")
    AutoModelForCausalLM.from_pretrained(fp32).half().save_pretrained(directory)
    return directory


@needs_fbgemm
@pytest.mark.parametrize("bias", [True, False])
def test_the_fp16_way_gives_the_plain_product_up_to_its_bound(seen_rows, bias):
    layer = fp16_layer(bias)
    use([layer], SmallProducts(half_up_to=5))
    for rows in range(0, 8):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(layer(x), x @ layer.weight.T + (layer.bias if bias else 0), atol=1e-5, rtol=0)
    assert seen_rows == [0, 6, 7], "1..5 rows by the fp16 copy; none, 6 and 7 as is"
    use([layer], SmallProducts())
    assert layer.weight_half is None, "no fp16 copy where no row count uses it"


def test_a_weight_that_is_not_an_fp16_value_never_takes_the_fp16_way():
    torch.manual_seed(0)
    layer = Linear(16, 8)
    assert not can_halve([layer]) and not can_halve([fp16_layer(), layer]), "one such weight rules out all"
    with pytest.raises(AssertionError, match="same weight"):
        use([layer], SmallProducts(half_up_to=4))


EPYC_ROWS = {1: 55.6, 2: 102.6, 3: 148.9, 4: 115.7, 8: 145.5, 16: 183.5, 32: 259.6, 64: 407.4, 128: 752.8}
EPYC_COLUMNS = {1: 43.0, 2: 66.9, 3: 93.5, 4: 128.4}  # MKL, AVX2 AMD EPYC, SmolLM2's 121 linears
EPYC_PACKED = {1: 61.8, 2: 61.9, 3: 78.4, 4: 80.6, 8: 82.6, 16: 151.6, 32: 208.5, 64: 336.7, 128: 614.3}
EPYC_HALF = {1: 23.2, 2: 29.5, 3: 29.2, 4: 30.7, 8: 49.1, 16: 71.0, 32: 112.0, 64: 205.0, 128: 390.0}
WITHOUT = SmallProducts(by_columns=frozenset({1}), packed=frozenset({2, 3, 4}), packed_up_to=128)


@pytest.mark.parametrize("half, want", [
    (EPYC_HALF, SmallProducts(half_up_to=128)),  # no column-major or packed copy is kept
    (EPYC_HALF | {16: 175.0}, SmallProducts(packed_up_to=128, half_up_to=8)),  # 9..128 rows still packed
    (EPYC_HALF | {16: 150.0}, SmallProducts(half_up_to=128)),  # a tie with packed at 16 does not end the range
    (EPYC_HALF | {1: 50.0}, WITHOUT),  # clearly slower for one row: it starts at 1 or not at all
    (EPYC_HALF | {1: 40.0}, SmallProducts(half_up_to=128)),  # a tie there does not keep it out
    ({}, WITHOUT),  # not timed: weights that are not fp16 values, or no fbgemm
])
def test_the_fp16_way_runs_from_one_row_up_to_where_the_others_clearly_win(half, want):
    assert choose(EPYC_ROWS, EPYC_COLUMNS, 121, EPYC_PACKED) == WITHOUT
    assert choose(EPYC_ROWS, EPYC_COLUMNS, 121, EPYC_PACKED, half) == want


def test_calibrate_times_the_fp16_way_only_for_fp16_weights(hf_checkpoint, fp16_checkpoint, monkeypatch):
    timed: list[str] = []
    real = calibration.pass_ms
    monkeypatch.setattr(calibration, "pass_ms",
                        lambda layers, rows, way="rows": timed.append(way) or real(layers, rows, way))
    fp32 = ModelRunner.load(hf_checkpoint[1], EngineConfig(num_blocks=16, block_size=4, device="cpu"))
    assert "half" not in timed and fp32.model.lm_head.small.half_up_to == 0
    assert all(layer.weight_half is None for layer in linears(fp32.model))
    timed.clear()
    fp16 = ModelRunner.load(fp16_checkpoint, EngineConfig(num_blocks=16, block_size=4, device="cpu"))
    small = calibrate(fp16.model, repeats=1)  # which counts it picks is timing
    assert ("half" in timed) == can_halve(linears(fp16.model))
    assert all((layer.weight_half is not None) == (small.half_up_to > 0) for layer in linears(fp16.model))


@needs_fbgemm
@pytest.mark.parametrize("q_len", [1, 2, 3, 5])
def test_decodes_and_verifications_by_the_fp16_way_match_transformers(fp16_checkpoint, q_len):
    """One sequence decoding, or verifying k = 1, 2 or 4 drafts, every product of up to 8 rows by the
    fp16 copy: the logits are transformers' own over the same (fp16-valued) weights in fp32."""
    runner = ModelRunner.load(fp16_checkpoint, EngineConfig(num_blocks=16, block_size=4, device="cpu"))
    use(linears(runner.model), SmallProducts(half_up_to=8))
    seq = torch.randint(0, 97, (21 + q_len,), generator=torch.Generator().manual_seed(q_len)).tolist()
    runner.forward([SeqInput(1, 0, seq[:21], num_logits=0)])
    [logits] = runner.forward([SeqInput(1, 21, seq[21:], num_logits=q_len)])
    torch.testing.assert_close(logits, hf_logits(fp16_checkpoint, seq)[-q_len:], atol=ATOL, rtol=0)
