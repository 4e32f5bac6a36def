"""Products of few rows on CPU run the fastest measured way: as is, padded to four rows, against a
column-major copy of the weight, or against a copy packed for oneDNN (engine/linear.py)."""

from __future__ import annotations

import pytest
import torch

from engine import EngineConfig, ModelRunner, SeqInput, calibration
from engine.calibration import calibrate, choose
from engine.linear import PAD_TO, Linear, SmallProducts, can_pack, linears, use
from tests.conftest import hf_logits

ATOL = 1e-4


@pytest.mark.parametrize("bias", [True, False])
def test_each_way_gives_the_plain_product_row_for_row(seen_rows, bias):
    torch.manual_seed(0)
    layer = Linear(16, 8, bias=bias)
    use([layer], SmallProducts(padded=frozenset({3}), by_columns=frozenset({1, 2})))
    for rows in (1, 2, 3, 4, 5):
        x = torch.randn(rows, 16)
        want = x @ layer.weight.T + (layer.bias if bias else 0)
        torch.testing.assert_close(layer(x), want, atol=1e-6, rtol=0)
    assert seen_rows == [PAD_TO, 4, 5], "1 and 2 rows column-major, 3 padded, 4 and 5 as is"


needs_onednn = pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="no oneDNN packed linear in this torch build")


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_the_packed_way_gives_the_plain_product_and_covers_its_band(seen_rows, bias):
    """Rows 4..6 against the packed copy, 2 padded to 4 (so packed too); 1, 3 and 7 as is."""
    torch.manual_seed(0)
    layer = Linear(16, 8, bias=bias)
    use([layer], SmallProducts(padded=frozenset({2}), packed=frozenset({4}), packed_up_to=6))
    for rows in range(1, 8):
        x = torch.randn(rows, 16)
        torch.testing.assert_close(layer(x), x @ layer.weight.T + (layer.bias if bias else 0), atol=1e-5, rtol=0)
    assert seen_rows == [1, 3, 7]
    use([layer], SmallProducts())
    assert layer.weight_packed is None, "no packed copy where no row count uses it"


@pytest.mark.parametrize("small", [SmallProducts(padded=frozenset({2, 3})),
                                   SmallProducts(by_columns=frozenset({2})),
                                   pytest.param(SmallProducts(padded=frozenset({2}), packed=frozenset({4}),
                                                              packed_up_to=8), marks=needs_onednn)],
                         ids=["padded", "columns", "padded-then-packed"])
def test_a_reduced_head_scores_its_rows_once_whichever_way(small):
    """A draft's head over a subset of the vocabulary widens its product to the whole vocabulary; rows
    padded to four are multiplied, not widened twice (SmolLM2's draft chose 2 rows padded)."""
    from engine.model import ReducedHead

    torch.manual_seed(0)
    head = ReducedHead(16, 8, 32)
    head.token_ids.copy_(torch.arange(0, 32, 4))
    use([head], small)
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, 16)
        want = torch.full((rows, 32), float("-inf"))
        want[:, head.token_ids] = x @ head.weight.T
        torch.testing.assert_close(head(x), want, atol=1e-5, rtol=0)


def test_as_is_by_default_and_for_inputs_that_are_not_rows(seen_rows):
    layer = Linear(16, 8, bias=False)
    layer(torch.randn(3, 16))
    use([layer], SmallProducts(padded=frozenset({2, 3})))
    layer(torch.randn(2, 5, 16))  # not a flat batch of rows
    assert seen_rows == [3, 2]
    assert layer.weight_t is None, "no column-major copy where no row count uses it"


MKL_AMD_ROWS = {1: 47.0, 2: 80.0, 3: 109.0, 4: 71.0}  # SmolLM2's 121 linears, AVX2 EPYC
MKL_AMD_COLUMNS = {1: 33.0, 2: 50.0, 3: 74.0, 4: 83.0}


