"""bench/step_profile.py: one target step's time split into nested parts, each measured around the
one inside it, so they must nest (step >= forward_ms >= runner >= model > 0) for every batch size,
k and prompt chunk beside the decodes; on CPU nothing is replayed from a graph."""

from __future__ import annotations

from transformers import LlamaConfig

from bench.step_profile import HEADER, profile
from tests.conftest import SMALL, write_checkpoint


def test_the_parts_of_a_step_nest_for_every_batch_and_k(tmp_path):
    model = write_checkpoint(LlamaConfig(**SMALL), tmp_path, seed=1)
    rows = profile(str(model), "cpu", eager=True, batches=[1, 3], ks=[0, 2], steps=3, chunks=(0, 48))
    assert [(r.batch, r.k, r.chunk) for r in rows] == [(b, k, c) for b in (1, 3) for k in (0, 2) for c in (0, 48)]
    for r in rows:
        assert r.step_ms >= r.forward_ms >= r.runner_ms >= r.model_ms > 0, r
        assert r.host_ms == r.step_ms - r.model_ms
        assert r.path == "eager" and r.replayed == 0
        assert r.row().count("|") == HEADER.splitlines()[0].count("|")


def test_repeats_run_the_whole_grid_again_in_the_same_order(tmp_path):
    model = write_checkpoint(LlamaConfig(**SMALL), tmp_path, seed=1)
    rows = profile(str(model), "cpu", eager=True, batches=[1], ks=[0, 1], steps=1, repeats=2)
    assert [(r.batch, r.k) for r in rows] == [(1, 0), (1, 1), (1, 0), (1, 1)]
