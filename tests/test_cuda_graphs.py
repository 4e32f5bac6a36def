"""CUDA graphs' fixed-shape layout for decode/verify steps (engine/cuda_graphs.py).

On any machine: the padded forward that a graph captures, run eagerly (capture=False), gives the
eager path's logits step after step, and leaves every sequence's KV cache as the eager path does
(padding writes only to the scratch block). With CUDA (marker `cuda`, run by make gpu-check): the
captured graphs replayed give the eager logits too.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig

from engine import EngineConfig, ModelRunner, SeqInput
from engine.cuda_graphs import bucket_for, buckets_up_to
from engine.model import FlatBatch
from tests.conftest import SMALL, write_checkpoint

VOCAB = SMALL["vocab_size"]


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_buckets():
    assert buckets_up_to(64) == [1, 2, 4, 8, 16, 32, 64]
    assert buckets_up_to(9) == [1, 2, 4, 8, 9] and buckets_up_to(1) == [1]
    assert [bucket_for(n, [1, 2, 4, 8, 9]) for n in (1, 3, 5, 9, 10)] == [1, 4, 8, 9, None]


def _script(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefill (eager: long chunks), then decode/verify steps (padded), with growing and shrinking
    batches, rollbacks after rejected drafts and block boundaries crossed."""
    out = []
    prompts = {s: tokens(s, n) for s, n in ((1, 21), (2, 6), (3, 13), (4, 30), (5, 3))}
    hist = {s: list(p) for s, p in prompts.items()}
    out += runner.forward([SeqInput(s, 0, p, 1) for s, p in prompts.items()])
    for step in range(8):
        batch = []
        for s in sorted(hist)[: 2 + step % 4]:
            k = (s + step) % 4  # 0..3 drafts
            new = tokens(100 * step + s, k + 1)
            batch.append(SeqInput(s, len(hist[s]), new, k + 1))
            hist[s] += new[: 1 + (s + step) % 2]  # keep some, reject the rest: rollback next step
        out += runner.forward(batch)
    return out


def _runners(model_dir, device: str = "cpu", dtype: str = "float32", backend: str = "auto"):
    cfg = EngineConfig(num_blocks=64, block_size=4, device=device, dtype=dtype, attention_backend=backend,
                       enforce_eager=True, cuda_graph_max_batch=4, cuda_graph_max_query=4)
    if backend == "flash":
        cfg = EngineConfig(**{**cfg.__dict__, "block_size": 256, "num_blocks": 8})
    return ModelRunner.load(model_dir, cfg), ModelRunner.load(model_dir, cfg)


@pytest.fixture(scope="module", params=["llama", "mistral-window"])
def model_dir(request, tmp_path_factory):
    config = LlamaConfig(**SMALL) if request.param == "llama" else MistralConfig(**SMALL, sliding_window=8)
    return write_checkpoint(config, tmp_path_factory.mktemp(request.param), seed=11)


def test_padded_layout_gives_the_eager_logits(model_dir):
    eager, padded = _runners(model_dir)
    padded.use_graphs(capture=False)
    want, got = _script(eager), _script(padded)
    assert padded.graphs.runs >= 6, "decode/verify steps took the padded path"
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
    real = [b for t in eager.blocks._tables.values() for b in t]
    torch.testing.assert_close(padded.kv_cache.k[:, real], eager.kv_cache.k[:, real], atol=1e-5, rtol=0)


def test_steps_that_do_not_fit_run_eagerly(model_dir):
    runner, _ = _runners(model_dir)
    runner.use_graphs(capture=False)
    g = runner.graphs

    def shape(query_lens):
        return g.shape_for(FlatBatch([], [], [], [], [[0]] * len(query_lens), [0] * len(query_lens), query_lens))

    assert shape([1, 1, 1]) == (4, 1) and shape([4, 2]) == (2, 4) and shape([3]) == (1, 4)
    assert shape([5]) is None  # a prompt chunk (longer than k_max + 1)
    assert shape([1] * 5) is None  # more sequences than the largest batch bucket


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (make gpu-check)")
@pytest.mark.parametrize("dtype,backend", [("float32", "torch"), ("bfloat16", "flash")])
def test_captured_graphs_give_the_eager_logits(model_dir, dtype, backend):
    if backend == "flash":
        pytest.importorskip("flash_attn")
    eager, graphs = _runners(model_dir, "cuda", dtype, backend)
    graphs.use_graphs(capture=True)
    want, got = _script(eager), _script(graphs)
    assert graphs.graphs.runs >= 6
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4 if dtype == "float32" else 5e-2, rtol=0)  # other GEMM shapes