@pytest.mark.parametrize("rows, columns, layers, padded, by_columns", [
    (MKL_AMD_ROWS, MKL_AMD_COLUMNS, 121, {3}, {1, 2}),
    (MKL_AMD_ROWS, {r: 2 * ms for r, ms in MKL_AMD_ROWS.items()}, 121, {2, 3}, set()),
    ({1: 10.0, 2: 11.0, 3: 12.0, 4: 13.0}, {1: 10.5, 2: 11.5, 3: 12.5, 4: 13.5}, 121, set(), set()),  # nothing to gain
    ({1: 36.0, 2: 54.0, 3: 54.0, 4: 50.0}, {1: 36.0, 2: 54.0, 3: 54.0, 4: 50.0}, 121, set(), set()),  # within noise
    ({1: 0.10, 2: 0.12, 3: 0.14, 4: 0.11}, {1: 0.08, 2: 0.1, 3: 0.1, 4: 0.1}, 5, set(), set()),  # 6 µs a layer
])
def test_each_row_count_runs_the_way_that_clearly_costs_least(rows, columns, layers, padded, by_columns):
    assert choose(rows, columns, layers) == SmallProducts(frozenset(padded), frozenset(by_columns))


XEON_ROWS = {1: 45.4, 2: 50.2, 3: 54.1, 4: 86.5, 8: 119.4, 16: 113.2, 32: 150.1, 64: 198.1, 128: 297.0}  # MKL, AVX-512
XEON_PACKED = {1: 51.8, 2: 57.5, 3: 60.0, 4: 56.8, 8: 66.7, 16: 81.6, 32: 112.0, 64: 168.3, 128: 250.1}


@pytest.mark.parametrize("packed, want", [
    (XEON_PACKED, SmallProducts(packed=frozenset({4}), packed_up_to=128)),
    (XEON_PACKED | {64: 230.0}, SmallProducts(packed=frozenset({4}), packed_up_to=32)),  # as is clearly at 64: stops
    (XEON_PACKED | {64: 190.0}, SmallProducts(packed=frozenset({4}), packed_up_to=128)),  # a tie at 64 does not
    (XEON_PACKED | {8: 140.0}, SmallProducts(packed=frozenset({4}))),  # the band above 4 starts at the first point
    (XEON_PACKED | {8: 118.0}, SmallProducts(packed=frozenset({4}), packed_up_to=128)),  # ... unless that is a tie
    ({1: 30.0, 2: 49.0, 3: 52.0, 4: 40.0}, SmallProducts(padded=frozenset({2, 3}), packed=frozenset({1, 4}))),
    ({}, SmallProducts()),  # no oneDNN: as is everywhere (rows 8.. were not timed either way)
])
def test_the_packed_way_runs_the_counts_where_it_clearly_wins(packed, want):
    assert choose(XEON_ROWS, {}, 121, packed) == want


def test_calibrate_gives_every_layer_of_a_model_the_same_choice(hf_checkpoint):
    _, model_dir = hf_checkpoint
    runner = ModelRunner.load(model_dir, EngineConfig(num_blocks=16, block_size=4, device="cpu"))
    layers = linears(runner.model)
    assert len(layers) == 2 * 4 + 1  # per layer qkv, o, gate_up, down; the head
    small = calibrate(runner.model, repeats=1)  # which counts it picks is timing (one repeat: noisy under load)
    assert small.padded <= frozenset({1, 2, 3}) and small.by_columns <= frozenset({1, 2, 3, 4})
    assert all(layer.small == small for layer in layers)
    assert all((layer.weight_t is not None) == bool(small.by_columns) for layer in layers)
    packs = bool(small.packed) or small.packed_up_to > PAD_TO
    assert all((layer.weight_packed is not None) == packs for layer in layers)


@pytest.mark.parametrize("cache, tried", [(1, True), (10**12, False), (0, False)],
                         ids=["streamed", "cached", "unknown"])
def test_column_major_is_tried_only_for_linears_far_larger_than_the_cache(hf_checkpoint, monkeypatch, cache, tried):
    """Near the cache's size a second copy of the weights evicts the first: never tried there, nor
    where the cache's size is unknown."""
    _, model_dir = hf_checkpoint
    runner = ModelRunner.load(model_dir, EngineConfig(num_blocks=16, block_size=4, device="cpu"))
    timed: list[bool] = []
    real = calibration.pass_ms
    monkeypatch.setattr(calibration, "pass_ms", lambda layers, rows, way="rows":
                        timed.append(way == "columns") or real(layers, rows, way))
    monkeypatch.setattr(calibration, "largest_cache_bytes", lambda: cache)
    small = calibrate(runner.model, repeats=1)
    assert any(timed) == tried
    if not tried:
        assert not small.by_columns and all(layer.weight_t is None for layer in linears(runner.model))


def test_the_largest_cache_is_read_from_sysfs(tmp_path):
    for index, size in enumerate(["32K", "64K", "1024K", "32768K", "?"]):
        (tmp_path / f"index{index}").mkdir()
        (tmp_path / f"index{index}" / "size").write_text(size + "\n")
    assert calibration.largest_cache_bytes(tmp_path) == 32 * 2**20
    assert calibration.largest_cache_bytes(tmp_path / "missing") == 0


@pytest.mark.parametrize("small", [SmallProducts(padded=frozenset({2, 3})),
                                   SmallProducts(by_columns=frozenset({1, 2, 3})),
                                   pytest.param(SmallProducts(packed=frozenset(range(1, PAD_TO + 1)), packed_up_to=8),
                                                marks=needs_onednn)],
                         ids=["padded", "columns", "packed"])
@pytest.mark.parametrize("q_len", [1, 2, 3, 5])
def test_decodes_and_verifications_match_transformers_either_way(hf_checkpoint, small, q_len):
    """One sequence decoding, or verifying k = 1, 2 or 4 drafts, every small product run one way: the
    logits are transformers' own, whatever the calibration on this machine chose."""
    _, model_dir = hf_checkpoint
    runner = ModelRunner.load(model_dir, EngineConfig(num_blocks=16, block_size=4, device="cpu"))
    use(linears(runner.model), small)
    seq = torch.randint(0, 97, (21 + q_len,), generator=torch.Generator().manual_seed(q_len)).tolist()
    runner.forward([SeqInput(1, 0, seq[:21], num_logits=0)])
    [logits] = runner.forward([SeqInput(1, 21, seq[21:], num_logits=q_len)])
    torch.testing.assert_close(logits, hf_logits(model_dir, seq)[-q_len:], atol=ATOL, rtol=0)


def test_a_neighbour_busy_during_calibration_slows_every_way_alike(hf_checkpoint, monkeypatch):
    """On shared cores the other service loads while this one times its products. Timed way after
    way, a neighbour busy for the first part slowed only the as-is timings and one-row decodes went
    packed (25-30% slower on SmolLM2); timed in turn, each way's best repeat is a quiet one."""
    _, model_dir = hf_checkpoint
    runner = ModelRunner.load(model_dir, EngineConfig(num_blocks=16, block_size=4, device="cpu"))
    layers = linears(runner.model)
    if not can_pack(layers[0].weight):
        pytest.skip("this torch build has no oneDNN packed linear")
    quiet = {"rows": {1: 21.0, 2: 23.0, 3: 25.0, 4: 38.0, 8: 50.0, 16: 50.0, 32: 60.0, 64: 99.0, 128: 138.0},
             "packed": {1: 26.0, 2: 27.0, 3: 28.5, 4: 26.7, 8: 31.5, 16: 38.7, 32: 52.0, 64: 81.0, 128: 132.0}}
    calls: list[str] = []

    def neighbour_then_quiet(layers, rows, way="rows"):  # noqa: ANN001, ANN202
        calls.append(way)
        return quiet[way][rows] * (3.0 if len(calls) <= len(quiet["rows"]) else 1.0)

    monkeypatch.setattr(calibration, "pass_ms", neighbour_then_quiet)
    monkeypatch.setattr(calibration, "largest_cache_bytes", lambda: 10**12)  # no column-major copy
    small = calibrate(runner.model, repeats=3)
    assert small == choose(quiet["rows"], {}, len(layers), quiet["packed"])
    assert 1 not in small.packed and not small.padded, "one-row decodes run as is, as measured quietly"
    assert calls[:4] == ["rows", "packed", "rows", "packed"], "the ways are timed in turn"
